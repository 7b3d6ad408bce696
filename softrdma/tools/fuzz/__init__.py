"""``softrdma fuzz``: fire mutated RoCE frames at live soft devices, then check they survived.

What the tool does, for its user, is the doc of :mod:`.tool` (``softrdma fuzz --help``;
docs/fuzz.md). The package is split by job:

- :mod:`.tool`: the command line (options, their checks, the order of a run);
- :mod:`.seeds`: the seed frames, every RoCE packet of the captures under ``pcaps/`` (or
  of the reference captures installed with softrdma, :mod:`softrdma.data`);
- :mod:`.live`: the devices' arenas, MRs and QP pairs;
- :mod:`.mutators`: the named mutators, each a small function naming what it attacks,
  in tables with their weights;
- :mod:`.frames`: the frame maker, a seed aimed at a live QP and drawn through the tables;
- :mod:`.fuzzer`: the run (setup, the frames sent, legitimate traffic alongside, QPs the
  fuzzing broke reset and reconnected);
- :mod:`.checks`: the survival checks; :mod:`.report`: the summary.
"""

from __future__ import annotations

from .fuzzer import Check, Fuzzer, FuzzConfig
from .seeds import default_pcap_dir, load_seeds
from .tool import add_parser, run, run_fuzz

__all__ = ["add_parser", "run", "run_fuzz", "FuzzConfig", "Fuzzer", "Check", "load_seeds",
           "default_pcap_dir"]
