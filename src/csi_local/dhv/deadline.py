"""The deadline of one plugin operation: Nomad allows create and delete 60
seconds, and every command and lock wait fits in what is left of them, with
a few seconds kept back to report the result."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence

from csi_local.dhv.request import DhvError
from csi_local.host.runner import Output, Result, Runner

RESERVE = 3.0  # seconds kept back to report a result before Nomad's deadline


class Deadline:
    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self, reserve: float = RESERVE) -> float:
        left = self.end - time.monotonic() - reserve
        if left <= 0:
            raise DhvError("ran out of time (Nomad allows create and delete 60 seconds)")
        return left


class DeadlineRunner:
    """A Runner whose commands never outlive the operation's deadline."""

    def __init__(self, inner: Runner, deadline: Deadline) -> None:
        self.inner = inner
        self.deadline = deadline

    def run(
        self,
        argv: Sequence[str],
        *,
        ok_codes: Sequence[int] = (0,),
        input: str | bytes | None = None,
        timeout: float | None = None,
    ) -> Result:
        left = self.deadline.left()
        limit = left if timeout is None else min(timeout, left)
        return self.inner.run(argv, ok_codes=ok_codes, input=input, timeout=limit)

    def stream(self, argv: Sequence[str], *, timeout: float | None = None
               ) -> contextlib.AbstractContextManager[Output]:
        left = self.deadline.left()
        return self.inner.stream(argv, timeout=left if timeout is None else min(timeout, left))
