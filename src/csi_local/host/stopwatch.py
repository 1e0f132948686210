"""Where one call's time went: the phases that the layers it passes through
note, in the thread that runs it.

A create in a storm waits for locks, for the lvm shell, for LVM itself; its
total says none of that. The call that wants the breakdown opens
`recording()`; the layers below note their phases with `phase()` or `note()`
without being told who listens (nothing is kept when no one records, so a
phase costs one thread-local lookup). The caller logs the breakdown.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

_local = threading.local()


class Breakdown:
    """The phases noted in one recording, in the order they ended."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.parts: list[tuple[str, float, bool]] = []  # (what, seconds, nested)
        self.depth = 0  # phases open now: what is noted inside one is part of it

    def note(self, what: str, seconds: float) -> None:
        self.parts.append((what, seconds, self.depth > 0))

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def text(self) -> str:
        """"12.31s: pool lock 10.20s, lvcreate in shell 1.90s, rest 0.21s"."""
        total = self.elapsed
        # Only the outermost phases add up to the total: a nested one (an
        # `lvs` inside the report's phase) is shown in brackets.
        rest = total - sum(s for _, s, nested in self.parts if not nested)
        parts = [f"({w} {s:.2f}s)" if nested else f"{w} {s:.2f}s"
                 for w, s, nested in self.parts]
        return f"{total:.2f}s: {', '.join([*parts, f'rest {max(rest, 0.0):.2f}s'])}"


@contextlib.contextmanager
def recording() -> Iterator[Breakdown]:
    """Record the phases noted in this thread until the block's end."""
    outer = getattr(_local, "current", None)
    breakdown = Breakdown()
    _local.current = breakdown
    try:
        yield breakdown
    finally:
        _local.current = outer


def note(what: str, seconds: float) -> None:
    """Note a phase of the call being recorded in this thread, if any."""
    breakdown: Breakdown | None = getattr(_local, "current", None)
    if breakdown is not None:
        breakdown.note(what, seconds)


@contextlib.contextmanager
def phase(what: str) -> Iterator[None]:
    """Note the block's time as phase `what`; what is noted inside it is its part."""
    breakdown: Breakdown | None = getattr(_local, "current", None)
    if breakdown is None:
        yield
        return
    started = time.monotonic()
    breakdown.depth += 1
    try:
        yield
    finally:
        breakdown.depth -= 1
        breakdown.note(what, time.monotonic() - started)
