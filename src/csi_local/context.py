"""What the three services share: config, LVM, file systems, state, locks."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass

from csi_local.config import Config
from csi_local.errors import CommandError
from csi_local.fs import Filesystems
from csi_local.locks import Locks
from csi_local.lvm import Lvm
from csi_local.pagination import Paginator
from csi_local.state import StateStore, write_atomic

log = logging.getLogger(__name__)


class Freezer:
    """fsfreeze around a snapshot, crash-safe: the frozen path is recorded
    first, so a plugin killed mid-snapshot thaws it on its next start."""

    PREFIX = "frozen."

    def __init__(self, fs: Filesystems, state_dir: str) -> None:
        self.fs = fs
        self.state_dir = state_dir

    def _marker(self, path: str) -> str:
        digest = hashlib.sha256(path.encode()).hexdigest()[:24]
        return os.path.join(self.state_dir, self.PREFIX + digest)

    def recover(self) -> None:
        for name in os.listdir(self.state_dir):
            if not name.startswith(self.PREFIX) or ".tmp." in name:
                continue
            marker = os.path.join(self.state_dir, name)
            with open(marker, encoding="utf-8") as f:
                path = f.read()
            try:
                # Exit 1 (EINVAL): it was not frozen after all.
                self.fs.runner.run(["fsfreeze", "--unfreeze", path], ok_codes=(0, 1))
                log.warning("thawed %s, left frozen by an interrupted snapshot", path)
            except CommandError as err:
                log.warning("could not thaw %s: %s", path, err.message)
            os.unlink(marker)

    @contextlib.contextmanager
    def frozen(self, path: str) -> Iterator[None]:
        marker = self._marker(path)
        write_atomic(marker, path)
        try:
            with self.fs.frozen(path):
                yield
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(marker)


@dataclass
class Context:
    config: Config
    lvm: Lvm
    fs: Filesystems
    state: StateStore
    locks: Locks
    paginator: Paginator
    freezer: Freezer
