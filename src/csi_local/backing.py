"""Demo mode: a VG and thin pool on a loop-backed file, made if missing."""

from __future__ import annotations

import logging
import os

from csi_local.config import Config
from csi_local.lvm import Lvm, VolumeGroupNotFound
from csi_local.runner import ShRunner

log = logging.getLogger(__name__)


def ensure_backing(config: Config) -> None:
    assert config.backing_file is not None and config.backing_size is not None
    runner = ShRunner(timeout=config.command_timeout)
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
    except VolumeGroupNotFound:
        runner.run(["vgcreate", "--yes", config.volume_group, loop])
        log.info("created volume group %s on %s", config.volume_group, loop)
    runner.run(["vgchange", "--activate", "y", config.volume_group])
    if lvm.find(config.thin_pool) is None:
        runner.run([
            "lvcreate", "--yes", "--type", "thin-pool", "--extents", "80%VG",
            "--name", config.thin_pool, config.volume_group,
        ])
        # Fail writes at once when the pool fills, instead of queueing them.
        pool = f"{config.volume_group}/{config.thin_pool}"
        runner.run(["lvchange", "--errorwhenfull", "y", pool])
        log.info("created thin pool %s/%s", config.volume_group, config.thin_pool)
