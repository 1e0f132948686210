"""Named locks: threads of one process queue without polling; other
processes are kept out by flock; nothing is left behind per key."""

from __future__ import annotations

import fcntl
import os
import threading
import time
from pathlib import Path

import pytest

from csi_local.errors import LockBusy
from csi_local.host.locks import Locks


def _wait_for(cond: object, what: str) -> None:
    for _ in range(500):
        if callable(cond) and cond():
            return
        time.sleep(0.01)
    raise AssertionError(f"never: {what}")


def test_a_waiting_thread_is_woken_not_polling(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = fcntl.flock

    def counting(fd: int, op: int) -> None:
        calls.append(op)
        real(fd, op)

    monkeypatch.setattr(fcntl, "flock", counting)  # the module locks_mod imports
    locks = Locks(str(tmp_path))
    order: list[str] = []
    release = threading.Event()

    def first() -> None:
        with locks.hold("pool"):
            order.append("first")
            release.wait(10)

    def second() -> None:
        with locks.hold("pool", timeout=10):
            order.append("second")

    a = threading.Thread(target=first)
    a.start()
    _wait_for(lambda: order == ["first"], "the first holds the lock")
    b = threading.Thread(target=second)
    b.start()
    _wait_for(lambda: locks._queues["pool"].users == 2, "the second waits")
    time.sleep(0.3)  # long enough for a polling waiter to have tried several times
    release.set()
    a.join(10)
    b.join(10)
    assert order == ["first", "second"]
    assert len(calls) == 2  # one flock per holder: the waiter never tried while it waited
    assert locks._queues == {}


def test_a_thread_waits_no_longer_than_its_timeout(tmp_path: Path) -> None:
    locks = Locks(str(tmp_path))
    with locks.hold("v"):
        got: list[BaseException] = []

        def other() -> None:
            try:
                with locks.hold("v", timeout=0.1):
                    pass
            except LockBusy as err:
                got.append(err)

        t = threading.Thread(target=other)
        t.start()
        t.join(10)
        assert len(got) == 1 and "already in progress" in str(got[0])
        with locks.hold("another key", timeout=0):  # other keys are not held up
            pass
    assert locks._queues == {}


def test_another_process_keeps_the_lock_and_is_waited_for(tmp_path: Path) -> None:
    locks = Locks(str(tmp_path))
    # Another open file description of the same lock file: what another
    # process (the host volume plugin) holds.
    fd = os.open(locks._path("pool"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        with pytest.raises(LockBusy), locks.hold("pool", timeout=0.1):
            pass
        assert locks._queues == {}  # a failed wait leaves nothing behind
        timer = threading.Timer(0.2, fcntl.flock, (fd, fcntl.LOCK_UN))
        timer.start()
        with locks.hold("pool", timeout=10):
            pass
        timer.join()
    finally:
        os.close(fd)
