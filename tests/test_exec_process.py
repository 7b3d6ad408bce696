"""``softrdma exec``'s process machinery (softrdma.exec.process, issue 27): which Python
runs the library's code in a C program and in a Python program, Pythons of another
version, fork while threads are inside the library, and what the program's own device
reads from the environment (capture, faults, tracing). Real binaries: Debian's
ibv_devices and ibv_rc_pingpong, Debian's and pyenv's Pythons; one small C program
compiled here for fork, which no installed tool does with verbs in use."""

from __future__ import annotations

import errno
import os
import re
import subprocess
import sys
from pathlib import Path

from softrdma.tools.exectool import exec_environment

from .exec_pair import exec_argv, pair, started

SOFTRDMA = [sys.executable, "-m", "softrdma"]


def _run(argv: list[str], env: dict[str, str] | None = None, timeout: float = 120,
         cwd: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                          env=env if env is not None else os.environ.copy(), cwd=cwd)


def _devices(ip: str) -> str:
    r = _run(SOFTRDMA + ["devices"], env={**os.environ, "SOFTRDMA_IP": ip})
    assert r.returncode == 0, r.stderr
    return r.stdout


def _preload_only(ip: str) -> dict[str, str]:
    """The program's environment with nothing of softrdma but LD_PRELOAD (no
    SOFTRDMA_EXEC_PATH: the library knows where it was built from)."""
    lib = exec_environment()["LD_PRELOAD"].split()[0]
    return {"LD_PRELOAD": lib, "SOFTRDMA_IP": ip}


def test_a_c_program_starts_the_launchers_python_whatever_its_environment_says():
    """In a C program the library starts the Python it was built with, as that
    executable starts: with Debian's python3 first on PATH (cffi's default start then
    took Debian's standard library into pyenv's runtime and found no _cffi_backend) and
    with PYTHONHOME/PYTHONPATH meant for another Python (a fatal error before), Debian's
    ibv_devices still prints what ``softrdma devices`` prints."""
    ip = "127.0.5.20"
    env = {**_preload_only(ip), "PATH": "/usr/bin:/bin", "PYTHONHOME": "/nonexistent",
           "PYTHONPATH": "/nonexistent"}
    r = _run(["/usr/bin/ibv_devices"], env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout == _devices(ip) and "softrdma0" in r.stdout
    assert r.stderr == ""


_LIST = ("import ctypes, sys; lib = ctypes.CDLL(None, use_errno=True); "
         "f = lib.ibv_get_device_list; f.restype = ctypes.c_void_p; n = ctypes.c_int(-1); "
         "p = f(ctypes.byref(n)); print(bool(p), n.value, ctypes.get_errno())")


def test_a_python_program_without_cffi_gets_the_launchers_backend(tmp_path):
    """Debian's python3 without its site-packages (``-S``: no _cffi_backend, no softrdma)
    as the program: the library's code runs in *its* interpreter, with softrdma's package
    root and the launcher's _cffi_backend and nothing else of the launcher's Python;
    ibv_get_device_list answers one device (before: the embedding could not start and
    every call returned 0). softrdma is imported by location: its checkout's directory
    does not join the program's sys.path."""
    r = _run(["/usr/bin/python3", "-S", "-c", _LIST + "; print(sorted(p for p in sys.path "
              "if 'site-packages' in p or 'dist-packages' in p)); import importlib.util; "
              "print(importlib.util.find_spec('tests'), sys.modules['softrdma'].__file__)"],
             env={**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
                  **_preload_only("127.0.5.21")}, cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "True 1 0", r.stderr
    assert lines[1] == "[]"  # no other Python's packages reached the host's path
    # softrdma itself, by location: its checkout's other packages (tests/, which
    # rdma-core's suite is called too) stay out of the program's imports
    root = Path(__file__).resolve().parents[1]
    assert lines[2] == f"None {root / 'softrdma' / '__init__.py'}"


def _other_python() -> Path:
    """A CPython of another major.minor than the one running the tests: pyenv's (this
    machine's image has 3.6 to 3.13 under ~/.pyenv, whether the project's venv is made
    from pyenv's Python or, as CI does with a bare PATH, from Debian's /usr/bin/python3),
    or one on PATH."""
    here = f"{sys.version_info[0]}.{sys.version_info[1]}."
    roots = {Path(sys.base_prefix).parent,
             Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"}
    found = [p for root in sorted(roots) for p in sorted(root.glob("3.*/bin/python3"))
             if not p.parent.parent.name.startswith(here)]
    import shutil
    found += [Path(p) for p in (shutil.which(f"python3.{n}") for n in range(8, 20)
                                if n != sys.version_info[1]) if p]
    # pyenv's shims are scripts that may refuse: only real interpreters
    found = [p for p in found if p.resolve().read_bytes()[:4] == b"\x7fELF"]
    assert found, f"no Python of another version in {sorted(map(str, roots))} or on PATH"
    return found[0]


def test_a_python_of_another_version_is_refused_in_one_line():
    """The library's C is compiled for one CPython ABI: a Python of another version as
    the program hung (3.12) or answered zeros (3.10). ``softrdma exec`` refuses to start
    it (one line, status 1), and under a plain LD_PRELOAD the library says so once and
    every function fails: NULL or -1 with ENOSYS, promptly."""
    other = _other_python()
    r = _run(SOFTRDMA + ["exec", "--", str(other), "-c", "print('ran')"])
    assert r.returncode == 1 and r.stdout == ""
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert re.search(r"is Python 3\.\d+; .* built for Python 3\.\d+", r.stderr), r.stderr
    code = _LIST + "; print(lib.rsocket(2, 1, 0), ctypes.get_errno())"
    r = _run([str(other), "-c", code], env={**os.environ, **_preload_only("127.0.5.22")},
             timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["False", "-1", str(errno.ENOSYS), "-1", str(errno.ENOSYS)]
    assert r.stderr.count("softrdma exec:") == 1 and "every verb fails" in r.stderr


FORKER = r"""
/* forks while other threads are inside the verbs library */
#include <infiniband/verbs.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

static struct ibv_context *ctx;
static volatile int stop;

static void *spin(void *arg)
{
    struct ibv_device_attr attr;
    long n = 0;
    while (!stop)
        if (ibv_query_device(ctx, &attr) == 0)
            n++;
    return (void *)n;
}

static int child(void)
{
    struct ibv_device_attr attr;
    int num = 0;
    alarm(60);  /* a hung child dies of SIGALRM: the parent counts it */
    struct ibv_device **list = ibv_get_device_list(&num);
    if (!list || num != 1)
        return 2;
    struct ibv_context *c = ibv_open_device(list[0]);
    if (!c || ibv_query_device(c, &attr))
        return 3;
    return 0;
}

int main(int argc, char **argv)
{
    int forks = atoi(argv[1]), nthreads = atoi(argv[2]);
    int ok = 0, hung = 0, failed = 0, st, num;
    pthread_t t[8];
    long calls = 0;

    pid_t p = fork();  /* before the library's interpreter exists */
    if (p == 0)
        _exit(child());
    waitpid(p, &st, 0);
    printf("before: %s\n", WIFEXITED(st) && WEXITSTATUS(st) == 0 ? "ok" : "failed");

    struct ibv_device **list = ibv_get_device_list(&num);
    if (!list || num < 1 || !(ctx = ibv_open_device(list[0])))
        return 1;
    for (int i = 0; i < nthreads; i++)
        pthread_create(&t[i], NULL, spin, NULL);
    usleep(100000);
    for (int i = 0; i < forks; i++) {
        p = fork();
        if (p == 0)
            _exit(child());
        waitpid(p, &st, 0);
        if (WIFSIGNALED(st))
            hung++;
        else if (WEXITSTATUS(st) == 0)
            ok++;
        else
            failed++;
    }
    stop = 1;
    for (int i = 0; i < nthreads; i++) {
        void *n;
        pthread_join(t[i], &n);
        calls += (long)n;
    }
    printf("during: %d ok, %d hung, %d failed; %s\n", ok, hung, failed,
           calls > 0 ? "threads called in" : "threads never called in");
    return 0;
}
"""


def test_fork_while_other_threads_are_inside_the_library(tmp_path):
    """A C program forks ten times while two threads call ibv_query_device in a loop
    (each call is Python); each child opens the device afresh and queries it. Without
    the library's pthread_atfork glue every child hung on the interpreter's lock, held
    by a thread the child does not have; with it all ten succeed -- the pinned address
    stays the parent's, the child's device takes the next free one -- and the parent's
    threads go on."""
    src = tmp_path / "forker.c"
    src.write_text(FORKER)
    exe = tmp_path / "forker"
    subprocess.run(["gcc", "-O1", "-pthread", str(src), "-o", str(exe), "-libverbs"],
                   check=True, capture_output=True)
    r = _run(SOFTRDMA + ["exec", "--addr", "127.0.5.23", "--", str(exe), "10", "2"],
             cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["before: ok",
                                     "during: 10 ok, 0 hung, 0 failed; threads called in"], \
        r.stdout + r.stderr


def test_capture_faults_and_trace_reach_a_c_programs_device(tmp_path):
    """The device lives in the program, so softrdma's environment reaches it:
    ``exec --pcap`` on one ibv_rc_pingpong writes a capture ``softrdma dissect`` reads
    (every message both ways, with ACKs), ``--fault 'tx:drop(RC_SEND_LAST)'`` on the other
    drops its first message's last packet, so it sends that message again (its first
    PSN twice in the capture), and ``--trace drop`` there logs the injected loss to its trace file."""
    pcap, log = tmp_path / "server.pcap", tmp_path / "client.log"
    # the server listens once its library is up: a client before that cannot connect
    client, res = pair(exec_argv("127.0.5.24", "ibv_rc_pingpong", "-g", "1", "-n", "3",
                                 "-p", "18555", opts=("--pcap", str(pcap))),
                       SOFTRDMA + ["--trace", "drop", "--trace-file", str(log), "exec",
                                   "--addr", "127.0.5.25", "--fault", "tx:drop(RC_SEND_LAST)",
                                   "--", "ibv_rc_pingpong", "-g", "1", "-n", "3", "-p",
                                   "18555", "127.0.5.24"],
                       started, again=lambda r: "Couldn't connect" in r.stderr + r.stdout)
    server, out, err = res, res.stdout, res.stderr
    assert client is not None and client.returncode == 0, client.stderr
    assert server.returncode == 0, err
    assert "3 iters" in out and "3 iters" in client.stdout
    d = _run(SOFTRDMA + ["dissect", str(pcap)])
    assert d.returncode == 0, d.stderr
    lines = d.stdout.splitlines()
    sends = [ln for ln in lines if "127.0.5.25" in ln.split()[2] and "RC_SEND_LAST" in ln]
    assert len(sends) >= 3, d.stdout  # the dropped one never reached the server
    psns = [re.search(r"psn=(\d+)", ln).group(1) for ln in lines
            if "127.0.5.25" in ln.split()[2] and "RC_SEND_FIRST" in ln]
    assert len(set(psns)) == 3 and psns.count(psns[0]) >= 2, d.stdout
    assert any("RC_ACKNOWLEDGE" in ln for ln in lines)
    assert "injected" in log.read_text()


def test_the_programs_own_trace_options_stay_its_own():
    """After ``--`` the words belong to the program: a ``--trace`` there is not taken as
    softrdma's tracing option (which would also remove it from the program's line)."""
    r = _run(SOFTRDMA + ["exec", "--print-env", "--", "prog", "--trace", "packet"])
    assert r.returncode == 0, r.stderr
    assert "SOFTRDMA_TRACE" not in r.stdout
    r = _run(SOFTRDMA + ["--trace", "packet", "exec", "--pcap", "x.pcap", "--print-env"])
    env = dict(line.removeprefix("export ").split("=", 1) for line in r.stdout.splitlines())
    assert env["SOFTRDMA_TRACE"] == "packet"
    assert env["SOFTRDMA_PCAP"] == os.path.abspath("x.pcap")


def test_the_ld_library_path_form_replaces_both_libraries_with_one_object(tmp_path):
    """``--ld-library-path``: a directory whose libibverbs.so.1 and librdmacm.so.1 are
    softrdma, built with the installed libraries' symbol versions (IBVERBS_1.x,
    IBVERBS_PRIVATE_34, RDMACM_1.x), so Debian's ibv_devices and ibv_devinfo (which need
    IBVERBS_1.0, 1.1 and the private version) load and answer as under the preload; a
    process that asks for both names maps one object and never the real libraries, and
    one that dlopens libibverbs.so.1 and looks its functions up gets softrdma's."""
    r = _run(SOFTRDMA + ["exec", "--ld-library-path", "--print-env"])
    assert r.returncode == 0, r.stderr
    env = {k: v.strip("'") for k, v in
           (line.removeprefix("export ").split("=", 1) for line in r.stdout.splitlines())}
    assert "LD_PRELOAD" not in env
    libdir = env["LD_LIBRARY_PATH"].split(":")[0]
    ip = "127.0.5.26"
    run_env = {**os.environ, **env, "SOFTRDMA_IP": ip}
    r = _run(["ibv_devices"], env=run_env)
    assert r.returncode == 0 and r.stderr == "", r.stderr  # no "no version information"
    assert r.stdout == _devices(ip)
    r = _run(["ibv_devinfo"], env=run_env)
    assert r.returncode == 0 and "hca_id:\tsoftrdma0" in r.stdout, r.stderr
    # by soname through dlopen, as programs that load libibverbs at run time do (their
    # dlsym on that handle never sees a preload: the preload form cannot serve them)
    code = ("import ctypes; ctypes.CDLL('librdmacm.so.1'); l = ctypes.CDLL('libibverbs.so.1'); "
            "f = l.ibv_get_device_list; f.restype = ctypes.c_void_p; n = ctypes.c_int(-1); "
            "assert f(ctypes.byref(n)) and n.value == 1, n; "
            "import pyverbs.device as d; print([x.name.decode() for x in d.get_device_list()]);"
            "print(sorted({l.split()[-1] for l in open('/proc/self/maps') "
            "if 'libibverbs' in l or 'librdmacm' in l}))")
    r = _run(["/usr/bin/python3", "-c", code], env=run_env, cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr
    names, maps = r.stdout.splitlines()
    assert names == "['softrdma0']"
    assert maps == str([os.path.join(libdir, "libibverbs.so.1")])


RACE = r"""
/* several threads make the program's first call into the library at once */
#include <infiniband/verbs.h>
#include <pthread.h>
#include <stdio.h>

static pthread_barrier_t go;

static void *first_call(void *arg)
{
    int num = -1;
    pthread_barrier_wait(&go);
    struct ibv_device **list = ibv_get_device_list(&num);
    return (void *)(long)(list != NULL && num == 1);
}

int main(void)
{
    enum { N = 8 };
    pthread_t t[N];
    long ok = 0;
    pthread_barrier_init(&go, NULL, N);
    for (int i = 0; i < N; i++)
        pthread_create(&t[i], NULL, first_call, NULL);
    for (int i = 0; i < N; i++) {
        void *r;
        pthread_join(t[i], &r);
        ok += (long)r;
    }
    printf("%ld of %d threads found the device\n", ok, N);
    return 0;
}
"""


def test_threads_making_the_first_call_at_once_start_one_interpreter(tmp_path):
    """Eight threads of a C program call ibv_get_device_list at the same moment, before
    anything has started Python: the library starts the interpreter once (the others
    wait for it) and every thread gets the device."""
    src = tmp_path / "race.c"
    src.write_text(RACE)
    exe = tmp_path / "race"
    subprocess.run(["gcc", "-pthread", str(src), "-o", str(exe), "-libverbs"],
                   check=True, capture_output=True)
    for _ in range(3):
        r = _run(SOFTRDMA + ["exec", "--addr", "127.0.5.27", "--", str(exe)])
        assert r.returncode == 0, r.stderr
        assert r.stdout == "8 of 8 threads found the device\n", r.stdout + r.stderr


def test_the_ld_library_path_form_runs_perftest_which_links_providers_directly():
    """perftest links libmlx5 and libefa itself (their direct verbs), and they bind, at
    load, libibverbs' provider-private symbols (IBVERBS_PRIVATE_34: ibv_cmd_*,
    verbs_register_driver_34): the library directory defines them, inert, so Debian's
    ib_send_bw loads -- before, it died with "symbol lookup error" -- and two of them
    complete a run under ``--ld-library-path``."""
    argv = ["ib_send_bw", "-n", "5", "-s", "4096", "-p", "18562"]
    opts = ("--ld-library-path",)
    client, res = pair(exec_argv("127.0.5.28", *argv, opts=opts),
                       exec_argv("127.0.5.29", *argv, "127.0.5.28", opts=opts), started,
                       again=lambda r: r.returncode != 0
                       and "symbol lookup error" not in r.stderr)
    server, out, err = res, res.stdout, res.stderr
    assert client.returncode == 0, client.stdout + client.stderr
    assert server.returncode == 0, out + err
    for text in (out, client.stdout):
        assert re.search(r"^\s*4096\s+5\s", text, re.M), text
