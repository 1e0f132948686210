"""Wires one plugin process together: runner, LVM, file systems, locks, state,
and the three CSI services."""

from __future__ import annotations

import logging
import os

from csi_local import mounts
from csi_local import volumes as vols
from csi_local.config import Config
from csi_local.context import Context
from csi_local.controller import ControllerServicer
from csi_local.errors import CsiError
from csi_local.fs import Filesystems
from csi_local.identity import IdentityServicer
from csi_local.locks import Locks
from csi_local.lvm import Lvm
from csi_local.node import NodeServicer
from csi_local.pagination import Paginator
from csi_local.runner import ShRunner
from csi_local.state import Publish, Staging, StateStore, VolumeRecord, write_atomic

log = logging.getLogger(__name__)


def rebuild_state(lvm: Lvm, table: list[mounts.Mount] | None = None) -> dict[str, VolumeRecord]:
    """Staging and publish records recovered from the kernel's mount table.

    For each CSI volume, the first mount of its device (mount order) is the
    staging mount; for block volumes the staging mount is the device node
    bound onto <staging>/<volume-id>. Later mounts are publishes.
    """
    table = mounts.read_mounts() if table is None else table
    records: dict[str, VolumeRecord] = {}
    try:
        lvs = lvm.list()
    except CsiError as err:
        log.error("cannot list LVs to rebuild the state: %s", err.message)
        return records
    for lv in lvs:
        if not vols.is_csi_volume(lv) or lv.kernel_major < 0:
            continue
        found = [m for m in table if mounts.mount_is_device(m, lv.kernel_major, lv.kernel_minor)]
        if not found:
            continue
        staging: Staging | None = None
        pubs: dict[str, Publish] = {}
        for m in found:
            is_block = (m.major, m.minor) != (lv.kernel_major, lv.kernel_minor)
            if staging is None and is_block and os.path.basename(m.mount_point) == lv.name:
                staging = Staging(path=os.path.dirname(m.mount_point), access_type="block")
            elif staging is None and not is_block:
                staging = Staging(path=m.mount_point, access_type="mount", fs_type=m.fs_type,
                                  flags_known=False)
            else:
                pubs[m.mount_point] = Publish(readonly=m.read_only)
        records[lv.name] = VolumeRecord(lv.name, staging, pubs)
    return records


def _token_key(state_dir: str) -> bytes:
    """A key for page tokens that outlives restarts of the plugin."""
    path = os.path.join(state_dir, "token.key")
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


class Plugin:
    def __init__(self, config: Config) -> None:
        self.config = config
        runner = ShRunner(timeout=config.command_timeout)
        lvm = Lvm(runner, config.volume_group, config.thin_pool)
        fs = Filesystems(runner)
        state = StateStore(config.state_dir, rebuild=lambda: rebuild_state(lvm))
        self.ctx = Context(
            config=config, lvm=lvm, fs=fs, state=state, locks=Locks(config.lock_dir),
            paginator=Paginator(_token_key(config.state_dir)),
        )
        self.identity = IdentityServicer(config, lvm)
        self.controller = ControllerServicer(self.ctx)
        self.node = NodeServicer(self.ctx)

    def close(self) -> None:
        self.ctx.state.close()
