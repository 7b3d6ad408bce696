"""The process around the preload library: which interpreter runs softrdma, and fork.

The library's functions are Python, so the program needs an interpreter. Two cases:

* **A C program** (``ibv_devices``, perftest, rping): nothing in the process has started
  Python. The library starts the interpreter it was built with (its ``libpython``) *as
  that Python's own executable*: with ``executable`` set to the launcher's
  ``sys.executable``, Python finds its standard library and, for a virtual environment,
  its ``site-packages`` (cffi's ``_cffi_backend``, an installed softrdma) exactly as that
  executable would. Left to itself (cffi calls ``Py_InitializeEx``), an embedded Python
  guesses its home from the ``python3`` on ``PATH``: with Debian's first it mixed Debian's
  3.11.2 standard library into pyenv's 3.11.7 runtime and found no ``_cffi_backend``.
  The configuration is isolated (``PYTHON*`` variables meant for other Pythons are
  ignored, the program's locale and signals are left alone).
* **A Python program** (Debian's ``python3`` running the compiled pyverbs): the program's
  interpreter is already running and the library's code runs in it; the ``softrdma``
  package is imported by location (:data:`softrdma.exec.build.INIT`: nothing joins the
  host's ``sys.path``; the launcher's whole path once put another Python's standard
  library there and crashed the host), and ``_cffi_backend`` is loaded from the
  launcher's copy if the host has none.
  The library's C was compiled for one ``major.minor`` of CPython's ABI: in a host of
  another version it hangs (3.12) or answers zeros (3.10), so the library refuses --
  one line on stderr, every function fails (NULL, -1 or ENOSYS) -- and ``softrdma exec``
  refuses to start such a program at all (:func:`python_version_of`).

**fork.** A C program that forks while another of its threads is inside Python (a
progress thread polling a CQ) leaves the child an interpreter whose lock is held by a
thread that does not exist there: the child's first call hangs. ``pthread_atfork``
handlers take the interpreter's lock across the fork and let CPython tidy the child
(``PyOS_BeforeFork`` / ``PyOS_AfterFork_Parent`` / ``PyOS_AfterFork_Child``), which also
runs softrdma's ``os.register_at_fork`` hooks: the child gets fresh soft devices
(:mod:`softrdma.verbs_api.device`) and no rdma_cm state. They are registered only when the
library started the interpreter: a Python host's ``os.fork`` does all of this itself.

All of this is C glue around CPython's embedding API (:data:`C_SOURCE`), no verbs logic;
it runs once, at the program's first call into the library.
"""

from __future__ import annotations

import json
import mmap
import os
import re
import subprocess
import sys
import sysconfig

from . import abi

__all__ = ["c_source", "host_code", "refusals", "python_version_of", "python_mismatch"]


def _c_string(s: str) -> str:
    """``s`` as a C string literal (JSON's escapes are C's for what we put in)."""
    return json.dumps(s)


def host_code(backend: str) -> str:
    """Python run in a Python host before cffi imports ``_cffi_backend``: the host's own
    copy if it has one (a program that uses cffi itself keeps its matching backend), else
    the launcher's (``backend``), loaded by file so nothing else of the launcher's
    ``site-packages`` reaches the host."""
    return (
        "import sys\n"
        "try:\n"
        "    import _cffi_backend\n"
        "except ImportError:\n"
        "    import importlib.util as _u\n"
        f"    _s = _u.spec_from_file_location('_cffi_backend', {backend!r})\n"
        "    _m = _u.module_from_spec(_s)\n"
        "    sys.modules['_cffi_backend'] = _m\n"
        "    _s.loader.exec_module(_m)\n")


def refusals() -> str:
    """`` name:e name:m ...`` -- how each integer-returning function fails when the library
    refuses to run: ``e`` returns the errno (libibverbs' verbs), ``m`` returns -1 (the
    rest); functions returning pointers give NULL, ``void`` ones nothing."""
    decl = abi.declarations(abi.PROTOTYPES)
    out = []
    for name in abi.ABI_NAMES:
        fail = abi.fail_value(decl[name]) if name in decl else -1
        if fail is None or fail is ...:
            continue
        c_name = "softrdma_rfcntl" if name == "rfcntl" else name  # its Python half
        out.append(f"{c_name}:{'e' if fail != -1 else 'm'}")
    return " " + " ".join(out) + " "


def _libpython() -> str:
    """The soname of the libpython the library links (``libpython3.11.so.1.0``), or ""
    for a Python without one."""
    name = sysconfig.get_config_var("INSTSONAME") or ""
    return name if ".so" in name else ""


def c_source(executable: str, backend: str) -> str:
    """The glue (appended to the library's C source, after cffi's embedding code, whose
    ``_cffi_call_python`` and ``_cffi_start_and_call_python`` it wraps)."""
    return r"""
/* softrdma.exec.process: glue, not logic -- which interpreter runs the library's Python,
   and fork. Runs once, at the program's first call (pthread_once), then hands over to
   cffi's own start-up, which replaces _cffi_call_python by the fast path. */
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <errno.h>

static const char softrdma_exec_python[] = """ + _c_string(executable) + r""";
static const char softrdma_exec_libpython[] = """ + _c_string(_libpython()) + r""";
static const char softrdma_exec_host_code[] = """ + _c_string(host_code(backend)) + r""";
static const char softrdma_exec_refusals[] = """ + _c_string(refusals()) + r""";
static pthread_once_t softrdma_exec_once = PTHREAD_ONCE_INIT;
static int softrdma_exec_refused;
static PyGILState_STATE softrdma_exec_fork_gil;
static int softrdma_exec_fork_by_python;

/* fork: hold the interpreter's lock across it; CPython re-initialises the child's
   runtime and runs os.register_at_fork's hooks (softrdma's fresh devices). A fork made
   by Python code (os.fork: its thread holds the lock) does all this itself. */
static void softrdma_exec_before_fork(void)
{
    softrdma_exec_fork_by_python = PyGILState_Check();
    if (softrdma_exec_fork_by_python)
        return;
    softrdma_exec_fork_gil = PyGILState_Ensure();
    PyOS_BeforeFork();
}

static void softrdma_exec_after_fork_parent(void)
{
    if (softrdma_exec_fork_by_python)
        return;
    PyOS_AfterFork_Parent();
    PyGILState_Release(softrdma_exec_fork_gil);
}

static void softrdma_exec_after_fork_child(void)
{
    if (softrdma_exec_fork_by_python)
        return;
    PyOS_AfterFork_Child();
    PyGILState_Release(softrdma_exec_fork_gil);
}

static void softrdma_exec_prepare(void)
{
    char want[16];
    snprintf(want, sizeof want, "%d.%d.", PY_MAJOR_VERSION, PY_MINOR_VERSION);
    if (Py_IsInitialized()) {
        /* the program is a Python: the library's code runs in its interpreter */
        const char *have = Py_GetVersion();
        if (strncmp(have, want, strlen(want)) != 0) {
            fprintf(stderr, "softrdma exec: this program is Python %.*s; softrdma's "
                    "library runs in the program's interpreter and was built for Python "
                    "%d.%d (%s): every verb fails (ENOSYS)\n",
                    (int)strcspn(have, " "), have, PY_MAJOR_VERSION, PY_MINOR_VERSION,
                    softrdma_exec_python);
            softrdma_exec_refused = 1;
            return;
        }
        PyGILState_STATE g = PyGILState_Ensure();
        PyRun_SimpleString(softrdma_exec_host_code);
        PyGILState_Release(g);
        return;
    }
    /* a C program: start the launcher's Python as its own executable would start. A
       library the program dlopen'ed (the LD_LIBRARY_PATH form under UCX's modules) has
       libpython in its local scope only, where the extension modules Python loads
       (_cffi_backend) cannot find its symbols: make it global, as a python binary's is */
    if (softrdma_exec_libpython[0])
        dlopen(softrdma_exec_libpython, RTLD_LAZY | RTLD_NOLOAD | RTLD_GLOBAL);
    PyConfig config;
    PyStatus status;
    PyConfig_InitIsolatedConfig(&config);
    config.install_signal_handlers = 0;
    config.parse_argv = 0;
    status = PyConfig_SetBytesString(&config, &config.executable, softrdma_exec_python);
    if (!PyStatus_Exception(status))
        status = Py_InitializeFromConfig(&config);
    PyConfig_Clear(&config);
    if (PyStatus_Exception(status)) {
        fprintf(stderr, "softrdma exec: starting Python (%s) failed: %s\n",
                softrdma_exec_python, status.err_msg ? status.err_msg : "?");
        softrdma_exec_refused = 1;
        return;
    }
    PyEval_SaveThread();  /* as cffi does after Py_InitializeEx: the lock is free */
    pthread_atfork(softrdma_exec_before_fork, softrdma_exec_after_fork_parent,
                   softrdma_exec_after_fork_child);
}

/* the refused library's answer: NULL, nothing, -1 or the errno, as the function fails */
static void softrdma_exec_refuse(struct _cffi_externpy_s *externpy, char *args)
{
    char key[80];
    const char *name = strchr(externpy->name, '.'), *hit;
    name = name ? name + 1 : externpy->name;
    memset(args, 0, externpy->size_of_result);
    snprintf(key, sizeof key, " %s:", name);
    hit = strstr(softrdma_exec_refusals, key);
    if (hit != NULL) {
        long v = hit[strlen(key)] == 'e' ? ENOSYS : -1;
        if (externpy->size_of_result == sizeof(int)) { int i = (int)v; memcpy(args, &i, sizeof i); }
        else if (externpy->size_of_result == sizeof(long)) memcpy(args, &v, sizeof v);
    }
    errno = ENOSYS;
}

static void softrdma_exec_start(struct _cffi_externpy_s *externpy, char *args)
{
    pthread_once(&softrdma_exec_once, softrdma_exec_prepare);
    if (softrdma_exec_refused) {
        softrdma_exec_refuse(externpy, args);
        return;
    }
    _cffi_start_and_call_python(externpy, args);
}

__attribute__((constructor)) static void softrdma_exec_loaded(void)
{
    _cffi_call_python = softrdma_exec_start;
}
"""


_PY_NAME = re.compile(rb"python(\d)\.(\d+)")


def python_version_of(program: str) -> tuple[int, int] | None:
    """The ``(major, minor)`` of CPython ``program`` runs as, or None if it is not a Python
    (an ELF that defines or imports ``Py_BytesMain``, or a script whose ``#!`` line names
    one). The version is the interpreter's own answer, asked without softrdma, for a
    ``python*`` executable; for another program embedding Python, the ``pythonX.Y`` its
    file names (its libpython, its library directory)."""
    path = _which(program)
    if path is None:
        return None
    try:
        with open(path, "rb") as f:
            head = f.read(256)
    except OSError:
        return None
    if head.startswith(b"#!"):
        words = head[2:].split(b"\n")[0].split()
        if not words:
            return None
        interp = words[0].decode(errors="replace")
        if os.path.basename(interp) == "env" and len(words) > 1:
            interp = words[1].decode(errors="replace")
        return python_version_of(interp)
    if not head.startswith(b"\x7fELF"):
        return None
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            if m.find(b"Py_BytesMain") < 0:  # a C program (the usual case): done
                return None
            found = _PY_NAME.search(m)
            named = (int(found.group(1)), int(found.group(2))) if found else None
    except (OSError, ValueError):
        return None
    if not os.path.basename(os.path.realpath(path)).startswith("python"):
        return named  # embeds Python (uwsgi, ...): never run it, its libpython's name says
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "LD_LIBRARY_PATH")}
    try:
        out = subprocess.run([path, "-I", "-S", "-c",
                              "import sys; print(*sys.version_info[:2])"],
                             capture_output=True, text=True, timeout=30, env=env).stdout
        major, minor = out.split()
        return int(major), int(minor)
    except (OSError, ValueError, subprocess.SubprocessError):
        return named  # cannot ask it: its libpython's name says


def python_mismatch(program: str) -> str | None:
    """Why ``program`` cannot run under ``softrdma exec`` (a Python of another version
    than the one the library is built for), or None."""
    v = python_version_of(program)
    if v is None or v == sys.version_info[:2]:
        return None
    return (f"{program} is Python {v[0]}.{v[1]}; softrdma's library runs in the program's "
            f"interpreter and is built for Python {sys.version_info[0]}."
            f"{sys.version_info[1]} ({sys.executable}): run the program with a Python "
            f"{sys.version_info[0]}.{sys.version_info[1]}, or softrdma exec from a Python "
            f"{v[0]}.{v[1]} environment")


def _which(program: str) -> str | None:
    if os.sep in program:
        return program if os.access(program, os.X_OK) else None
    import shutil
    return shutil.which(program)
