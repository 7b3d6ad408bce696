"""``softrdma exec --dev-infiniband``: a ``/dev`` with uverbs nodes, for programs that
look for the kernel's before they use a device.

UCX lists an IB device only if ``/dev/infiniband/<dev_name>`` is a character device the
user may read and write (``uct_ib_device_is_accessible``, ucx src/uct/ib/base/ib_md.c);
softrdma's devices carry rdma-core's names (``uverbs0``, ...), and a host without RDMA
drivers has no such node. With this option the program runs in a mount namespace of its
own (``unshare -m`` as root; ``unshare -Urm`` otherwise, a user namespace in which the
program is that namespace's uid 0) whose ``/dev`` is a tmpfs holding bind mounts of every
entry of the host's ``/dev`` -- ``/dev/shm`` included, so processes still share it -- and
``/dev/infiniband/uverbs0`` ... ``uverbs7``, links to ``/dev/null``: any character device
passes the check, and nothing opens it. The host's ``/dev`` is not touched.
"""

from __future__ import annotations

import os
import shutil
import tempfile

__all__ = ["wrap"]

#: sh script: ``$1`` an empty directory (the host's /dev is bound there first), then the
#: command to run in the new /dev
SCRIPT = r"""
set -e
d=$1; shift
mount --rbind /dev "$d"
mount -t tmpfs -o mode=755 softrdma-dev /dev
for e in "$d"/*; do
  n=/dev/${e##*/}
  if [ -L "$e" ]; then cp -P "$e" "$n"
  elif [ -d "$e" ]; then mkdir "$n"; mount --rbind "$e" "$n"
  else : > "$n"; mount --bind "$e" "$n"
  fi
done
mkdir -p /dev/infiniband
for i in 0 1 2 3 4 5 6 7; do ln -sf /dev/null "/dev/infiniband/uverbs$i"; done
exec "$@"
"""


def wrap(argv: list[str]) -> list[str]:
    """``argv`` run in a mount namespace with the uverbs nodes (OSError without
    util-linux's ``unshare``)."""
    unshare = shutil.which("unshare")
    if unshare is None:
        raise OSError("--dev-infiniband needs unshare (util-linux)")
    # the mount point of the host's /dev inside each namespace: one empty directory serves
    # them all (mounts are per namespace)
    host_dev = os.path.join(tempfile.gettempdir(), f"softrdma-exec-dev-{os.getuid()}")
    os.makedirs(host_dev, exist_ok=True)
    flags = "-m" if os.geteuid() == 0 else "-Urm"
    return [unshare, flags, "sh", "-c", SCRIPT, "sh", host_dev, *argv]
