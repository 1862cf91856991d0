"""Small inline SVG charts for the job report: a histogram, a line chart and a horizontal bar chart.
Plain strings, no plotting library and nothing fetched when the page is opened."""

from __future__ import annotations

import math
from collections.abc import Sequence
from html import escape

import numpy as np

WIDTH, HEIGHT = 560, 260
LEFT, RIGHT, TOP, BOTTOM = 64, 16, 34, 44
COLORS = ("#2563eb", "#dc2626", "#16a34a", "#9333ea")


def nice_ticks(low: float, high: float, count: int = 5) -> list[float]:
    """Round tick values covering [low, high]."""
    if not math.isfinite(low) or not math.isfinite(high) or high <= low:
        high = low + 1.0
    raw = (high - low) / max(count, 1)
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw)
    first = math.floor(low / step)
    last = max(math.ceil(high / step), first + 1)  # the last tick is at or above `high`
    return [round(index * step, 10) for index in range(first, last + 1)]


def _label(value: float) -> str:
    if abs(value) >= 10_000:
        return f"{value / 1000:.0f}k"
    if value == int(value):
        return f"{int(value)}"
    return f"{value:.2g}" if abs(value) < 1 else f"{value:.1f}"


class _Frame:
    """Maps data coordinates to the plot area and draws the axes."""

    def __init__(self, x_range: tuple[float, float], y_range: tuple[float, float]) -> None:
        self.x_ticks = nice_ticks(*x_range)
        self.y_ticks = nice_ticks(*y_range)
        self.x0, self.x1 = self.x_ticks[0], self.x_ticks[-1]
        self.y0, self.y1 = self.y_ticks[0], self.y_ticks[-1]

    def x(self, value: float) -> float:
        span = (self.x1 - self.x0) or 1.0
        return LEFT + (value - self.x0) / span * (WIDTH - LEFT - RIGHT)

    def y(self, value: float) -> float:
        span = (self.y1 - self.y0) or 1.0
        return HEIGHT - BOTTOM - (value - self.y0) / span * (HEIGHT - TOP - BOTTOM)

    def axes(self, x_label: str, y_label: str) -> list[str]:
        parts = []
        for tick in self.y_ticks:
            y = self.y(tick)
            parts.append(f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{y:.1f}" y2="{y:.1f}" class="grid"/>')
            parts.append(f'<text x="{LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">{_label(tick)}</text>')
        for tick in self.x_ticks:
            x = self.x(tick)
            parts.append(
                f'<text x="{x:.1f}" y="{HEIGHT - BOTTOM + 16}" text-anchor="middle">{_label(tick)}</text>'
            )
        parts.append(
            f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{HEIGHT - BOTTOM}" y2="{HEIGHT - BOTTOM}" class="axis"/>'
        )
        parts.append(f'<line x1="{LEFT}" x2="{LEFT}" y1="{TOP}" y2="{HEIGHT - BOTTOM}" class="axis"/>')
        parts.append(
            f'<text x="{(LEFT + WIDTH - RIGHT) / 2}" y="{HEIGHT - 8}" text-anchor="middle">{escape(x_label)}</text>'
        )
        parts.append(
            f'<text x="14" y="{(TOP + HEIGHT - BOTTOM) / 2}" text-anchor="middle" '
            f'transform="rotate(-90 14 {(TOP + HEIGHT - BOTTOM) / 2})">{escape(y_label)}</text>'
        )
        return parts


def _svg(title: str, body: list[str], kind: str) -> str:
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" class="chart {kind}" viewBox="0 0 {WIDTH} {HEIGHT}" '
        f'width="{WIDTH}" height="{HEIGHT}" role="img" aria-label="{escape(title)}">'
        f'<text x="{WIDTH / 2}" y="20" text-anchor="middle" class="title">{escape(title)}</text>'
        + "".join(body)
        + "</svg>"
    )


def _empty(title: str, kind: str) -> str:
    return _svg(
        title, [f'<text x="{WIDTH / 2}" y="{HEIGHT / 2}" text-anchor="middle">no data yet</text>'], kind
    )


def histogram_svg(values: Sequence[float] | np.ndarray, title: str, x_label: str, bins: int = 30) -> str:
    data = np.asarray(values, dtype=np.float64)
    if data.size == 0:
        return _empty(title, "histogram")
    low, high = float(data.min()), float(data.max())
    if high == low:
        high = low + 1
    counts, edges = np.histogram(data, bins=min(bins, max(1, int(high - low) + 1)), range=(low, high))
    frame = _Frame((low, high), (0, float(counts.max())))
    body = frame.axes(x_label, "rows")
    for count, left, right in zip(counts, edges[:-1], edges[1:], strict=True):
        if count == 0:
            continue
        x, width = frame.x(left), max(frame.x(right) - frame.x(left) - 1, 1)
        y = frame.y(count)
        body.append(
            f'<rect class="bar" x="{x:.1f}" y="{y:.1f}" width="{width:.1f}" '
            f'height="{frame.y(0) - y:.1f}"><title>{left:.0f}-{right:.0f}: {count}</title></rect>'
        )
    body.append(
        f'<text x="{WIDTH - RIGHT}" y="{TOP + 4}" text-anchor="end">n={data.size}, '
        f"mean {data.mean():.1f}, max {high:.0f}</text>"
    )
    return _svg(title, body, "histogram")


def line_chart_svg(
    series: Sequence[Sequence[tuple[float, float]]],
    title: str,
    x_label: str,
    y_label: str,
    y_max: float | None = None,
) -> str:
    """Each series is one polyline (say one shard); all share the axes and the color."""
    points = [point for line in series for point in line]
    if not points:
        return _empty(title, "line")
    xs = [x for x, _ in points]
    ys = [y for _, y in points]
    frame = _Frame((min(xs), max(xs)), (0.0, y_max if y_max is not None else max(max(ys), 1e-9)))
    body = frame.axes(x_label, y_label)
    for line in series:
        if not line:
            continue
        path = " ".join(f"{frame.x(x):.1f},{frame.y(y):.1f}" for x, y in line)
        body.append(f'<polyline class="series" fill="none" stroke="{COLORS[0]}" points="{path}"/>')
        if len(line) == 1:
            x, y = line[0]
            body.append(f'<circle cx="{frame.x(x):.1f}" cy="{frame.y(y):.1f}" r="2.5" fill="{COLORS[0]}"/>')
    return _svg(title, body, "line")


def bar_chart_svg(bars: Sequence[tuple[str, float]], title: str, unit: str) -> str:
    """Horizontal bars with their values written at the end."""
    if not bars:
        return _empty(title, "bars")
    label_width = 200
    top = TOP + 8
    row = (HEIGHT - top - 16) / len(bars)
    scale = max(value for _, value in bars) or 1.0
    body = []
    for index, (label, value) in enumerate(bars):
        y = top + index * row
        width = value / scale * (WIDTH - label_width - 110)
        body.append(
            f'<text x="{label_width - 8}" y="{y + row / 2 + 4:.1f}" text-anchor="end">{escape(label)}</text>'
        )
        body.append(
            f'<rect class="bar" fill="{COLORS[index % len(COLORS)]}" x="{label_width}" y="{y + 4:.1f}" '
            f'width="{max(width, 1):.1f}" height="{row - 8:.1f}"/>'
        )
        body.append(
            f'<text x="{label_width + width + 6:.1f}" y="{y + row / 2 + 4:.1f}">{value:,.0f} {escape(unit)}</text>'
        )
    return _svg(title, body, "bars")
