"""Looking at a page as a person would: Debian's chromium, headless, on a file.

``probe(html)`` opens a copy of the page with :data:`PROBE` appended: a script that walks
the SVG *as laid out* (``getBBox``, ``getComputedStyle``) and writes what it found as JSON
into ``<pre id="rendered">``; chromium's ``--dump-dom`` hands the DOM back after the
script ran. ``screenshot(file)`` takes a PNG and :func:`read_png` decodes it (a small
zlib decoder: the repository has no imaging library, and a PNG from chromium needs only
8-bit RGB(A), non-interlaced, the five filters), so tests can check pixels too.
"""

from __future__ import annotations

import json
import re
import struct
import subprocess
import tempfile
import zlib
from pathlib import Path

from .conftest import require_tool

#: a script run in the page: what the browser drew, as JSON
PROBE = r"""
<script>
(function () {
  const out = {svgs: [], arrows: [], notes: [], lanes: [], table_rows: 0};
  for (const s of document.querySelectorAll('svg')) {
    const b = s.getBBox();
    out.svgs.push({isSVG: s instanceof SVGSVGElement, w: b.width, h: b.height});
  }
  for (const g of document.querySelectorAll('g.arrow')) {
    const shaft = g.querySelector('.shaft');
    const label = g.querySelector('text.label');
    const mark = g.querySelector('.loss-mark');
    const sb = shaft.getBBox(), lb = label.getBBox();
    const a = {
      kind: g.dataset.kind, psn: Number(g.dataset.psn), opcode: g.dataset.opcode,
      x1: shaft.x1.baseVal.value, y1: shaft.y1.baseVal.value,
      x2: shaft.x2.baseVal.value, y2: shaft.y2.baseVal.value,
      stroke: getComputedStyle(shaft).stroke, dash: getComputedStyle(shaft).strokeDasharray,
      shaft_len: sb.width + sb.height,
      label: label.textContent, label_box: [lb.x, lb.y, lb.width, lb.height],
      tooltip: (g.querySelector('title') || {}).textContent || '',
    };
    if (mark) {
      const mb = mark.getBBox();
      a.mark = {cx: mb.x + mb.width / 2, cy: mb.y + mb.height / 2, w: mb.width, h: mb.height,
                stroke: getComputedStyle(mark).stroke};
    }
    out.arrows.push(a);
  }
  for (const g of document.querySelectorAll('g.note')) {
    const b = g.querySelector('rect').getBBox();
    out.notes.push({text: g.textContent.trim(), box: [b.x, b.y, b.width, b.height]});
  }
  for (const t of document.querySelectorAll('text.lane-head')) {
    const b = t.getBBox();
    out.lanes.push({text: t.textContent, w: b.width, x: b.x + b.width / 2});
  }
  out.table_rows = document.querySelectorAll('table.packets tr').length - 1;
  const pre = document.createElement('pre');
  pre.id = 'rendered';
  pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
})();
</script>
"""


def _chromium(*args: str) -> subprocess.CompletedProcess:
    exe = require_tool("chromium")
    with tempfile.TemporaryDirectory(prefix="chromium-profile-") as prof:
        return subprocess.run(
            [exe, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
             "--force-device-scale-factor=1", f"--user-data-dir={prof}", *args],
            capture_output=True, text=True, timeout=120)


def probe(html: str, workdir: Path) -> dict:
    """Open ``html`` (a page's text) in chromium and return what :data:`PROBE` saw."""
    page = workdir / "probe.html"
    page.write_text(html.replace("</body>", PROBE + "</body>"), encoding="utf-8")
    r = _chromium("--virtual-time-budget=2000", "--dump-dom", page.as_uri())
    m = re.search(r'<pre id="rendered">(.*?)</pre>', r.stdout, re.S)
    assert m, f"the probe did not run in chromium: {r.stderr[-2000:]}"
    text = m.group(1).replace("&lt;", "<").replace("&gt;", ">").replace("&quot;", '"') \
        .replace("&amp;", "&")
    return json.loads(text)


def screenshot(path: Path, width: int, height: int) -> tuple[int, int, list[bytes]]:
    """A PNG of the file ``path`` at ``width`` x ``height``, decoded: (w, h, RGB rows)."""
    png = path.with_suffix(path.suffix + ".png")
    r = _chromium(f"--window-size={width},{height}", "--hide-scrollbars",
                  f"--screenshot={png}", path.as_uri())
    assert png.exists(), f"chromium took no screenshot: {r.stderr[-2000:]}"
    return read_png(png.read_bytes())


def read_png(data: bytes) -> tuple[int, int, list[bytes]]:
    """Decode an 8-bit RGB or RGBA, non-interlaced PNG into rows of RGB bytes."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, hdr = 8, b"", None
    while pos < len(data):
        (n,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + n]
        pos += 12 + n
        if kind == b"IHDR":
            hdr = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat += body
    assert hdr is not None
    w, h, depth, ctype, _, _, interlace = hdr
    assert depth == 8 and ctype in (2, 6) and not interlace, f"unsupported PNG {hdr}"
    bpp = 3 if ctype == 2 else 4
    raw = zlib.decompress(idat)
    stride = w * bpp
    rows: list[bytes] = []
    prev = bytearray(stride)
    for y in range(h):
        f = raw[y * (stride + 1)]
        line = bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b = prev[i]
            c = prev[i - bpp] if i >= bpp else 0
            if f == 1:
                line[i] = (line[i] + a) & 0xFF
            elif f == 2:
                line[i] = (line[i] + b) & 0xFF
            elif f == 3:
                line[i] = (line[i] + (a + b) // 2) & 0xFF
            elif f == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 0xFF
        prev = line
        rows.append(bytes(line[j] for k in range(0, stride, bpp) for j in range(k, k + 3)))
    return w, h, rows


def pixels_near(img: tuple[int, int, list[bytes]], cx: float, cy: float, r: int,
                colour: tuple[int, int, int], tol: int = 40) -> int:
    """How many pixels within ``r`` of (cx, cy) are close to ``colour``."""
    w, h, rows = img
    n = 0
    for y in range(max(0, int(cy) - r), min(h, int(cy) + r + 1)):
        row = rows[y]
        for x in range(max(0, int(cx) - r), min(w, int(cx) + r + 1)):
            px = row[3 * x:3 * x + 3]
            if all(abs(px[i] - colour[i]) <= tol for i in range(3)):
                n += 1
    return n
