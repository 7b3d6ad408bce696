"""softrdma.ibverbs: the verbs of :mod:`softrdma.verbs_api` on a real libibverbs device.

The same program runs on a soft device or on a kernel device (``rxe0``, a NIC), changing
only the device name: ``Context(name="rxe0")`` returns a context whose objects are the
verbs_api classes holding the hardware implementations (see :mod:`.objects`). Pure Python over ctypes (:mod:`.ffi`); nothing is loaded until a
hardware device is asked for, and a machine without libibverbs or devices sees only the
soft ones, silently.

Modules: :mod:`.ffi` (layouts, prototypes, ops callers), :mod:`.layout` (checks the
layouts against verbs.h), :mod:`.devices` (listing and opening devices),
:mod:`.convert` (Python objects <-> C structs), :mod:`.objects` (the implementations,
:data:`.objects.BACKEND`), :mod:`.context`, :mod:`.memory`, :mod:`.completion`,
:mod:`.queues` (each implementation).
"""
