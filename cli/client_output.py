"""How the client shows things to a person: aligned tables, units, ages, and colour only on a
terminal (and never with ``NO_COLOR`` set, https://no-color.org)."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any, TextIO

KiB = 1024
STATE_COLOURS = {
    "queued": "2", "profiling": "36", "planning": "36", "running": "34", "succeeded": "32",
    "failed": "31", "cancelled": "33",
    "ok": "32", "oom": "31", "timeout": "31", "pruned": "33", "interrupted": "33",
}


def use_colour(stream: TextIO | None = None) -> bool:
    stream = stream or sys.stdout
    return stream.isatty() and not os.environ.get("NO_COLOR") and os.environ.get("TERM") != "dumb"


def paint(text: str, code: str | None, stream: TextIO | None = None) -> str:
    return f"\033[{code}m{text}\033[0m" if code and use_colour(stream) else text


def state(text: str, stream: TextIO | None = None) -> str:
    return paint(text, STATE_COLOURS.get(text), stream)


def bold(text: str, stream: TextIO | None = None) -> str:
    return paint(text, "1", stream)


def dim(text: str, stream: TextIO | None = None) -> str:
    return paint(text, "2", stream)


def visible_len(text: str) -> int:
    """Length without colour escapes."""
    out, skip = 0, False
    for ch in text:
        if ch == "\033":
            skip = True
        elif skip and ch == "m":
            skip = False
        elif not skip:
            out += 1
    return out


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], right: Sequence[int] = ()) -> str:
    """Columns padded to their widest cell (``right``: right-aligned column indexes)."""
    widths = [len(h) for h in headers]
    for row in rows:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], visible_len(cell))

    def line(cells: Sequence[str]) -> str:
        parts = []
        for i, cell in enumerate(cells):
            pad = " " * (widths[i] - visible_len(cell))
            parts.append(pad + cell if i in right else cell + pad)
        return "  ".join(parts).rstrip()

    return "\n".join([bold(line(headers))] + [line(r) for r in rows])


def print_json(data: Any) -> None:
    json.dump(data, sys.stdout, indent=2, sort_keys=False, default=str)
    sys.stdout.write("\n")


def size(n: float | None) -> str:
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < KiB or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= KiB
    return f"{value:.1f} TiB"


def seconds(s: float | None) -> str:
    if s is None:
        return "-"
    if s < 1:
        return f"{s * 1000:.1f} ms"
    if s < 120:
        return f"{s:.2f} s"
    if s < 7200:
        return f"{s / 60:.1f} min"
    return f"{s / 3600:.1f} h"


def rate(tokens_per_s: float | None) -> str:
    if tokens_per_s is None:
        return "-"
    if tokens_per_s >= 1e6:
        return f"{tokens_per_s / 1e6:.2f}M"
    if tokens_per_s >= 1e4:
        return f"{tokens_per_s / 1e3:.1f}k"
    return f"{tokens_per_s:.0f}"


def percent(fraction: float | None) -> str:
    return "-" if fraction is None else f"{fraction:+.0%}"


def parse_time(value: str | None) -> datetime | None:
    if not value:
        return None
    try:
        at = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    return at if at.tzinfo else at.replace(tzinfo=UTC)


def age(value: str | None, now: datetime | None = None) -> str:
    """'3m ago' from an ISO time (the API's), '-' when absent."""
    at = parse_time(value)
    if at is None:
        return "-"
    delta = ((now or datetime.now(UTC)) - at).total_seconds()
    if delta < 60:
        return f"{max(delta, 0):.0f}s ago"
    if delta < 3600:
        return f"{delta / 60:.0f}m ago"
    if delta < 86400 * 2:
        return f"{delta / 3600:.0f}h ago"
    return f"{delta / 86400:.0f}d ago"


def short_id(job_id: str) -> str:
    return job_id[:8]


def bar(done: int, total: int, width: int = 24) -> str:
    total = max(total, 1)
    filled = min(width, round(width * done / total))
    return "[" + "#" * filled + "." * (width - filled) + "]"
