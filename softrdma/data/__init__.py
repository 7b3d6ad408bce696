"""Files installed with softrdma: reference captures of Linux rxe.

``pcaps/linux-rxe/`` inside this package holds the thirteen captures of two kernel rxe
hosts running rdma-core's pingpongs, perftest and the rdma_cm examples (a copy, byte for
byte, of the repository's ``pcaps/linux-rxe/*.pcap``; its README lists the command behind
each). They travel in the wheel, so ``softrdma fuzz``, ``softrdma bench``, the pytest
plugin's ``softrdma_replay`` and the guides' examples work from any installed softrdma,
with no source checkout::

    >>> from softrdma.data import reference_capture
    >>> reference_capture("linux-rxe/rc_pingpong.pcap").name
    'rc_pingpong.pcap'

A source checkout has more (``pcaps/``: runs under loss, with the out-of-band exchange, the
lab's); :func:`default_pcap_dir` prefers it when softrdma runs from one.
"""

from __future__ import annotations

import os
from importlib.resources import files
from pathlib import Path

__all__ = ["reference_pcap_dir", "reference_capture", "reference_captures", "checkout_pcap_dir",
           "default_pcap_dir", "find_capture"]


def reference_pcap_dir() -> Path:
    """The directory of the captures installed with softrdma (``.../softrdma/data/pcaps``)."""
    # a wheel installs into a real directory; a zipped install is not supported by the tools
    return Path(str(files(__name__).joinpath("pcaps")))


def reference_capture(name: str) -> Path:
    """The installed capture ``name`` (``"linux-rxe/rc_pingpong.pcap"``); FileNotFoundError
    naming the captures there are if it is not one of them."""
    path = reference_pcap_dir() / name
    if not path.is_file():
        raise FileNotFoundError(f"{name!r} is not a capture shipped with softrdma (they are: "
                                f"{', '.join(reference_captures())})")
    return path


def reference_captures() -> list[str]:
    """The names of the installed captures, ``"linux-rxe/NAME.pcap"``, sorted."""
    root = reference_pcap_dir()
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*.pcap"))


def checkout_pcap_dir() -> Path | None:
    """The source checkout's ``pcaps/`` when softrdma is imported from a checkout (or an
    editable install of one); None for an installed wheel."""
    root = Path(__file__).resolve().parents[2]
    pcaps = root / "pcaps"
    return pcaps if (root / "pyproject.toml").is_file() and pcaps.is_dir() else None


def default_pcap_dir() -> Path:
    """Where tools look for captures when told nothing: the checkout's ``pcaps/`` (every
    capture of the project) if there is one, else the installed reference captures."""
    return checkout_pcap_dir() or reference_pcap_dir()


def find_capture(pcap: str | os.PathLike[str]) -> Path:
    """``pcap`` as a path if that file exists; otherwise the installed capture of that name
    (``"linux-rxe/rc_pingpong.pcap"``, or ``"pcaps/linux-rxe/rc_pingpong.pcap"`` as the
    checkout spells it), so code written against a checkout runs against an installed
    softrdma. FileNotFoundError if neither exists."""
    path = Path(pcap)
    if path.is_file() or path.is_absolute():
        return path
    name = path.as_posix()
    name = name[len("pcaps/"):] if name.startswith("pcaps/") else name
    if (reference_pcap_dir() / name).is_file():
        return reference_pcap_dir() / name
    raise FileNotFoundError(f"{os.fspath(pcap)}: no such file, nor a capture shipped with "
                            f"softrdma ({', '.join(reference_captures())})")
