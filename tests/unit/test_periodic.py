"""volumes/periodic.py: the loop of the pool monitors and the QoS reconcile."""

from __future__ import annotations

import threading

import pytest

from csi_local.volumes.periodic import Periodic


def test_a_round_that_raises_is_logged_and_the_next_comes(
        caplog: pytest.LogCaptureFixture) -> None:
    rounds: list[int] = []
    third = threading.Event()

    def round_() -> None:
        rounds.append(len(rounds))
        if len(rounds) == 3:
            third.set()
        if len(rounds) == 1:
            raise RuntimeError("the first round fails")

    loop = Periodic("test-loop", round_, 0.01)
    loop.start()
    loop.start()  # a second start starts no second thread
    assert third.wait(5)
    loop.stop()
    seen = len(rounds)
    assert threading.Event().wait(0.05) is False and len(rounds) == seen  # stopped
    assert "test-loop: a round failed" in caplog.text
    assert [t.name for t in threading.enumerate()].count("test-loop") == 0
