"""What the CSI servicers stand on, handed to them in one piece.

Everything that touches the node is an object here (LVM through its runner,
file systems, the kernel's mount table, the state file, the locks), so a
unit test builds a Backend over a fake host and runs the servicers without
LVM; `csi_local.plugin` builds the real one.
"""

from __future__ import annotations

from dataclasses import dataclass

from csi_local.config import Config
from csi_local.fs import Filesystems
from csi_local.host import Host
from csi_local.locks import Locks
from csi_local.pagination import Paginator
from csi_local.pool import Pools
from csi_local.state import StateStore


@dataclass
class Backend:
    config: Config
    pools: Pools  # one per device class
    fs: Filesystems
    host: Host
    state: StateStore
    locks: Locks
    paginator: Paginator
