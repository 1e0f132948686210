"""Named locks: threads of one process queue without polling, first come,
first served; other processes are kept out by flock; nothing is left behind
per key."""

from __future__ import annotations

import fcntl
import os
import random
import threading
import time
import types
from collections.abc import Callable
from pathlib import Path

import pytest

from csi_local.errors import LockBusy
from csi_local.host import locks as locks_mod
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


def test_a_wait_behind_a_moving_queue_outlasts_the_timeout(tmp_path: Path) -> None:
    # A storm: each holder keeps the lock for 0.6 of the timeout, so the last
    # in line waits several timeouts in all. It is served, as the queue moved
    # within every timeout; only a queue that stands still gives LockBusy.
    locks = Locks(str(tmp_path), timeout=0.5)
    got: list[str] = []
    busy: list[int] = []

    def holder(i: int) -> None:
        try:
            with locks.hold("pool"):
                time.sleep(0.3)
                got.append(f"h{i}")
        except LockBusy:
            busy.append(i)

    t0 = time.monotonic()
    with locks.hold("pool"):
        threads = _queue_up(locks, "pool", 5, holder)
        time.sleep(0.3)
    for t in threads:
        t.join(20)
    assert busy == [] and got == [f"h{i}" for i in range(5)]
    assert time.monotonic() - t0 > 3 * 0.5  # the last waited past its timeout, served
    with locks.hold("pool"):  # a queue that stands still gives up after one timeout
        t1 = time.monotonic()
        threads = _queue_up(locks, "pool", 1, holder)
        threads[0].join(10)
        assert busy == [0] and 0.4 < time.monotonic() - t1 < 3
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


def _waiting(locks: Locks, key: str) -> int:
    """Threads of this process queued for `key` behind its holder."""
    queue = locks._queues.get(key)
    return 0 if queue is None else len(queue.waiters)


def _queue_up(locks: Locks, key: str, n: int,
              target: Callable[[int], None]) -> list[threading.Thread]:
    """`n` threads running `target(i)`, started one at a time: each is queued
    for `key` before the next starts, so they arrive in the order 0..n-1."""
    threads = []
    for i in range(n):
        t = threading.Thread(target=target, args=(i,), daemon=True)
        t.start()
        _wait_for(lambda i=i: _waiting(locks, key) == i + 1, f"waiter {i} is queued")
        threads.append(t)
    return threads


def test_waiters_take_the_lock_in_the_order_they_came(tmp_path: Path) -> None:
    # Each thread, its turn over, asks again at once while the others wait: a
    # lock that lets a caller take it before the waiter it woke (a plain
    # threading.Lock) hands it back to the thread that just let go.
    locks = Locks(str(tmp_path))
    n, rounds = 8, 6
    order: list[int] = []

    def worker(i: int) -> None:
        for _ in range(rounds):
            with locks.hold("pool", timeout=30):
                order.append(i)
                time.sleep(0.01)  # the others, and the one before, queue meanwhile

    with locks.hold("pool"):
        threads = _queue_up(locks, "pool", n, worker)
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    assert order == list(range(n)) * rounds
    assert locks._queues == {}


def test_a_waiter_that_gives_up_holds_up_no_one_behind_it(tmp_path: Path) -> None:
    locks = Locks(str(tmp_path))
    got: list[str] = []
    busy: list[int] = []
    patient = 30.0

    def waiter(i: int) -> None:
        try:
            with locks.hold("v", timeout=0.2 if i == 1 else patient):
                got.append(f"w{i}")
        except LockBusy:
            busy.append(i)

    with locks.hold("v"):
        threads = _queue_up(locks, "v", 3, waiter)
        _wait_for(lambda: busy == [1], "the second waiter gives up")
        assert _waiting(locks, "v") == 2  # it left the queue; the others kept their places
    t0 = time.monotonic()
    for t in threads:
        t.join(10)
    assert got == ["w0", "w2"]
    assert time.monotonic() - t0 < 5  # the last was handed the lock, not left to time out
    assert locks._queues == {}


class _LateEvent(threading.Event):
    """A turn whose wait runs out (or is interrupted) just as the lock is
    handed to it: it reports no hand-over, or raises, once it was set."""

    interrupt = False

    def wait(self, timeout: float | None = None) -> bool:
        super().wait(timeout)
        if self.interrupt:
            raise KeyboardInterrupt
        return False


@pytest.mark.parametrize("interrupt", [False, True], ids=["timed out", "interrupted"])
def test_a_waiter_handed_the_lock_as_it_gives_up_loses_no_turn(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, interrupt: bool) -> None:
    locks = Locks(str(tmp_path))
    monkeypatch.setattr(_LateEvent, "interrupt", interrupt)
    late = types.SimpleNamespace(Event=_LateEvent, Lock=threading.Lock)
    got: list[str] = []
    errors: list[BaseException] = []

    def first(_: int) -> None:  # its wait ends as the lock is handed to it
        try:
            with locks.hold("v", timeout=30):
                got.append("first")
        except BaseException as err:  # the test's interrupt, recorded
            errors.append(err)

    def second() -> None:
        with locks.hold("v", timeout=30):
            got.append("second")

    with locks.hold("v"):
        monkeypatch.setattr(locks_mod, "threading", late)
        a = _queue_up(locks, "v", 1, first)[0]
        monkeypatch.setattr(locks_mod, "threading", threading)
        b = threading.Thread(target=second, daemon=True)
        b.start()
        _wait_for(lambda: _waiting(locks, "v") == 2, "both wait")
    a.join(10)
    b.join(10)
    if interrupt:  # it passed the lock on, to the one behind it
        assert got == ["second"] and [type(e) for e in errors] == [KeyboardInterrupt]
    else:  # the lock was its own
        assert got == ["first", "second"] and errors == []
    assert locks._queues == {}


def test_no_wake_up_is_lost_under_stress(tmp_path: Path) -> None:
    # Threads take one key over and over, some giving up at once or soon, so
    # that gives-up race hand-overs. Each patient wait is served well within
    # its timeout; a lost wake-up would leave one waiting it out (LockBusy).
    locks = Locks(str(tmp_path))
    n, rounds = 16, 300
    inside: list[int] = []
    served = [0] * n
    failures: list[str] = []
    overlaps: list[int] = []

    def worker(i: int) -> None:
        rng = random.Random(i)
        for _ in range(rounds):
            timeout = rng.choice([0.0, 0.0005, 0.002, 20.0, 20.0])
            try:
                with locks.hold("pool", timeout=timeout):
                    inside.append(i)
                    if len(inside) != 1:
                        overlaps.append(len(inside))
                    if rng.random() < 0.3:
                        time.sleep(0.0005)
                    inside.remove(i)
                    served[i] += 1
            except LockBusy:
                if timeout == 20.0:
                    failures.append(f"thread {i} waited out {timeout} s")

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(n)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, 60 - (time.monotonic() - t0)))
    assert not any(t.is_alive() for t in threads), "a waiter never woke"
    assert failures == [] and overlaps == []
    assert all(served)
    assert locks._queues == {}


def test_a_turn_lock_serves_its_waiters_in_the_order_they_came() -> None:
    """TurnLock (the lvm shell's): a release hands the lock to the oldest
    waiter, and a thread that only tries it while someone waits is refused,
    however often it tries (a plain lock lets such a thread in first)."""
    lock = locks_mod.TurnLock()
    assert lock.acquire(1.0)
    order: list[int] = []
    threads = []

    def take(i: int) -> None:
        assert lock.acquire(10.0)
        order.append(i)
        time.sleep(0.01)
        lock.release()

    for i in range(5):
        t = threading.Thread(target=take, args=(i,))
        t.start()
        threads.append(t)
        _wait_for(lambda n=i + 1: len(lock._waiters) == n, f"{i + 1} waiters")
    tried = [lock.try_acquire() for _ in range(100)]
    lock.release()
    for t in threads:
        t.join(5)
    assert order == [0, 1, 2, 3, 4] and not any(tried)
    assert lock.try_acquire()  # free, no one waits: taken at once
    lock.release()
    with pytest.raises(RuntimeError):
        lock.release()


def test_a_turn_lock_waiter_that_gives_up_holds_up_no_one() -> None:
    lock = locks_mod.TurnLock()
    with lock:
        t0 = time.monotonic()
        assert not lock.acquire(0.1)
        assert 0.05 < time.monotonic() - t0 < 2.0 and not lock._waiters
    assert lock.acquire(0) and not lock.acquire(0)
    lock.release()
