"""Wires one plugin process together: runner, LVM, file systems, locks, state,
and the three CSI services."""

from __future__ import annotations

import logging
import os

from csi_local.config import Config
from csi_local.context import Context
from csi_local.controller import ControllerServicer
from csi_local.fs import Filesystems
from csi_local.identity import IdentityServicer
from csi_local.locks import Locks
from csi_local.lvm import Lvm
from csi_local.node import NodeServicer
from csi_local.pagination import Paginator
from csi_local.recovery import rebuild_state, reconcile_state
from csi_local.runner import ShRunner
from csi_local.state import StateStore, write_atomic

log = logging.getLogger(__name__)


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
        state = StateStore(config.state_dir, rebuild=lambda: rebuild_state(lvm),
                           reconcile=lambda records: reconcile_state(lvm, records))
        self.ctx = Context(
            config=config, lvm=lvm, fs=fs, state=state, locks=Locks(config.lock_dir),
            paginator=Paginator(_token_key(config.state_dir)),
        )
        self.identity = IdentityServicer(config, lvm)
        self.controller = ControllerServicer(self.ctx)
        self.node = NodeServicer(self.ctx)

    def close(self) -> None:
        self.ctx.state.close()
