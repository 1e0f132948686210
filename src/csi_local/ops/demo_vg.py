"""Demo mode: a VG and thin pool on a loop-backed file, made if missing."""

from __future__ import annotations

import logging
import os

from csi_local.config import Config
from csi_local.errors import VolumeGroupMissing
from csi_local.host.runner import ProcessRunner
from csi_local.storage.lvm import Lvm

log = logging.getLogger(__name__)


def ensure_backing(config: Config) -> None:
    assert config.backing_file is not None and config.backing_size is not None
    runner = ProcessRunner(timeout=config.command_timeout)
    path = config.backing_file
    if not os.path.exists(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.truncate(config.backing_size)
        log.info("created backing file %s (%d bytes)", path, config.backing_size)
    attached = runner.run(["losetup", "--associated", path]).stdout.strip()
    if attached:
        loop = attached.split(":", 1)[0]
    else:
        loop = runner.run(["losetup", "--find", "--show", path]).stdout.strip()
        log.info("attached %s to %s", path, loop)
    lvm = Lvm(runner, config.volume_group, config.thin_pool)
    try:
        lvm.volume_group()
    except VolumeGroupMissing:
        lvm.create_volume_group(loop)
        log.info("created volume group %s on %s", config.volume_group, loop)
    lvm.activate_volume_group()
    if lvm.find(config.thin_pool) is None:
        lvm.create_thin_pool(80)
        log.info("created thin pool %s/%s", config.volume_group, config.thin_pool)
