"""The fuzzer's seed frames: every RoCE packet of the captures under ``pcaps/`` (a source
checkout's, or the reference captures installed with softrdma: :mod:`softrdma.data`)."""

from __future__ import annotations

import glob
import os

from ... import data
from ...wire.frames import FrameError, decode_frame
from ...wire.packet import DecodeError, parse
from ...wire.pcap import PcapError, read_pcap

__all__ = ["default_pcap_dir", "load_seeds", "capture_paths"]


def default_pcap_dir() -> str:
    """The checkout's ``pcaps/`` when softrdma runs from a source checkout, else the
    captures installed with it (:func:`softrdma.data.default_pcap_dir`)."""
    return str(data.default_pcap_dir())


def capture_paths(root: str) -> list[str]:
    """Every capture file (``*.pcap``, ``*.pcapng``) under ``root``, sorted."""
    return sorted(p for pat in ("*.pcap", "*.pcapng")
                  for p in glob.glob(os.path.join(root, "**", pat), recursive=True))


def load_seeds(root: str) -> tuple[list[bytes], int]:
    """Every RoCE packet (BTH .. ICRC) that decodes, from every capture under ``root``;
    and how many capture files were read."""
    paths = capture_paths(root)
    seeds: list[bytes] = []
    for path in paths:
        try:
            for rec in read_pcap(path):
                try:
                    fr = decode_frame(rec.data, rec.linktype)
                except FrameError:
                    continue
                if fr is None or not fr.is_roce:
                    continue
                try:
                    parse(fr.payload)
                except DecodeError:
                    continue
                seeds.append(bytes(fr.payload))
        except (OSError, PcapError):
            continue
    return seeds, len(paths)
