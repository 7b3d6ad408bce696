"""``python -m softrdma.bench wire|engines|qps|udp ...``: the same as ``softrdma bench ...``."""

import sys

from ..cli import main

if __name__ == "__main__":  # not on import (tests import every module of the package)
    sys.exit(main(["bench", *sys.argv[1:]]))
