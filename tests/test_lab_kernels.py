"""Choosing the lab's guest kernel, without booting anything: which images count as
bootable, how series are named and ordered, what a missing or unknown kernel says.

The fake trees below stand in for ``/``: ``boot/vmlinuz-<release>`` beside
``lib/modules/<release>``, as Debian's linux-image packages install them.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from softrdma.harness import lab as L

ROOT = Path(__file__).resolve().parents[1]


def _tree(root: Path, releases: list[str], without_modules: tuple[str, ...] = ()) -> Path:
    (root / "boot").mkdir(parents=True)
    for rel in releases:
        (root / "boot" / f"vmlinuz-{rel}").write_bytes(b"")
        if rel not in without_modules:
            (root / "lib" / "modules" / rel).mkdir(parents=True)
    return root


def test_kernels_keys_by_series_newest_image_each(tmp_path):
    """One entry per major.minor, the newest image of it by release number (6.1.0-56 after
    6.1.0-9: a string sort would pick -9), series ordered as numbers (6.9 before 6.12)."""
    root = _tree(tmp_path, ["6.1.0-9-amd64", "6.1.0-56-amd64", "6.12.117+deb12-amd64",
                            "6.12.57+deb12-amd64", "6.9.3-amd64"])
    ks = L.kernels(root)
    assert list(ks) == ["6.1", "6.9", "6.12"]
    assert ks["6.1"] == str(root / "boot" / "vmlinuz-6.1.0-56-amd64")
    assert ks["6.12"] == str(root / "boot" / "vmlinuz-6.12.117+deb12-amd64")


def test_kernels_needs_the_modules(tmp_path):
    """An image without lib/modules/<release> cannot load rdma_rxe in the guest: not listed."""
    root = _tree(tmp_path, ["6.1.0-56-amd64", "6.12.117+deb12-amd64"],
                 without_modules=("6.12.117+deb12-amd64",))
    assert list(L.kernels(root)) == ["6.1"]


def test_default_kernel_is_debian12s(monkeypatch):
    """The interop scenarios were written against Debian 12's 6.1: it stays the default, and
    $SOFTRDMA_LAB_KERNEL overrides it."""
    assert L.DEFAULT_KERNEL == "6.1"
    monkeypatch.delenv("SOFTRDMA_LAB_KERNEL", raising=False)
    assert L.kernel_choice(None) == "6.1"
    monkeypatch.setenv("SOFTRDMA_LAB_KERNEL", "6.12")
    assert L.kernel_choice(None) == "6.12"
    assert L.kernel_choice("6.1") == "6.1"  # an explicit choice wins over the environment


def test_missing_612_names_its_package(tmp_path, monkeypatch):
    """Without a 6.12 image, what is missing names the Debian package that installs it
    (and what can boot instead); missing_prerequisites carries that line."""
    root = _tree(tmp_path, ["6.1.0-56-amd64"])
    msg = L.kernel_missing("6.12", root)
    assert msg is not None and "linux-image-6.12-amd64" in msg and "6.1" in msg
    assert L.kernel_missing("6.1", root) is None
    monkeypatch.setattr(L, "kernels", lambda root="/": {"6.1": "/boot/vmlinuz-6.1.0-56-amd64"})
    assert any("linux-image-6.12-amd64" in m for m in L.missing_prerequisites("6.12"))


def test_unknown_kernel_names_the_bootable_ones(tmp_path):
    """A series this machine has no image of, or a path that does not exist: the message
    lists the bootable series."""
    root = _tree(tmp_path, ["6.1.0-56-amd64", "6.12.117+deb12-amd64"])
    for bad in ("nope", "6.13", str(tmp_path / "vmlinuz-none")):
        msg = L.kernel_missing(bad, root)
        assert msg is not None and "6.1, 6.12" in msg, msg
    image = root / "boot" / "vmlinuz-6.12.117+deb12-amd64"
    assert L.kernel_missing(str(image), root) is None  # a path that exists is taken as is


def _softrdma(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "softrdma", *args], capture_output=True,
                          text=True, cwd=ROOT, timeout=60)


def test_lab_kernel_nope_errors_in_one_line():
    """``softrdma lab --kernel nope ...`` stops before booting with one line naming the
    bootable kernels (either position of the option)."""
    have = ", ".join(L.kernels())
    for argv in (("lab", "--kernel", "nope", "run", "--", "true"),
                 ("lab", "shell", "--kernel", "nope")):
        p = _softrdma(*argv)
        assert p.returncode == 1, (p.stdout, p.stderr)
        lines = p.stderr.strip().splitlines()
        assert len(lines) == 1 and "'nope'" in lines[0], p.stderr
        if have:
            assert f"bootable here: {have}" in lines[0], p.stderr


def test_lab_kernels_lists_the_series():
    """``softrdma lab kernels``: one line per bootable series with its image, the one
    ``--kernel`` selects marked."""
    p = _softrdma("lab", "--kernel", "6.12", "kernels")
    assert p.returncode == 0, p.stderr
    rows = [ln.split() for ln in p.stdout.splitlines()]
    assert [r[:2] for r in rows] == [[k, v] for k, v in L.kernels().items()]
    assert [r[0] for r in rows if "(selected)" in r] == (["6.12"] if "6.12" in L.kernels()
                                                          else [])


@pytest.mark.parametrize("series", ["6.1", "6.12"])
def test_setup_installs_both_images(series):
    """scripts/setup installs the package of each series the interop suite boots."""
    assert L.KERNEL_PACKAGES[series] in (ROOT / "scripts" / "setup").read_text()
