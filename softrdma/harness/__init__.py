"""Harnesses: what drives the stack from outside, for tests, experiments and conformance.

- :mod:`.sim`: a simulated network of soft devices on a virtual clock, with seeded loss,
  duplication, reordering, delay and corruption;
- :mod:`.testing`: two connected endpoints (context, PD, CQ, MR, QP in RTS) in one call;
- :mod:`.replay`: a capture of real RoCE traffic replayed against softrdma's engines;
- :mod:`.replaydiff`: a replay's differences, packet by packet and field by field;
- :mod:`.fixtures`: live devices on free loopback addresses, QP pairs over the simulated
  network or UDP, a packet tap (what :mod:`softrdma.pytest_plugin`'s fixtures stand on);
- :mod:`.inject`: crafted packets, as bytes or scapy packets, into a soft device's receive
  path;
- :mod:`.lab`: real Linux rxe peers in VMs (its guest scripts are in ``lab/guest/``).

Nothing in the stack below imports a harness.
"""
