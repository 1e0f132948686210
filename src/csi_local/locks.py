"""Named locks shared by threads and processes (flock on files in one directory).

Each acquisition opens its own file description, so two threads of one
process exclude each other just as two processes do. The CSI plugin and the
Nomad host volume plugin use the same directory, so they never race on a
volume or on the pool's capacity.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import time
from collections.abc import Iterator

from csi_local.errors import Aborted

DEFAULT_LOCK_DIR = "/run/lock/csi-local"


class Locks:
    def __init__(self, directory: str = DEFAULT_LOCK_DIR, timeout: float = 120.0) -> None:
        self.directory = directory
        self.timeout = timeout
        os.makedirs(directory, mode=0o755, exist_ok=True)

    def _path(self, key: str) -> str:
        # Keys may hold any characters (CSI names); hash them into a file name.
        digest = hashlib.sha256(key.encode()).hexdigest()[:32]
        return os.path.join(self.directory, f"{digest}.lock")

    @contextlib.contextmanager
    def hold(self, key: str, timeout: float | None = None) -> Iterator[None]:
        """Hold the lock for `key`; ABORTED when it stays busy past the timeout."""
        limit = self.timeout if timeout is None else timeout
        fd = os.open(self._path(key), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            deadline = time.monotonic() + limit
            delay = 0.005
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        raise Aborted(
                            f"an operation on {key!r} is already in progress"
                        ) from None
                    time.sleep(delay)
                    delay = min(delay * 2, 0.1)
            yield
        finally:
            os.close(fd)
