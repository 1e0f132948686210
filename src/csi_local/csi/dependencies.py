"""What the CSI servicers stand on, handed to them in one piece.

Everything that touches the node is an object here (LVM through its runner,
file systems, the kernel's mount table, the state file, the locks), so a
unit test builds a Backend over a fake host and runs the servicers without
LVM; `csi_local.csi.plugin` builds the real one.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

from csi_local.config import Config
from csi_local.csi.pagination import Paginator
from csi_local.host.cgroups import Cgroups
from csi_local.host.filesystems import Filesystems
from csi_local.host.kernel import Kernel
from csi_local.host.locks import Locks
from csi_local.nodestate.state_file import StateStore
from csi_local.volumes.freezes import Freezes
from csi_local.volumes.pool import Pools
from csi_local.volumes.qos_enforcement import QosEnforcer


@dataclass
class Backend:
    config: Config
    pools: Pools  # one per device class
    fs: Filesystems
    host: Kernel
    state: StateStore
    locks: Locks
    paginator: Paginator
    # Told the reason ("key_refused", "key_missing", "mismatch", "error")
    # each time an encrypted volume's device fails to open: for the metrics.
    on_open_failure: Callable[[str], None] | None = None
    # The host's cgroup v2 hierarchy, where IO limits are enforced (docs/qos.md).
    cgroups: Cgroups = field(default_factory=Cgroups)
    # Told the reason each time a publish's IO limits cannot be enforced.
    on_qos_unenforced: Callable[[str], None] | None = None

    @functools.cached_property
    def qos(self) -> QosEnforcer:
        """The one enforcer of this node's IO limits: the node servicer's
        publishes and the reconcile loop share its last outcomes."""
        return QosEnforcer(self.cgroups, self.host, self.on_qos_unenforced)

    @functools.cached_property
    def freezes(self) -> Freezes:
        """The one freeze rule (volumes/freezes.py) of every snapshot this node
        takes: its journals under the lock directory, its limit
        --group-freeze-timeout."""
        return Freezes(self.host, self.locks, self.config.group_freeze_timeout)
