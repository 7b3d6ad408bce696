"""A lab of real Linux rxe peers: kernel rxe in VMs, next to softrdma, in a private network.

``Lab`` creates a network namespace with a bridge (10.77.0.1/24, the softrdma side), boots
guests with the Debian kernel under qemu (virtme-ng, software emulation), gives each guest an
address (10.77.0.11, .12, ...) and an rxe device ``rxe0`` on its NIC, and runs a small
command agent in each. The guest side is three real files beside this module, in ``guest/``:
``setup.sh`` (the guest's first command), ``agent.py`` (the agent it becomes) and
``client.py`` (what the host runs to send the agent a request). Guests share the host's root filesystem read-only, so every host
binary (rdma-core's ibv_*_pingpong, perftest, python3, this project) is there.

    with Lab(guests=1) as lab:
        srv = lab.guest_start(0, "ibv_rc_pingpong -g 1 -n 5")       # rxe as the server
        r = lab.host("softrdma pingpong rc -a 10.77.0.1 -n 5 10.77.0.11")
        print(r.stdout, srv.wait().stdout)

Traffic never leaves the namespace. Everything is torn down on ``close()``, on exit and on
SIGTERM/SIGINT. ``docs/lab.md`` has the command-line form (``softrdma lab ...``).
"""

from __future__ import annotations

import atexit
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

__all__ = ["Lab", "LabUnavailable", "Result", "missing_prerequisites", "HOST_IP", "guest_ip",
           "GuestJob", "cm_listeners", "kernels", "DEFAULT_KERNEL", "KERNEL_PACKAGES",
           "kernel_choice", "kernel_missing"]

HOST_IP = "10.77.0.1"
AGENT_PORT = 7777
#: tcpdump's snapshot length in the lab: whole frames (1500-byte MTU). Not 0 (262144): the
#: captures use --immediate-mode (without it libpcap hands packets over a ring block at a
#: time, and the last ones are lost when tcpdump is stopped), in which libpcap gives each
#: packet a ring slot of the snapshot length, and a 2 MB ring of 256 KB slots dropped
#: packets of a lossy perftest run on a loaded host (-B 16384 too: 16 MB)
SNAPLEN = "2048"
BOOT_TIMEOUT = 240.0  # seconds; TCG boots take 30-45 s, slower when the machine is busy


def guest_ip(i: int) -> str:
    return f"10.77.0.{11 + i}"


class LabUnavailable(RuntimeError):
    """A prerequisite is missing (the message says which and how to get it)."""


@dataclass
class Result:
    rc: int
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.rc == 0


#: the guest kernel a lab boots when none is named: Debian 12's default kernel, the reference
#: peer every interop scenario was written against
DEFAULT_KERNEL = "6.1"


def _release_key(path: Path) -> tuple[int, ...]:
    """``vmlinuz-6.12.57+deb12-amd64`` -> (6, 12, 57): releases compared as numbers (a plain
    string sort puts 6.12 after 6.1 but also 6.9 after 6.12)."""
    rel = path.name.removeprefix("vmlinuz-")
    nums = []
    for part in rel.replace("-", ".").replace("+", ".").split("."):
        if not part.isdigit():
            break
        nums.append(int(part))
    return tuple(nums)


#: the Debian package that installs each series' image (what missing_prerequisites names)
KERNEL_PACKAGES = {"6.1": "linux-image-amd64", "6.12": "linux-image-6.12-amd64"}


def kernels(root: str | Path = "/") -> dict[str, str]:
    """The guest kernels this machine can boot: ``{"6.1": "/boot/vmlinuz-6.1.0-56-amd64",
    "6.12": "/boot/vmlinuz-6.12.117+deb12-amd64"}``, keyed by major.minor (the newest image of
    each series), oldest series first. An image counts only with its modules beside it
    (``lib/modules/<release>``): the guest loads rdma_rxe from there (virtme-ng mounts the
    host's /lib/modules), and Debian installs both together. ``root`` is the filesystem
    they are looked up in (a test's fake tree)."""
    root = Path(root)
    out: dict[str, str] = {}
    for path in sorted((root / "boot").glob("vmlinuz-*"), key=_release_key):
        key = _release_key(path)
        if len(key) >= 2 and (root / "lib" / "modules" /
                              path.name.removeprefix("vmlinuz-")).is_dir():
            out[f"{key[0]}.{key[1]}"] = str(path)
    return dict(sorted(out.items(), key=lambda kv: tuple(map(int, kv[0].split(".")))))


def kernel_choice(choice: str | None = None) -> str:
    """What the caller asked for: ``choice``, else ``$SOFTRDMA_LAB_KERNEL``, else
    :data:`DEFAULT_KERNEL`."""
    return choice or os.environ.get("SOFTRDMA_LAB_KERNEL") or DEFAULT_KERNEL


def _kernel(choice: str | None = None, root: str | Path = "/") -> str | None:
    """The image for ``choice``: a path, or a series ("6.1", "6.12"); None for the default."""
    choice = kernel_choice(choice)
    if "/" in choice:
        return choice if Path(choice).exists() else None
    return kernels(root).get(choice)


def kernel_missing(choice: str | None = None, root: str | Path = "/") -> str | None:
    """None when ``choice`` (see :func:`kernel_choice`) can boot, else one line saying what is
    missing: the package for a known series, the bootable kernels for an unknown one."""
    if _kernel(choice, root) is not None:
        return None
    want = kernel_choice(choice)
    have = ", ".join(kernels(root)) or "none"
    if want in KERNEL_PACKAGES:
        return (f"a {want} kernel image in /boot with its modules "
                f"({KERNEL_PACKAGES[want]}; bootable here: {have})")
    what = "no such file" if "/" in want else "not a kernel series of this machine"
    return f"guest kernel {want!r}: {what} (bootable here: {have}, or a /boot/vmlinuz-* path)"


def tool_path() -> str:
    """The PATH the lab runs its tools with: this interpreter's own bin directory first.

    virtme-ng installs ``vng`` and ``virtme-run`` beside the interpreter of a virtual
    environment, and ``vng`` runs ``virtme-run`` by name. A program started as
    ``.venv/bin/python`` without the venv activated (CI, the README's test command) does not
    have that directory on PATH, so it is added here rather than expected from the caller.
    """
    here = str(Path(sys.executable).parent)  # not resolved: a venv's python is a symlink
    parts = [here] + [p for p in os.environ.get("PATH", os.defpath).split(os.pathsep)
                      if p and p != here]
    for sysdir in ("/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin"):
        if sysdir not in parts:  # ip, tc and qemu live in sbin, which a user PATH may lack
            parts.append(sysdir)
    return os.pathsep.join(parts)


def tool_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """os.environ with :func:`tool_path` as PATH (and ``extra`` on top)."""
    env = dict(os.environ)
    env["PATH"] = tool_path()
    env.update(extra or {})
    return env


def _vng() -> str:
    """virtme-ng's command, found on :func:`tool_path`."""
    return shutil.which("vng", path=tool_path()) or "vng"


def vng_command(kernel: str, *args: str) -> list[str]:
    """The virtme-ng command line that boots ``kernel`` under TCG (the recipe's flags)."""
    return [_vng(), "--run", kernel, "--disable-kvm", "--force-9p", *args]


def _python() -> str:
    """The host interpreter by its real path: guests see the host's files, not its PATH
    tricks (a pyenv shim does not run there)."""
    return os.path.realpath(sys.executable)


def missing_prerequisites(kernel: str | None = None) -> list[str]:
    """What this machine lacks to run the lab with guest kernel ``kernel`` (empty when it can)."""
    out = []
    if os.geteuid() != 0:
        out.append("root (network namespaces, tap devices)")
    path = tool_path()
    for exe, pkg in (("ip", "iproute2"), ("qemu-system-x86_64", "qemu-system-x86"),
                     ("vng", "virtme-ng (pip)"), ("virtme-run", "virtme-ng (pip)"),
                     ("ibv_rc_pingpong", "ibverbs-utils"), ("ib_write_bw", "perftest"),
                     ("rdma", "iproute2 (rdma tool)"), ("tcpdump", "tcpdump")):
        if shutil.which(exe, path=path) is None:
            out.append(f"{exe} ({pkg})")
    miss = kernel_missing(kernel)
    if miss:
        out.append(miss)
    return out


#: the guest's scripts, shipped as package data (``guest/``): copied into the lab's directory,
#: which the guests mount read-write (virtme-ng ``--rwdir``)
GUEST_SCRIPTS = ("agent.py", "setup.sh", "client.py")


def guest_script(name: str) -> str:
    """The text of one of :data:`GUEST_SCRIPTS`."""
    return resources.files(__name__).joinpath("guest", name).read_text()


def cm_listeners(rdma_json: str) -> list[dict]:
    """The listening rdma_cm IDs in the output of ``rdma -j resource show cm_id``.

    Each is a dict as iproute2 prints it, e.g. ``{"state": "LISTEN", "ps": "TCP", "comm":
    "rping", "src-addr": "10.77.0.11:7174", ...}`` (``0.0.0.0:PORT`` for a server bound to
    any address). rping, ucmatose, rdma_server and perftest ``-R`` listen in the TCP port
    space, udaddy in the UDP one."""
    try:
        ids = json.loads(rdma_json or "[]")
    except ValueError:
        return []
    return [d for d in ids if isinstance(d, dict) and d.get("state") == "LISTEN"]


class GuestJob:
    """A command started in a guest with :meth:`Lab.guest_start` (in a session of its own)."""

    def __init__(self, lab: "Lab", guest: int, job_id: str) -> None:
        self.lab, self.guest, self.id = lab, guest, job_id
        self.done = False

    def wait(self, timeout: float = 120) -> Result:
        """Its exit status and output; still running after ``timeout``, it is killed (rc 124)."""
        self.done = True
        return self.lab._agent(self.guest, {"op": "wait", "id": self.id, "timeout": timeout},
                               timeout + 10)

    def running(self) -> bool:
        return not self.done and self.lab._agent(
            self.guest, {"op": "poll", "id": self.id}, 30).stdout == "running"

    def kill(self, sig: int = signal.SIGTERM, timeout: float = 10) -> Result:
        """Send ``sig`` to every process of its session and collect it (SIGKILL after
        ``timeout``). SIGINT stops a guest tcpdump cleanly; a job that had already ended
        reports as :meth:`wait` would."""
        self.done = True
        return self.lab._agent(self.guest, {"op": "kill", "id": self.id, "signal": int(sig),
                                            "timeout": timeout}, timeout + 20)


class Lab:
    def __init__(self, guests: int = 1, *, memory: str = "1G", workdir: str | None = None,
                 boot_timeout: float = BOOT_TIMEOUT, kernel: str | None = None) -> None:
        """``kernel``: the guests' kernel, a series of :func:`kernels` ("6.1", "6.12") or an
        image path; default :data:`DEFAULT_KERNEL` (or ``$SOFTRDMA_LAB_KERNEL``)."""
        miss = missing_prerequisites(kernel)
        if miss:
            raise LabUnavailable("the rxe lab needs: " + ", ".join(miss))
        self.n = guests
        self.kernel_image = _kernel(kernel) or ""
        #: the guests' kernel release, e.g. "6.12.57+deb12-amd64"
        self.kernel_release = Path(self.kernel_image).name.removeprefix("vmlinuz-")
        self.ns = f"srxlab{os.getpid()}"
        self.dir = Path(workdir or tempfile.mkdtemp(prefix="softrdma-lab-"))
        self.dir.mkdir(parents=True, exist_ok=True)
        self.procs: list[subprocess.Popen] = []
        self.host_procs: list[subprocess.Popen] = []
        self._job = 0
        self.guest_jobs: list[GuestJob] = []
        self.closed = False
        self.nics: dict[int, str] = {}
        atexit.register(self.close)
        self._old_handlers = {}
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self._old_handlers[sig] = signal.signal(sig, self._on_signal)
            except ValueError:  # not the main thread
                pass
        try:
            self._up(memory, boot_timeout)
        except BaseException:
            self.close()
            raise

    # -- life cycle ---------------------------------------------------------------------
    def _on_signal(self, signum: int, frame: Any) -> None:
        self.close()
        old = self._old_handlers.get(signum)
        if callable(old):
            old(signum, frame)
        else:
            raise SystemExit(128 + signum)

    def _sh(self, cmd: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(cmd, shell=True, capture_output=True, text=True, check=check,
                              env=tool_env())

    def _up(self, memory: str, boot_timeout: float) -> None:
        for name in GUEST_SCRIPTS:
            (self.dir / name).write_text(guest_script(name))
        os.chmod(self.dir / "setup.sh", 0o755)
        ns = self.ns
        self._sh(f"ip netns add {ns}")
        taps = " ".join(f"tap{i}" for i in range(self.n))
        self._sh(f"ip netns exec {ns} sh -c 'ip link set lo up; ip link add br0 type bridge; "
                 f"ip addr add {HOST_IP}/24 dev br0; ip link set br0 up; for t in {taps}; do "
                 f"ip tuntap add dev $t mode tap; ip link set $t master br0; ip link set $t up; "
                 f"done'")
        kernel = self.kernel_image
        for i in range(self.n):
            mac = f"52:54:00:00:00:{0x11 + i:02x}"
            cmd = ["ip", "netns", "exec", ns] + vng_command(
                   kernel, "--name", f"g{i}", "--memory", memory, "--rwdir", str(self.dir),
                   f"--qemu-opts=-netdev tap,id=t{i},ifname=tap{i},script=no,downscript=no "
                   f"-device virtio-net-pci,netdev=t{i},mac={mac}",
                   "--exec", f"{self.dir}/setup.sh {guest_ip(i)} {self.dir} {_python()} "
                             f"{AGENT_PORT}")
            log = open(self.dir / f"guest{i}.log", "w")
            self.procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                               stdin=subprocess.DEVNULL, start_new_session=True,
                                               env=tool_env()))
        deadline = time.monotonic() + boot_timeout
        for i in range(self.n):
            while True:
                r = self._agent(i, {"op": "ping", "_connect": 3}, 10)
                if r.ok:
                    break
                if self.procs[i].poll() is not None or time.monotonic() > deadline:
                    log = (self.dir / f"guest{i}.log").read_text()[-2000:]
                    raise LabUnavailable(f"guest {i} did not come up: {log}")
            nic_file = self.dir / f"nic.{guest_ip(i)}"
            self.nics[i] = nic_file.read_text().strip() if nic_file.exists() else "eth0"

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for p in self.host_procs:
            if p.poll() is None:
                p.kill()
        for i, p in enumerate(self.procs):
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except OSError:
                    pass
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        subprocess.run(["ip", "netns", "del", self.ns], capture_output=True, env=tool_env())
        for sig, old in self._old_handlers.items():
            try:
                signal.signal(sig, old)
            except (ValueError, TypeError):
                pass

    def __enter__(self) -> "Lab":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- running things ---------------------------------------------------------------------
    def _agent(self, guest: int, req: dict, timeout: float) -> Result:
        cmd = ["ip", "netns", "exec", self.ns, sys.executable, str(self.dir / "client.py"),
               guest_ip(guest), str(AGENT_PORT), json.dumps(req)]
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                               env=tool_env())
        except subprocess.TimeoutExpired:
            return Result(124, "", "agent request timed out")
        try:
            d = json.loads(p.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            return Result(255, p.stdout, p.stderr)
        return Result(d["rc"], d["stdout"], d["stderr"])

    def guest(self, i: int, cmd: str, timeout: float = 120) -> Result:
        """Run ``cmd`` (a shell line) in guest ``i`` and wait for it."""
        return self._agent(i, {"op": "run", "cmd": cmd, "timeout": timeout}, timeout + 15)

    def guest_start(self, i: int, cmd: str) -> GuestJob:
        """Start ``cmd`` in guest ``i`` in the background; ``.wait()`` collects it."""
        self._job += 1
        jid = f"j{self._job}"
        r = self._agent(i, {"op": "start", "id": jid, "cmd": cmd}, 30)
        if not r.ok:
            raise RuntimeError(f"could not start {cmd!r} in guest {i}: {r.stderr}")
        job = GuestJob(self, i, jid)
        self.guest_jobs.append(job)
        return job

    def kill_guest_jobs(self) -> None:
        """Kill guest jobs that were started and never waited for (a failed test's server
        that would otherwise hold its rdma_cm port or UDP 4791 for the next one)."""
        for job in self.guest_jobs:
            if not job.done:
                job.kill(signal.SIGKILL, timeout=5)
        self.guest_jobs = []

    def cm_listeners(self, i: int) -> list[dict]:
        """The rdma_cm IDs listening in guest ``i`` (see :func:`cm_listeners`)."""
        return cm_listeners(self.guest(i, "rdma -j resource show cm_id", timeout=30).stdout)

    def wait_cm_listen(self, i: int, port: int, ps: str = "TCP", timeout: float = 30) -> bool:
        """Wait until an rdma_cm server in guest ``i`` listens on ``port`` in port space
        ``ps`` ("TCP": rping, ucmatose, rdma_server, perftest -R; "UDP": udaddy). Use it
        instead of a guessed sleep between starting a server and its client."""
        deadline = time.monotonic() + timeout
        while True:
            if any(d.get("ps") == ps and str(d.get("src-addr", "")).endswith(f":{port}")
                   for d in self.cm_listeners(i)):
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.2)

    def guest_capture(self, i: int, name: str, filt: str = "udp port 4791",
                      timeout: float = 30, iface: str | None = None,
                      direction: str | None = None) -> GuestJob:
        """tcpdump on guest ``i``'s own NIC (or ``iface``, e.g. ``ifb0``) into ``self.dir /
        name`` (the directory the guests share with the host); stop it with
        ``.kill(signal.SIGINT)``. ``direction`` "in" or "out" is tcpdump's ``-Q``. The guest's
        clock stamps the packets (see :meth:`guest_clock_offset`). Returns once tcpdump has
        created the file, i.e. is capturing."""
        path = self.dir / name
        path.unlink(missing_ok=True)
        q = f"-Q {direction} " if direction else ""
        # --immediate-mode: see SNAPLEN
        job = self.guest_start(i, f"exec tcpdump -i {iface or self.nics[i]} {q}-U "
                                  f"--immediate-mode -B 16384 -s {SNAPLEN} -w {path} {filt}")
        deadline = time.monotonic() + timeout
        while not path.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        if not path.exists():
            r = job.kill(signal.SIGKILL)
            raise RuntimeError(f"tcpdump did not start in guest {i}: {r.stderr}")
        return job

    def _host_argv(self, cmd: str | list[str]) -> list[str]:
        argv = shlex.split(cmd) if isinstance(cmd, str) else list(cmd)
        if argv and argv[0] == "softrdma":
            argv = [sys.executable, "-m", "softrdma"] + argv[1:]
        elif argv and argv[0] in ("python3", "python"):
            argv = [sys.executable] + argv[1:]
        return ["ip", "netns", "exec", self.ns] + argv

    def host(self, cmd: str | list[str], timeout: float = 120,
             env: dict[str, str] | None = None) -> Result:
        """Run ``cmd`` on the softrdma side (in the lab's namespace) and wait for it."""
        try:
            p = subprocess.run(self._host_argv(cmd), capture_output=True, text=True,
                               timeout=timeout, env=self.env(env))
        except subprocess.TimeoutExpired as e:
            return Result(124, (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else
                          (e.stdout or ""), "TIMEOUT")
        return Result(p.returncode, p.stdout, p.stderr)

    def host_start(self, cmd: str | list[str], env: dict[str, str] | None = None,
                   stdout: Any = subprocess.PIPE, stderr: Any = subprocess.PIPE
                   ) -> subprocess.Popen:
        """Start ``cmd`` on the softrdma side. Its output goes to pipes nobody reads until
        ``communicate``: a command printing more than a pipe holds (64 KB) blocks, so give
        such a one files as ``stdout``/``stderr``."""
        p = subprocess.Popen(self._host_argv(cmd), stdout=stdout, stderr=stderr,
                             text=True, env=self.env(env))
        self.host_procs.append(p)
        return p

    def kill_host_procs(self) -> None:
        """Kill host-side commands started with host_start that are still running."""
        for p in self.host_procs:
            if p.poll() is None:
                p.kill()
                try:
                    p.communicate(timeout=10)
                except (subprocess.TimeoutExpired, ValueError):
                    pass
        self.host_procs = [p for p in self.host_procs if p.poll() is None]

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        env = tool_env(extra)
        root = str(Path(__file__).resolve().parents[3])  # the directory holding softrdma/
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        return env

    def capture(self, path: str | Path, iface: str = "br0") -> subprocess.Popen:
        """tcpdump of RoCEv2 traffic into ``path``; stop with ``.terminate()``. ``br0`` sees
        everything softrdma sends and receives, and the traffic between two guests too:
        tcpdump makes br0 promiscuous, and a promiscuous bridge passes every frame it
        forwards up its own interface (``tap0`` holds the same frames for guest 0)."""
        p = subprocess.Popen(["ip", "netns", "exec", self.ns, "tcpdump", "-i", iface, "-U",
                              "--immediate-mode", "-B", "16384", "-s", SNAPLEN, "-w", str(path),
                              "udp", "port", "4791"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                             env=tool_env())
        # tcpdump says "listening on br0" once the capture is armed; packets sent before
        # that are lost, so wait for it rather than for a guessed delay
        assert p.stderr is not None
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            line = p.stderr.readline()
            if not line or "listening on" in line:
                break
        return p

    def netem(self, i: int, spec: str | None) -> Result:
        """Apply ``tc netem`` (e.g. "loss 5%") to guest ``i``'s NIC, or remove it (None).
        It acts on what the guest sends: for loss both ways between two guests, apply it to
        both; against softrdma, pair it with softrdma's own injection (SOFTRDMA_TX_LOSS)."""
        nic = self.nics[i]
        if spec is None:
            return self.guest(i, f"tc qdisc del dev {nic} root 2>/dev/null; true")
        return self.guest(i, f"tc qdisc replace dev {nic} root netem {spec}")

    def netem_clear(self) -> None:
        """Remove netem from every guest."""
        for i in range(self.n):
            self.netem(i, None)

    # -- faults on RoCE traffic only, and what the guests count --------------------------------
    #: the u32 match for RoCEv2 (UDP destination port 4791 in an IPv4 header without options)
    ROCE_MATCH = "match ip protocol 17 0xff match ip dport 4791 0xffff"
    #: packets a plain RoCE FIFO holds: ifb0's default (its txqueuelen, 32) drops bursts
    FIFO_LIMIT = 10000

    def roce_fault_setup(self, i: int) -> Result:
        """Prepare guest ``i`` for :meth:`roce_netem`: RoCEv2 packets only (UDP 4791) go
        through a qdisc that netem can replace, on both sides of the guest's NIC; the agent's
        TCP and the tools' out-of-band exchanges are never delayed or lost.

        Egress: a ``prio`` root on the NIC whose band 3 (class ``1:3``, qdisc ``30:``) gets
        RoCE by a u32 filter. Ingress: RoCE is redirected (``mirred``) to ``ifb0``, whose
        root (``1:``) plays the same part. The host kernel has no netem (so no netem on the
        host's tap devices); an ifb in the receiving guest is where a loss can sit *after*
        the wire: tcpdump on the NIC sees an arriving packet before the ingress qdisc, tcpdump
        on ``ifb0`` after it, i.e. what reached rxe."""
        nic = self.nics[i]
        m = self.ROCE_MATCH
        return self.guest(i, " && ".join([
            f"tc qdisc replace dev {nic} root handle 1: prio bands 3 "
            "priomap 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0",
            f"tc qdisc replace dev {nic} parent 1:3 handle 30: pfifo limit {self.FIFO_LIMIT}",
            f"tc filter replace dev {nic} parent 1: protocol ip prio 1 handle 800::800 u32 {m} "
            "flowid 1:3",
            "(ip link show ifb0 >/dev/null 2>&1 || modprobe ifb numifbs=1 || "
            "ip link add ifb0 type ifb)",
            # else ifb0 sends IPv6 router solicitations of its own through its netem,
            # which then counts packets that are neither RoCE nor in any capture
            "sysctl -qw net.ipv6.conf.ifb0.disable_ipv6=1", "ip link set ifb0 up",
            f"tc qdisc replace dev ifb0 root handle 1: pfifo limit {self.FIFO_LIMIT}",
            f"(tc qdisc del dev {nic} ingress 2>/dev/null; true)",
            f"tc qdisc add dev {nic} handle ffff: ingress",
            f"tc filter add dev {nic} parent ffff: protocol ip prio 1 u32 {m} "
            "action mirred egress redirect dev ifb0"]))

    def roce_netem(self, i: int, spec: str | None, direction: str = "egress") -> Result:
        """Put ``tc netem {spec}`` (e.g. "loss 3%") on guest ``i``'s RoCE traffic, or a plain
        FIFO (None): ``direction`` "egress" acts on what the guest sends, before any capture
        point sees it; "ingress" on what it receives, after the wire and the guest's own NIC
        capture saw it, before rxe gets it. Needs :meth:`roce_fault_setup`. A new qdisc each
        time, so its counters (:meth:`qdisc_stats`) start at zero."""
        dev, where = ((self.nics[i], "parent 1:3 handle 30:") if direction == "egress" else
                      ("ifb0", "root handle 1:"))
        # a new qdisc (so new counters): delete and add, as "replace" keeps a netem's
        # counters and refuses another kind under the same handle
        parent = where.split(" handle")[0]
        qd = f"netem {spec}" if spec else f"pfifo limit {self.FIFO_LIMIT}"
        return self.guest(i, f"tc qdisc del dev {dev} {parent} 2>/dev/null; "
                             f"tc qdisc add dev {dev} {where} {qd}")

    def qdisc_stats(self, i: int) -> dict[str, dict[str, Any]]:
        """The RoCE qdiscs of guest ``i`` with their counters, as ``tc -s -j qdisc`` gives
        them: {"egress": {...}, "ingress": {...}} (kind, options, bytes, packets, drops,
        overlimits, requeues, backlog, qlen)."""
        out: dict[str, dict[str, Any]] = {}
        for key, dev, handle in (("egress", self.nics[i], "30:"), ("ingress", "ifb0", "1:")):
            r = self.guest(i, f"tc -s -j qdisc show dev {dev}", timeout=30)
            try:
                qds = json.loads(r.stdout or "[]")
            except ValueError:
                qds = []
            out[key] = next((q for q in qds if q.get("handle") == handle), {})
        return out

    def rdma_statistics(self, i: int, link: str = "rxe0/1") -> dict[str, int]:
        """rxe's counters of guest ``i`` (``rdma -j statistic show link rxe0/1``): sent_pkts,
        rcvd_pkts, duplicate_request, out_of_seq_request, rcvd_rnr_err, send_rnr_err,
        rcvd_seq_err, ack_deferred, retry_exceeded_err, retry_rnr_exceeded_err,
        completer_retry_err, send_err, link_downed, rdma_sends, rdma_recvs (the same 15 on 6.1
        and 6.12)."""
        r = self.guest(i, f"rdma -j statistic show link {link}", timeout=30)
        try:
            rows = json.loads(r.stdout or "[]")
        except ValueError:
            return {}
        return {k: v for row in rows for k, v in row.items() if isinstance(v, int)
                and k not in ("port",)}

    def guest_clock_offset(self, i: int) -> tuple[float, float]:
        """(offset, uncertainty) in seconds of guest ``i``'s clock against the host's: guest
        time = host time + offset, read as the midpoint of one agent round trip (the
        uncertainty is half of it). Guest captures are stamped by the guest's clock."""
        t0 = time.time()
        r = self.guest(i, "date +%s.%N", timeout=30)
        t1 = time.time()
        return float(r.stdout.strip()) - (t0 + t1) / 2, (t1 - t0) / 2
