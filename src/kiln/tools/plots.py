"""Inline SVG plots for the report: plain strings, no external resources, no scripts.

Each function returns one <svg> element sized in CSS pixels, with a <title>
for screen readers, that any browser draws offline.
"""

from __future__ import annotations

import math
from html import escape

_FONT = "font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;font-size:11px"
_BAR = "#3b6ea8"
_GRID = "#d9dde3"
_TEXT = "#2b2f36"
_MARK = "#c0392b"


def _nice_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    if not math.isfinite(lo) or not math.isfinite(hi) or hi <= lo:
        return [lo]
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = min((m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw), default=raw)
    start = math.ceil(lo / step) * step
    ticks = []
    v = start
    while v <= hi + 1e-12 * abs(hi) and len(ticks) < 50:
        ticks.append(round(v, 12))
        v += step
    return ticks


def _fmt(v: float) -> str:
    if v == 0:
        return "0"
    if abs(v) >= 1000 or abs(v) < 0.01:
        return f"{v:.2g}"
    return f"{v:.3g}"


def _svg(width: int, height: int, title: str, body: list[str]) -> str:
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}" role="img" style="{_FONT}">'
            f"<title>{escape(title)}</title>" + "".join(body) + "</svg>")


def histogram(values: list[float], title: str, xlabel: str, bins: int = 30, marker: float | None = None,
              marker_label: str = "", width: int = 640, height: int = 260) -> str:
    """A histogram of `values` with an optional vertical marker (e.g. the latency target)."""
    vals = [v for v in values if v is not None and math.isfinite(v)]
    left, right, top, bottom = 52, 16, 28, 42
    pw, ph = width - left - right, height - top - bottom
    body = [f'<text x="{left}" y="16" fill="{_TEXT}" style="font-weight:600">{escape(title)}</text>']
    if not vals:
        body.append(f'<text x="{left}" y="{top + ph / 2}" fill="{_TEXT}">no data</text>')
        return _svg(width, height, title, body)
    lo, hi = min(vals), max(vals)
    if marker is not None and math.isfinite(marker):
        lo, hi = min(lo, marker), max(hi, marker)
    if hi == lo:
        lo, hi = lo - 0.5 * (abs(lo) or 1), hi + 0.5 * (abs(hi) or 1)
    pad = (hi - lo) * 0.03
    lo, hi = lo - pad, hi + pad
    counts = [0] * bins
    for v in vals:
        k = min(int((v - lo) / (hi - lo) * bins), bins - 1)
        counts[k] += 1
    top_count = max(counts) or 1
    x = lambda v: left + (v - lo) / (hi - lo) * pw  # noqa: E731
    y = lambda c: top + ph - c / top_count * ph  # noqa: E731
    for t in _nice_ticks(0, top_count, 4):
        body.append(f'<line x1="{left}" x2="{left + pw}" y1="{y(t):.1f}" y2="{y(t):.1f}" stroke="{_GRID}"/>')
        body.append(f'<text x="{left - 6}" y="{y(t) + 4:.1f}" text-anchor="end" fill="{_TEXT}">{_fmt(t)}</text>')
    bw = pw / bins
    for k, c in enumerate(counts):
        if c:
            body.append(f'<rect x="{left + k * bw + 0.5:.1f}" y="{y(c):.1f}" width="{max(bw - 1, 0.5):.1f}" '
                        f'height="{top + ph - y(c):.1f}" fill="{_BAR}"><title>{c} run(s) in '
                        f'[{_fmt(lo + k * (hi - lo) / bins)}, {_fmt(lo + (k + 1) * (hi - lo) / bins)})</title></rect>')
    for t in _nice_ticks(lo, hi, 6):
        body.append(f'<line x1="{x(t):.1f}" x2="{x(t):.1f}" y1="{top + ph}" y2="{top + ph + 4}" stroke="{_TEXT}"/>')
        body.append(f'<text x="{x(t):.1f}" y="{top + ph + 16}" text-anchor="middle" fill="{_TEXT}">{_fmt(t)}</text>')
    body.append(f'<line x1="{left}" x2="{left + pw}" y1="{top + ph}" y2="{top + ph}" stroke="{_TEXT}"/>')
    body.append(f'<text x="{left + pw / 2}" y="{height - 6}" text-anchor="middle" fill="{_TEXT}">'
                f'{escape(xlabel)}</text>')
    body.append(f'<text x="12" y="{top + ph / 2}" transform="rotate(-90 12 {top + ph / 2})" text-anchor="middle" '
                f'fill="{_TEXT}">runs</text>')
    if marker is not None and math.isfinite(marker):
        mx = x(marker)
        body.append(f'<line x1="{mx:.1f}" x2="{mx:.1f}" y1="{top}" y2="{top + ph}" stroke="{_MARK}" stroke-width="2" '
                    f'stroke-dasharray="5,3"/>')
        anchor = "end" if mx > left + pw * 0.7 else "start"
        dx = -4 if anchor == "end" else 4
        body.append(f'<text x="{mx + dx:.1f}" y="{top + 10}" text-anchor="{anchor}" fill="{_MARK}">'
                    f'{escape(marker_label)}</text>')
    return _svg(width, height, title, body)


def hbars(items: list[tuple[str, float]], title: str, unit: str = "", width: int = 640, top_n: int = 15,
          label_width: int = 230) -> str:
    """Horizontal bars, largest first; items beyond top_n are summed into 'other'."""
    items = sorted(((str(k), float(v)) for k, v in items), key=lambda kv: -kv[1])
    if len(items) > top_n:
        rest = sum(v for _, v in items[top_n - 1:])
        items = items[:top_n - 1] + [(f"other ({len(items) - top_n + 1} layers)", rest)]
    row = 20
    top, bottom = 28, 12
    height = top + bottom + row * max(len(items), 1)
    pw = width - label_width - 110  # room for the value and share after the longest bar
    body = [f'<text x="8" y="16" fill="{_TEXT}" style="font-weight:600">{escape(title)}</text>']
    if not items:
        body.append(f'<text x="8" y="{top + 14}" fill="{_TEXT}">no data</text>')
        return _svg(width, height, title, body)
    vmax = max(v for _, v in items) or 1.0
    total = sum(v for _, v in items) or 1.0
    for i, (label, v) in enumerate(items):
        y = top + i * row
        short = label if len(label) <= 32 else label[:30] + "…"  # ~7 px a character: fits label_width
        w = max(v / vmax * pw, 1)
        body.append(f'<text x="{label_width - 6}" y="{y + 14}" text-anchor="end" fill="{_TEXT}">'
                    f'<title>{escape(label)}</title>{escape(short)}</text>')
        body.append(f'<rect x="{label_width}" y="{y + 3}" width="{w:.1f}" height="{row - 6}" '
                    f'fill="{_BAR}"><title>{escape(label)}: {_fmt(v)}{escape(unit)}'
                    f'</title></rect>')
        body.append(f'<text x="{label_width + w + 4:.1f}" y="{y + 14}" fill="{_TEXT}">{_fmt(v)}{escape(unit)} '
                    f'({100 * v / total:.1f}%)</text>')
    return _svg(width, height, title, body)


def columns(bins: list[tuple[str, int]], title: str, xlabel: str, width: int = 640, height: int = 240) -> str:
    """Vertical bars over categorical bins (e.g. decades of absolute error)."""
    left, right, top, bottom = 52, 16, 28, 56
    pw, ph = width - left - right, height - top - bottom
    body = [f'<text x="{left}" y="16" fill="{_TEXT}" style="font-weight:600">{escape(title)}</text>']
    if not bins:
        body.append(f'<text x="{left}" y="{top + ph / 2}" fill="{_TEXT}">no data</text>')
        return _svg(width, height, title, body)
    cmax = max(c for _, c in bins) or 1
    bw = pw / len(bins)
    for t in _nice_ticks(0, cmax, 4):
        yy = top + ph - t / cmax * ph
        body.append(f'<line x1="{left}" x2="{left + pw}" y1="{yy:.1f}" y2="{yy:.1f}" stroke="{_GRID}"/>')
        body.append(f'<text x="{left - 6}" y="{yy + 4:.1f}" text-anchor="end" fill="{_TEXT}">{_fmt(t)}</text>')
    for i, (label, c) in enumerate(bins):
        h = c / cmax * ph
        x0 = left + i * bw
        body.append(f'<rect x="{x0 + 2:.1f}" y="{top + ph - h:.1f}" width="{max(bw - 4, 1):.1f}" height="{h:.1f}" '
                    f'fill="{_BAR}"><title>{escape(label)}: {c}</title></rect>')
        body.append(f'<text x="{x0 + bw / 2:.1f}" y="{top + ph + 14}" text-anchor="middle" fill="{_TEXT}" '
                    f'style="font-size:9px">{escape(label)}</text>')
    body.append(f'<line x1="{left}" x2="{left + pw}" y1="{top + ph}" y2="{top + ph}" stroke="{_TEXT}"/>')
    body.append(f'<text x="{left + pw / 2}" y="{height - 8}" text-anchor="middle" fill="{_TEXT}">'
                f'{escape(xlabel)}</text>')
    return _svg(width, height, title, body)
