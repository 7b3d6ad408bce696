"""The command-line tools behind ``softrdma``: devices, devinfo, pingpong, perf."""
