"""What the three services share: config, LVM, file systems, state, locks."""

from __future__ import annotations

from dataclasses import dataclass

from csi_local.config import Config
from csi_local.fs import Filesystems
from csi_local.locks import Locks
from csi_local.lvm import Lvm
from csi_local.pagination import Paginator
from csi_local.state import StateStore


@dataclass
class Context:
    config: Config
    lvm: Lvm
    fs: Filesystems
    state: StateStore
    locks: Locks
    paginator: Paginator
