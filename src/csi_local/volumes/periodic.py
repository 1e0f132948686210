"""A round of work every few seconds in a thread of its own, and its stop: the
one loop that the pool monitors and the QoS reconcile share.

A round that raises is logged and the next round comes as planned: a watch
that died silently would leave a pool unextended or a workload unlimited with
nothing said.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)


class Periodic:
    """`round()` every `interval` seconds, the first at start, until stop()."""

    def __init__(self, name: str, round: Callable[[], object], interval: float) -> None:
        self.name = name
        self.round = round
        self.interval = interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, daemon=True, name=self.name)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.round()
            except Exception:  # never let the loop die silently
                log.exception("%s: a round failed", self.name)
            self._stop.wait(self.interval)
