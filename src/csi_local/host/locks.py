"""Named locks shared by threads and processes (flock on files in one directory).

Threads of one process queue for a key in the process first, first come,
first served, and only the one at the head takes the flock: a thread that
waits is woken when the lock is handed to it instead of polling, and none
is overtaken by a thread that asked later (a create's wait for the pool's
lock is bounded by the creates ahead of it). A waiter gives up when the
queue stands still for its timeout, not when the queue is merely long.
flock has no timeout, so it is polled (with a growing pause) only while
another process holds it. Each
acquisition opens its own file description, so a holder excludes other
processes just as it excludes other threads. A key is any name: what the
plugins lock, under which keys and in which order, is theirs
(volumes/lock_keys.py).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import stat
import threading
import time
from collections import deque
from collections.abc import Iterator

from csi_local.errors import LockBusy, LockDirError

DEFAULT_LOCK_DIR = "/run/lock/csi-local"


def _secure_directory(directory: str) -> None:
    """Make `directory` (mode 0700, owned by this user) or check that it is.

    Anyone who can create a file there could hold the "pool" lock and block
    every create, and on hosts where /run/lock is world-writable a user who
    made the directory first could plant symlinks. So the directory must be
    a real directory (not a symlink), owned by us, and not open to others; an
    existing one of ours with a looser mode (older versions made it 0755) is
    tightened.
    """
    parent = os.path.dirname(directory.rstrip("/")) or "/"
    os.makedirs(parent, exist_ok=True)
    try:
        os.mkdir(directory, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(directory)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise LockDirError(f"lock directory {directory} is not a directory (a symlink?)")
    if st.st_uid != os.geteuid():
        raise LockDirError(
            f"lock directory {directory} is owned by uid {st.st_uid}, not {os.geteuid()}; "
            "refusing to use it (remove it, or choose another --lock-dir)"
        )
    if stat.S_IMODE(st.st_mode) & 0o077:
        os.chmod(directory, 0o700, follow_symlinks=False)


class _Queue:
    """This process's threads that hold or wait for one key, in arrival order.

    Guarded by `Locks._guard`. The lock passes from its holder straight to
    the first waiter (its event set), so a thread that asks while others
    wait queues behind them. Not re-entrant: a thread that asks again for a
    key it holds waits behind itself until its timeout (LockBusy)."""

    def __init__(self) -> None:
        self.held = False
        self.waiters: deque[threading.Event] = deque()
        self.users = 0
        self.moves = 0  # hand-overs so far: a wait gives up only when none came


class TurnLock:
    """A lock of one process's threads that serves its waiters first come,
    first served: a release hands it to the oldest waiter, whom no thread
    that asks later overtakes. A plain threading.Lock wakes a waiter on
    release but lets any thread that asks before the waiter runs take it
    first, again and again: a waiter can be passed over for as long as
    others keep asking (the lvm shell's, where the commands that only try
    it kept an lvcreate, and the pool lock it held, waiting)."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._held = False
        self._waiters: deque[threading.Event] = deque()

    def acquire(self, timeout: float | None = None) -> bool:
        """Take the lock after those that asked first; False when it has not
        come within `timeout` seconds (None: wait for it)."""
        with self._guard:
            if not self._held:  # then no one waits either
                self._held = True
                return True
            if timeout is not None and timeout <= 0:
                return False
            turn = threading.Event()
            self._waiters.append(turn)
        try:
            if turn.wait(timeout):
                return True
            with self._guard:
                if turn.is_set():
                    return True  # handed the lock as the wait ran out: it is ours
                self._waiters.remove(turn)
                return False
        except BaseException:
            with self._guard:
                if not turn.is_set():
                    self._waiters.remove(turn)
                    raise
            self.release()  # handed the lock just as it was interrupted
            raise

    def try_acquire(self) -> bool:
        """Take the lock only when it is free, and so no one waits for it."""
        return self.acquire(0)

    def release(self) -> None:
        """Hand the lock to the oldest waiter, or free it."""
        with self._guard:
            if not self._held:
                raise RuntimeError("release of a TurnLock that is not held")
            if self._waiters:
                self._waiters.popleft().set()  # the holder now: still held
            else:
                self._held = False

    def __enter__(self) -> TurnLock:
        self.acquire()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.release()


class Locks:
    def __init__(self, directory: str = DEFAULT_LOCK_DIR, timeout: float = 120.0) -> None:
        self.directory = directory
        self.timeout = timeout
        _secure_directory(directory)
        self._guard = threading.Lock()
        self._queues: dict[str, _Queue] = {}  # only keys held or waited for

    def _open(self, key: str) -> int:
        """The lock file for `key`: never through a symlink, mode 0600, ours."""
        path = self._path(key)
        flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
        try:
            fd = os.open(path, flags, 0o600)
        except OSError as err:
            raise LockDirError(f"cannot open lock file {path}: {err.strerror}") from err
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            os.close(fd)
            raise LockDirError(f"lock file {path} is not a regular file of this user; "
                           "refusing to use it")
        return fd

    def _path(self, key: str) -> str:
        # Keys may hold any characters (CSI names); hash them into a file name.
        digest = hashlib.sha256(key.encode()).hexdigest()[:32]
        return os.path.join(self.directory, f"{digest}.lock")

    @contextlib.contextmanager
    def hold(self, key: str, timeout: float | None = None) -> Iterator[None]:
        """Hold the lock for `key`; LockBusy when its queue in this process stands
        still for the timeout, or another process holds it that long."""
        limit = self.timeout if timeout is None else timeout
        with self._guard:
            queue = self._queues.setdefault(key, _Queue())
            queue.users += 1
        try:
            if not self._enter(queue, max(limit, 0.0)):
                raise LockBusy(f"an operation on {key!r} is already in progress")
            try:
                with self._flock(key, time.monotonic() + limit):
                    yield
            finally:
                self._leave(queue)
        finally:
            with self._guard:
                queue.users -= 1
                if not queue.users:
                    del self._queues[key]

    def _enter(self, queue: _Queue, timeout: float) -> bool:
        """Take `queue`'s turn: at once when no one holds or waits for it, else
        after those that came first; False once the queue has not moved for
        `timeout` seconds (its holder kept it that long). A wait behind a
        queue that moves is not cut short: in a storm of creates the pool's
        lock passes every few seconds, and the last in line is served rather
        than failed. A waiter that gives up (or is interrupted) leaves the
        queue and holds up no one behind it; one handed the lock as it gave
        up passes it on."""
        with self._guard:
            if not queue.held:  # then no one waits either
                queue.held = True
                return True
            if timeout <= 0:
                return False
            turn = threading.Event()
            queue.waiters.append(turn)
            seen = queue.moves
        try:
            while not turn.wait(timeout):
                with self._guard:
                    if turn.is_set():
                        return True  # handed the lock as the wait ran out: it is ours
                    if queue.moves == seen:  # stuck for `timeout`: give up
                        queue.waiters.remove(turn)
                        return False
                    seen = queue.moves
            return True
        except BaseException:
            with self._guard:
                if not turn.is_set():
                    queue.waiters.remove(turn)
                    raise
            self._leave(queue)  # handed the lock just as it was interrupted
            raise

    def _leave(self, queue: _Queue) -> None:
        """Hand `queue`'s lock to its first waiter, or free it."""
        with self._guard:
            queue.moves += 1
            if queue.waiters:
                queue.waiters.popleft().set()  # the holder now, still queue.held
            else:
                queue.held = False

    @contextlib.contextmanager
    def _flock(self, key: str, deadline: float) -> Iterator[None]:
        """The lock file's flock, polled until `deadline`. Between processes
        (the plugin and each run of csi-local-dhv) there is no order: flock(2)
        promises none, and a poll takes the lock whenever it finds it free, so
        a process that asked later may get it first. First come, first served
        holds among one process's threads only; of those, only the head of
        the queue polls."""
        fd = self._open(key)
        try:
            delay = 0.005
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        raise LockBusy(
                            f"an operation on {key!r} is already in progress"
                        ) from None
                    time.sleep(delay)
                    delay = min(delay * 2, 0.1)
            yield
        finally:
            os.close(fd)
