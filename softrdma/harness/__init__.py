"""Harnesses: what drives the stack from outside, for tests, experiments and conformance.

- :mod:`.sim`: a simulated network of soft devices on a virtual clock, with seeded loss,
  duplication, reordering, delay and corruption;
- :mod:`.testing`: two connected endpoints (context, PD, CQ, MR, QP in RTS) in one call;
- :mod:`.replay`: a capture of real RoCE traffic replayed against softrdma's engines;
- :mod:`.lab`: real Linux rxe peers in VMs (its guest scripts are in ``lab/guest/``).

Nothing in the stack below imports a harness.
"""
