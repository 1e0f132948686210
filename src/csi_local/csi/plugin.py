"""Wires one CSI plugin process together: runner, LVM, pool, file systems, the
host, locks, state, and the CSI services (Identity, Controller, Node and
SnapshotMetadata and GroupController)."""

from __future__ import annotations

import logging
import os
import threading
from typing import TYPE_CHECKING

from csi_local.config import Config
from csi_local.csi.controller_servicer import ControllerServicer
from csi_local.csi.dependencies import Backend
from csi_local.csi.group_controller_servicer import GroupControllerServicer
from csi_local.csi.identity_servicer import IdentityServicer
from csi_local.csi.node_servicer import NodeServicer
from csi_local.csi.pagination import Paginator
from csi_local.csi.snapshot_metadata_servicer import SnapshotMetadataServicer
from csi_local.errors import StorageError
from csi_local.host.atomic_files import write_atomic
from csi_local.host.cgroups import Cgroups
from csi_local.host.filesystems import Filesystems
from csi_local.host.kernel import Kernel
from csi_local.host.locks import Locks
from csi_local.host.runner import ProcessRunner
from csi_local.nodestate.recovery import rebuild_state, reconcile_state
from csi_local.nodestate.state_file import StateStore
from csi_local.storage.committed_vg import CommittedMetadata
from csi_local.storage.lvm_config import backup_dir, profile_dir
from csi_local.storage.lvm_shell import use_lvm_shell
from csi_local.volumes.changed_blocks import ChangedBlocks
from csi_local.volumes.group_snapshots import GroupSnapshots
from csi_local.volumes.known_vgs import KnownVolumeGroups
from csi_local.volumes.node_records import VolumeRecord
from csi_local.volumes.pool import Pools
from csi_local.volumes.pool_monitor import PoolMonitor
from csi_local.volumes.qos_enforcement import QosReconciler

if TYPE_CHECKING:
    from csi_local.ops.metrics import Metrics

log = logging.getLogger(__name__)

TOKEN_KEY_FILE = "token.key"  # noqa: S105 (a file name): in the state directory


def _token_key(state_dir: str) -> bytes:
    """A key for page tokens that outlives restarts of the plugin."""
    path = os.path.join(state_dir, TOKEN_KEY_FILE)
    try:
        with open(path, encoding="ascii") as f:
            key = bytes.fromhex(f.read().strip())
        if len(key) == 32:
            return key
    except (FileNotFoundError, ValueError):
        pass
    key = os.urandom(32)
    write_atomic(path, key.hex())
    return key


class CsiPlugin:
    """The CSI plugin of one node: its backend and its three servicers."""

    def __init__(self, config: Config) -> None:
        self.config = config
        # Metrics only when asked for (--metrics-address): then the runner, the
        # state store and the pool monitor report to them.
        self.metrics: Metrics | None = None
        if config.metrics_address:
            from csi_local.ops.metrics import Metrics

            self.metrics = Metrics(node=config.node_id)
        metrics = self.metrics
        runner = ProcessRunner(timeout=config.command_timeout,
                               observe=metrics.observe_command if metrics else None)
        if config.lvm_shell:
            use_lvm_shell(runner, lambda: profile_dir(runner))
        self.runner = runner
        host = Kernel()
        locks = Locks(config.lock_dir)
        pools = Pools(config.classes, runner, locks, config.pool_policy,
                      committed=CommittedMetadata(runner, host),
                      known_vgs=KnownVolumeGroups(config.state_dir, lambda: backup_dir(runner)))

        def rebuild() -> dict[str, VolumeRecord]:
            if metrics is not None:
                metrics.state_rebuilt()
            return rebuild_state(pools, host)

        state = StateStore(config.state_dir, rebuild=rebuild,
                           reconcile=lambda records: reconcile_state(pools, host, records))
        try:
            pools.note_volume_groups()
        except StorageError as err:  # LVM not answering: every missing VG counts as held
            log.warning("cannot tell which volume groups are here: %s", err)
        # One monitor per class's pool: each reads its own VG and extends its pool.
        self.monitors = [
            PoolMonitor(pool.lvm, pool, config.pool_monitor_interval,
                        on_extend=metrics.extend_observer(pool.class_name) if metrics else None)
            for pool in pools
        ]
        if metrics is not None:
            metrics.watch(self.monitors)
        self.backend = Backend(
            config=config, pools=pools,
            fs=Filesystems(runner, host), host=host, state=state, locks=locks,
            paginator=Paginator(_token_key(config.state_dir)),
            on_open_failure=metrics.open_failed if metrics else None,
            cgroups=Cgroups(config.cgroup_root),
            on_qos_unenforced=metrics.qos_unenforced if metrics else None,
        )
        # IO limits converge on the node: every published volume's tags reread
        # from the committed metadata, its workloads' io.max rewritten where it
        # differs (docs/qos.md).
        self.qos_reconciler = QosReconciler(self.backend.qos, pools, locks, state.all,
                                            config.qos_reconcile_interval)
        if metrics is not None:
            metrics.watch_qos(self.backend.qos)
        self.identity = IdentityServicer(config, pools)
        self.controller = ControllerServicer(self.backend)
        self.node = NodeServicer(self.backend)
        changed = ChangedBlocks(pools, locks, config.state_dir, host)
        # A metadata snapshot held by a reader that died with the last process
        # would stay held (and make every metadata change copy on write); one
        # that another program holds is reported and left alone.
        changed.release_leftovers()
        self.snapshot_metadata = SnapshotMetadataServicer(changed)
        groups = GroupSnapshots(pools, self.backend.fs, host, self.backend.freezes,
                                legacy_journal_dir=config.state_dir)
        # A snapshot killed mid-way leaves file systems frozen (the kernel keeps
        # them so when the freezer dies), and a group take one without all its
        # members: every leftover freeze journal is thawed before serving.
        groups.recover()
        self.group_controller = GroupControllerServicer(self.backend, groups)

    def start(self) -> None:
        """What starts once the server answers: the pool monitors, the lvm
        shell, and the warm-up of the listing's read; each in the background,
        beside the first calls, none before them."""
        for monitor in self.monitors:
            monitor.start()
        # Its first round runs at once: limits changed while the plugin was down.
        self.qos_reconciler.start()
        # Serving already: the shell starts beside the first calls, not before.
        self.runner.start_shell()
        threading.Thread(target=self._warm, name="warm-listing", daemon=True).start()

    def _warm(self) -> None:
        """Pools.warm: the VGs' whole metadata parsed before the first listing
        needs it (the start parsed only its pools' and staged volumes'). A
        failure is the listing's to meet and report: here it is only logged."""
        try:
            self.backend.pools.warm()
        except Exception as err:  # a background nicety: never the plugin's end
            log.debug("warming the listing's read of the volume groups: %s", err,
                      exc_info=True)

    def close(self) -> None:
        for monitor in self.monitors:
            monitor.stop()
        self.qos_reconciler.stop()
        self.backend.state.close()
        self.runner.close()
