"""Byte-range sets for the changed-block-tracking checks.

A set of bytes is a sorted list of disjoint, non-adjacent half-open ranges ``(start, end)``.
The suite compares what a plugin reports with what it wrote as sets of covered bytes, never
range by range: a plugin may split or merge its ranges however it likes (chunks, extents,
messages), and only the bytes they cover are specified.
"""

from __future__ import annotations

from collections.abc import Iterable

Extent = tuple[int, int]


def normalize(extents: Iterable[Extent]) -> list[Extent]:
    """Sort, drop empty ranges and merge overlapping or touching ones."""
    out: list[Extent] = []
    for start, end in sorted(e for e in extents if e[1] > e[0]):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def union(*sets: Iterable[Extent]) -> list[Extent]:
    return normalize(e for s in sets for e in s)


def subtract(a: Iterable[Extent], b: Iterable[Extent]) -> list[Extent]:
    """Bytes of ``a`` that are not in ``b``."""
    cut = normalize(b)
    out: list[Extent] = []
    for start, end in normalize(a):
        pos = start
        for cs, ce in cut:
            if ce <= pos:
                continue
            if cs >= end:
                break
            if cs > pos:
                out.append((pos, cs))
            pos = max(pos, ce)
            if pos >= end:
                break
        if pos < end:
            out.append((pos, end))
    return out


def intersect(a: Iterable[Extent], b: Iterable[Extent]) -> list[Extent]:
    na = normalize(a)
    return subtract(na, subtract(na, b))


def clip(a: Iterable[Extent], lo: int, hi: int) -> list[Extent]:
    return intersect(a, [(lo, hi)])


def dilate(a: Iterable[Extent], by: int, lo: int, hi: int) -> list[Extent]:
    """Every byte within ``by`` bytes of ``a``, kept inside [lo, hi)."""
    return clip(((s - by, e + by) for s, e in a), lo, hi)


def total(a: Iterable[Extent]) -> int:
    return sum(e - s for s, e in normalize(a))


def describe(a: Iterable[Extent], limit: int = 6) -> str:
    items = normalize(a)
    text = ", ".join(f"[{s}, {e}) ({e - s} B)" for s, e in items[:limit])
    if len(items) > limit:
        text += f" and {len(items) - limit} more"
    return text or "nothing"
