"""Benchmarks, one entry: ``softrdma bench wire|engines|qps|udp|scale|capture|...`` (``python -m
softrdma.bench ...`` is the same). Each prints its numbers beside a baseline measured in
the same run:

- :mod:`.wire`: parse/build + ICRC of one packet, beside bare ``zlib.crc32`` of its bytes;
- :mod:`.engines`: RC WRITE and SEND through the engines over the in-memory link, beside
  ``zlib.crc32`` over the same bytes;
- :mod:`.qps`: memory and creation time of idle RC QPs, beside the targets;
- :mod:`.udp`: ``softrdma perf`` between two processes on loopback, beside bare Python UDP;
- :mod:`.verbs`: one pyverbs RDMA WRITE loop through softrdma and Debian's pyverbs, beside
  ib_write_bw, on one device;
- :mod:`.cexec`: ib_write_bw and ib_send_lat under ``softrdma exec`` (both ends) beside
  ``softrdma perf write`` / ``send --lat``: the cost of crossing from C into Python, against
  issue 30's 0.8 targets (``run_exec_goals``);
- :mod:`.scale`: 1,000 QPs streaming beside one, 65,536 QPs' memory, timer and dispatch
  costs with 65,536 QPs beside one, idle CPU with 1,000 QPs beside none;
- :mod:`.capture`: a long capture (made by :mod:`.capgen` from real rxe captures, with
  :mod:`.caploss`'s losses if asked) read by read_pcap, dissect and check, beside tshark.

The command line is :mod:`softrdma.tools.bench`; importing this package imports no
benchmark (``udp`` starts helper processes from :mod:`.udp` and they start fast).
"""
