"""The thin pool guard and autoextend against real LVM: a volume filled with
writes makes the plugin grow its pool from the VG's free space before any
write fails, with every byte intact; with autoextend off, the guard refuses
new volumes above the high-water mark while the existing ones keep working."""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from csi_local._gen import csi_pb2 as pb
from tests.integration.conftest import (
    LoopVG,
    PluginProcess,
    expect_code,
    make_vg,
    mount_cap,
    run,
)

pytestmark = [pytest.mark.integration, pytest.mark.report]
MiB = 1 << 20
CHUNK = 8 * MiB


def pool_figures(vg: LoopVG) -> tuple[int, float]:
    """(pool size in bytes, data percent), as lvs reports them."""
    out = run("lvs", "--reportformat", "json", "--units", "b", "--nosuffix",
              "-o", "lv_size,data_percent", f"{vg.name}/{vg.pool}").stdout
    row = json.loads(out)["report"][0]["lv"][0]
    return int(row["lv_size"]), float(row["data_percent"])


@pytest.fixture
def small_vg() -> Iterator[LoopVG]:
    """1 GiB VG whose pool takes a fifth of it: room to autoextend into."""
    vg = make_vg(size=1 << 30, pool_percent=20)
    yield vg
    vg.destroy()


def stage_volume(p: PluginProcess, name: str, size: int) -> tuple[str, Path]:
    vid = p.controller.CreateVolume(pb.CreateVolumeRequest(
        name=name, capacity_range=pb.CapacityRange(required_bytes=size),
        volume_capabilities=[mount_cap()])).volume.volume_id
    staging = Path(p.path(f"{name}-stage"))
    p.node.NodeStageVolume(pb.NodeStageVolumeRequest(
        volume_id=vid, staging_target_path=str(staging), volume_capability=mount_cap()))
    return vid, staging


def write_chunks(directory: Path, count: int, *, pause: float,
                 prefix: str = "chunk") -> dict[str, str]:
    """`count` files of random data, each fsynced; their sha256 by name."""
    sums = {}
    for i in range(count):
        data = os.urandom(CHUNK)
        name = f"{prefix}-{i:03d}"
        fd = os.open(directory / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, data)
            os.fsync(fd)  # an EIO here is a write the full pool failed
        finally:
            os.close(fd)
        sums[name] = hashlib.sha256(data).hexdigest()
        time.sleep(pause)  # an application's pace, not a burst
    return sums


def unstage_and_restage(p: PluginProcess, vid: str, staging: Path) -> None:
    """Read back from the device, not the page cache."""
    p.node.NodeUnstageVolume(pb.NodeUnstageVolumeRequest(
        volume_id=vid, staging_target_path=str(staging)))
    p.node.NodeStageVolume(pb.NodeStageVolumeRequest(
        volume_id=vid, staging_target_path=str(staging), volume_capability=mount_cap()))


def checksums(directory: Path, names: list[str]) -> dict[str, str]:
    return {n: hashlib.sha256((directory / n).read_bytes()).hexdigest() for n in names}


def test_autoextend_grows_the_pool_before_writes_fail(plugin_factory: object,
                                                       small_vg: LoopVG) -> None:
    size0, _ = pool_figures(small_vg)
    p = plugin_factory(  # type: ignore[operator]
        "--overprovision-ratio", "4", "--pool-monitor-interval", "1",
        "--pool-autoextend-threshold-percent", "50", "--pool-autoextend-percent", "50",
        target_vg=small_vg)
    vid, staging = stage_volume(p, "grows", 512 * MiB)
    count = (size0 * 13 // 10) // CHUNK  # 130% of the pool as it was
    sums = write_chunks(staging, count, pause=0.5)
    size1, data1 = pool_figures(small_vg)
    print(f"\npool {size0 >> 20} MiB -> {size1 >> 20} MiB after writing "
          f"{count * CHUNK >> 20} MiB; data now {data1:.1f}%")
    assert size1 > size0 * 13 // 10, "the pool did not grow past what was written"
    assert "autoextend" in p.log()
    unstage_and_restage(p, vid, staging)
    assert checksums(staging, list(sums)) == sums
    out = run("dmesg").stdout
    assert "out of data space" not in out and "switching pool to out-of-data-space" not in out


def test_guard_refuses_new_volumes_while_existing_ones_work(plugin_factory: object,
                                                            small_vg: LoopVG) -> None:
    p = plugin_factory("--overprovision-ratio", "4", "--pool-data-limit-percent", "40",
                       target_vg=small_vg)  # type: ignore[operator]
    vid, staging = stage_volume(p, "fills", 256 * MiB)
    size0, _ = pool_figures(small_vg)
    sums = write_chunks(staging, (size0 * 45 // 100) // CHUNK + 1, pause=0.0)
    _, data = pool_figures(small_vg)
    assert data >= 40.0, data
    err = expect_code(grpc.StatusCode.RESOURCE_EXHAUSTED, p.controller.CreateVolume,
                      pb.CreateVolumeRequest(name="refused", volume_capabilities=[mount_cap()],
                                             capacity_range=pb.CapacityRange(
                                                 required_bytes=16 * MiB)))
    message = err.details() or ""
    print(f"\nCreateVolume at {data:.1f}%: {message}")
    assert f"thin pool {small_vg.name}/{small_vg.pool}" in message and "limit 40%" in message
    expect_code(grpc.StatusCode.RESOURCE_EXHAUSTED, p.controller.CreateSnapshot,
                pb.CreateSnapshotRequest(source_volume_id=vid, name="snap"))
    got = p.controller.ControllerGetVolume(pb.ControllerGetVolumeRequest(volume_id=vid))
    assert got.status.volume_condition.abnormal
    assert "high-water mark" in got.status.volume_condition.message
    # The existing volume keeps working: more writes, and everything reads back.
    sums |= write_chunks(staging, 2, pause=0.0, prefix="more")
    unstage_and_restage(p, vid, staging)
    assert checksums(staging, list(sums)) == sums
    assert len(small_vg.lv_names()) == 1  # nothing half-made
