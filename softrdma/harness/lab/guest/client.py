"""Send one request to a lab guest's agent: ``python3 client.py IP PORT JSON``.

Run by the host (in the lab's network namespace); prints the agent's JSON answer, or
``{"rc": 255, ...}`` when the agent cannot be reached within the request's ``_connect``
seconds (5 by default: a guest still booting).
"""

import json
import socket
import sys
import time


def main():
    ip, port, req = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
    deadline = req.pop("_connect", 5)
    t = time.time()
    while True:
        try:
            c = socket.create_connection((ip, port), timeout=2)
            break
        except OSError:
            if time.time() - t > deadline:
                print(json.dumps({"rc": 255, "stdout": "", "stderr": "agent unreachable"}))
                sys.exit(0)
            time.sleep(0.5)
    c.settimeout(None)
    f = c.makefile("rwb")
    f.write((json.dumps(req) + "\n").encode())
    f.flush()
    sys.stdout.write(f.readline().decode())


if __name__ == "__main__":
    main()
