"""``python -m softrdma.bench wire|engines|qps|udp ...``: the same as ``softrdma bench ...``."""

import sys

from ..cli import main

sys.exit(main(["bench", *sys.argv[1:]]))
