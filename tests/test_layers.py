"""The architecture, checked: the protocol core imports nothing above it or any I/O, and
no module reaches into another module's private names.

``softrdma.wire`` (bytes), ``softrdma.cm`` (the CM's wire format) and ``softrdma.qp`` (the
protocol) are sans-IO: no sockets, threads, clocks or event loops, and nothing from the
soft device, the verbs API, the harnesses or the tools. ``softrdma.cm`` sits on
``softrdma.wire`` alone, and the wire layer never imports it (the dissector takes the CM's
decoder as a plug-in). Read from the source with ``ast``, so a function-local import
counts as much as a module-level one.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from .conftest import ROOT

PKG = ROOT / "softrdma"
CORE = (sorted((PKG / "wire").glob("*.py")) + sorted((PKG / "cm").glob("*.py"))
        + sorted((PKG / "qp").glob("*.py")) + sorted((PKG / "check").glob("*.py")))
FORBIDDEN_IO = {"socket", "threading", "time", "asyncio", "selectors", "select", "subprocess"}
FORBIDDEN_PKGS = ("softrdma.soft", "softrdma.verbs_api", "softrdma.tools", "softrdma.harness",
                  "softrdma.sim", "softrdma.replay", "softrdma.testing", "softrdma.lab",
                  "softrdma.bench", "softrdma.cli", "softrdma.pyverbs")


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(path: Path) -> list[tuple[int, str, list[str]]]:
    """``(line, absolute module, names)`` for every import in the file."""
    tree = ast.parse(path.read_text(), str(path))
    pkg = module_name(path).rsplit(".", 1)[0] if path.name != "__init__.py" \
        else module_name(path)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")
                base = base[:len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.append((node.lineno, mod, [a.name for a in node.names]))
    return out


@pytest.mark.parametrize("path", CORE, ids=lambda p: str(p.relative_to(PKG)))
def test_the_core_is_sans_io_and_imports_nothing_above_it(path):
    bad = []
    for line, mod, _names in imports(path):
        top = mod.split(".")[0]
        if top in FORBIDDEN_IO or any(mod == p or mod.startswith(p + ".") for p in FORBIDDEN_PKGS):
            bad.append(f"{path.relative_to(ROOT)}:{line} imports {mod}")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("path", sorted((PKG / "cm").glob("*.py")) + sorted(
    (PKG / "wire").glob("*.py")), ids=lambda p: str(p.relative_to(PKG)))
def test_cm_sits_on_wire_alone_and_wire_never_imports_cm(path):
    """cm may import the wire layer and the standard library, nothing else of softrdma
    (not even softrdma.qp); wire may not import cm, so the two never form a cycle."""
    layer = path.parent.name
    allowed = ("softrdma.wire", "softrdma.cm") if layer == "cm" else ("softrdma.wire",)
    bad = [f"{path.relative_to(ROOT)}:{line} imports {mod}" for line, mod, _ in imports(path)
           if mod.startswith("softrdma") and mod != "softrdma"
           and not any(mod == a or mod.startswith(a + ".") for a in allowed)]
    assert not bad, "\n".join(bad)


#: what softrdma.check may use: the wire layer, and two pure helpers of the protocol core
#: (PSN arithmetic, rxe's constants: the RNR timer table and the UDP source-port hash)
CHECK_ALLOWED = ("softrdma.wire", "softrdma.check", "softrdma.qp.psn", "softrdma.qp.params")


@pytest.mark.parametrize("path", sorted((PKG / "check").glob("*.py")),
                         ids=lambda p: str(p.relative_to(PKG)))
def test_check_sits_on_wire(path):
    """The capture checker judges bytes: it sits on the wire layer (plus PSN arithmetic and
    rxe's constants), above it and below the tools; it never drives an engine or a device,
    so it can judge any implementation's capture."""
    bad = [f"{path.relative_to(ROOT)}:{line} imports {mod}" for line, mod, _ in imports(path)
           if mod.startswith("softrdma") and mod != "softrdma"
           and not any(mod == a or mod.startswith(a + ".") for a in CHECK_ALLOWED)]
    assert not bad, "\n".join(bad)


def test_nothing_below_the_tools_imports_check():
    below = [p for layer in ("wire", "cm", "qp", "soft", "verbs_api", "rdmacm", "socket")
             for p in sorted((PKG / layer).rglob("*.py"))]
    bad = [f"{p.relative_to(ROOT)}:{line} imports {mod}" for p in below
           for line, mod, _ in imports(p) if mod == "softrdma.check"
           or mod.startswith("softrdma.check.")]
    assert not bad, "\n".join(bad)


def test_only_the_tools_import_diagram():
    """softrdma.diagram draws what the layers below do (captures, the simulated network's
    observers): nothing below the tools may depend on it, so a picture never changes what
    happens."""
    below = [p for layer in ("wire", "cm", "qp", "soft", "verbs_api", "rdmacm", "socket",
                             "check", "harness", "ibverbs")
             for p in sorted((PKG / layer).rglob("*.py"))]
    bad = [f"{p.relative_to(ROOT)}:{line} imports {mod}" for p in below
           for line, mod, _ in imports(p) if mod == "softrdma.diagram"
           or mod.startswith("softrdma.diagram.")]
    assert not bad, "\n".join(bad)


def all_modules() -> list[Path]:
    return sorted(p for p in PKG.rglob("*.py") if "__pycache__" not in p.parts)


@pytest.mark.parametrize("path", all_modules(), ids=lambda p: str(p.relative_to(PKG)))
def test_no_module_imports_another_modules_private_names(path):
    """``from softrdma.x import _name`` or ``softrdma.x._name``: a private name is the
    module's own business; share it under a public name or move it. Private *modules*
    (``_check``) whose names are public are fine: the underscore says "not for users"."""
    bad = [f"{path.relative_to(ROOT)}:{line} takes {n} from {mod}"
           for line, mod, names in imports(path) if mod.startswith("softrdma")
           for n in names if n.startswith("_") and not n.startswith("__")
           and not _is_submodule(mod, n)]
    tree = ast.parse(path.read_text(), str(path))
    aliases = {a.asname or a.name for node in ast.walk(tree) if isinstance(node, ast.Import)
               for a in node.names if a.name.startswith("softrdma")}
    aliases |= {a.asname or a.name for node in ast.walk(tree)
                if isinstance(node, ast.ImportFrom) and (node.level or
                                                         (node.module or "").startswith("softrdma"))
                for a in node.names}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and \
                not node.attr.startswith("__") and isinstance(node.value, ast.Name) and \
                node.value.id in aliases and node.value.id[:1].islower() and \
                _is_module_alias(tree, node.value.id, path):
            bad.append(f"{path.relative_to(ROOT)}:{node.lineno} reads "
                       f"{node.value.id}.{node.attr}")
    assert not bad, "\n".join(bad)


def _is_submodule(package: str, name: str) -> bool:
    """``from package import _name`` where ``_name`` is a module of that package: a private
    module used by its own package is the package's business."""
    base = ROOT.joinpath(*package.split("."))
    return (base / f"{name}.py").exists() or (base / name / "__init__.py").exists()


def _is_module_alias(tree: ast.AST, name: str, path: Path) -> bool:
    """``name`` was bound by importing a module (``import x`` / ``from . import x`` /
    ``from softrdma.tools import x``), relative imports resolved from ``path``'s package."""
    pkg = module_name(path).split(".")
    if path.name != "__init__.py":
        pkg = pkg[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any((a.asname or a.name) == name for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom):
            for a in node.names:
                if (a.asname or a.name) == name:
                    base = (pkg[:len(pkg) - (node.level - 1)] if node.level else []) \
                        + (node.module.split(".") if node.module else [])
                    where = ROOT.joinpath(*base, a.name)
                    return where.with_suffix(".py").exists() or (where / "__init__.py").exists()
    return False


# The handles by which a public object holds another layer's internals, and the packages
# that own them: a verbs QP's protocol engine (the core's QpEngine: requester, completer,
# responder), a CMID's rdma_cm id (``.id``: route, CM REQ, device) and a CMEventChannel's
# channel (``.channel``). Anything else must use the public accessors those objects offer
# (``QP.duplicate_requests``, ``CMID.peer_addr``, ``CMID.migrate``, ``CMEventChannel.wait``
# ...), so that a layer can change its insides, or run on another backend, without its
# callers noticing.
HANDLES = {
    "engine": ("softrdma.qp", "softrdma.verbs_api", "softrdma.soft"),
    # rdma_cm on either backend: the soft one, and the hardware one over librdmacm
    "id": ("softrdma.rdmacm", "softrdma.ibverbs.cma", "softrdma.ibverbs.cma_event",
           "softrdma.ibverbs.cma_id"),
}
# The rdma_cm event channel's insides, reached as ``<CMEventChannel>.channel.<op>``.
# ``wait`` and ``pending`` are public on a CMEventChannel too, so ``self.channel.wait()``
# (an object's own channel) is fine while ``ch.channel.wait()`` and
# ``self.ctl_ch.channel.pending()`` reach through one.
CORE_CHANNEL_OPS = {"channel", "adopt", "put", "watch"}
CHANNEL_OPS_ON_OTHERS = {"wait", "pending"}


def _owner(module: str, owners: tuple[str, ...]) -> bool:
    return any(module == o or module.startswith(o + ".") for o in owners)


def _is_self(node: ast.AST) -> bool:
    return isinstance(node, ast.Name) and node.id == "self"


def reach_throughs(path: Path, module: str | None = None) -> list[str]:
    """``x.engine.y``, ``x.id.y``, ``getattr(x, "engine")`` outside the owning packages, and
    ``x.channel.<op>`` / ``x.channel.channel`` (a CMEventChannel's insides) outside rdma_cm,
    in line order. ``module`` names the file's module when it is not under the tree."""
    tree = ast.parse(path.read_text(), str(path))
    module = module or module_name(path)
    where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
    bad: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute):
            handle = node.value.attr
            if handle in HANDLES and not _owner(module, HANDLES[handle]):
                bad.append((node.lineno, f".{handle}.{node.attr}"))
            elif handle == "channel" and (
                    node.attr in CORE_CHANNEL_OPS
                    or node.attr in CHANNEL_OPS_ON_OTHERS and not _is_self(node.value.value)) \
                    and not _owner(module, ("softrdma.rdmacm",)):
                bad.append((node.lineno, f".channel.{node.attr}"))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                node.func.id == "getattr" and len(node.args) >= 2 and \
                isinstance(node.args[1], ast.Constant) and node.args[1].value in HANDLES and \
                not _owner(module, HANDLES[node.args[1].value]):
            bad.append((node.lineno, f"getattr(..., {node.args[1].value!r})"))
    return [f"{where}:{line} reaches through {what}" for line, what in sorted(bad)]


@pytest.mark.parametrize("path", all_modules(), ids=lambda p: str(p.relative_to(PKG)))
def test_no_module_reaches_through_another_layers_handles(path):
    bad = reach_throughs(path)
    assert not bad, "\n".join(bad)


def test_the_reach_through_check_sees_what_it_should(tmp_path):
    """The check above, on code written to break each rule (so it cannot pass vacuously),
    as a tool would hold it and as the owning layers may."""
    probe = tmp_path / "probe.py"
    probe.write_text("def f(qp, cmid, ch):\n"
                     "    qp.engine.comp.on_timeout()\n"
                     "    cmid.id.device\n"
                     "    ch.channel.adopt(cmid)\n"
                     "    getattr(qp, 'engine')\n"
                     "    sock._channel.channel.wait(0.25)\n"
                     "    ch.wait(0.25); ch.pending(); self.channel.pending()\n"
                     "    self.ctl_ch.channel.pending()\n")
    found = reach_throughs(probe, "softrdma.tools.probe")
    assert [line.split(" reaches through ")[1] for line in found] == [
        ".engine.comp", ".id.device", ".channel.adopt", "getattr(..., 'engine')",
        ".channel.wait", ".channel.pending"]
    assert [line.split(" reaches through ")[1]
            for line in reach_throughs(probe, "softrdma.verbs_api.probe")] == [
        ".id.device", ".channel.adopt", ".channel.wait", ".channel.pending"]
    assert reach_throughs(probe, "softrdma.rdmacm.probe") == [
        "probe.py:2 reaches through .engine.comp",
        "probe.py:5 reaches through getattr(..., 'engine')"]
