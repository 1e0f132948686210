"""Latency of the main RPCs next to the raw commands they wrap, timed in the
same run on the same VG. Prints figures; asserts only that things worked."""

from __future__ import annotations

import os
import statistics
import time

import pytest

from csi_local._gen import csi_pb2 as pb
from tests.integration.conftest import LoopVG, PluginProcess, mount_cap, run
from tests.integration.test_node import create, publish, stage, unpublish, unstage

pytestmark = [pytest.mark.integration, pytest.mark.report]
MiB = 1 << 20
ROUNDS = 3


def timed(fn: object, *args: object) -> float:
    t0 = time.perf_counter()
    fn(*args)  # type: ignore[operator]
    return time.perf_counter() - t0


def test_rpc_latency_against_raw_commands(plugin: PluginProcess, vg: LoopVG) -> None:
    raw: dict[str, list[float]] = {"lvcreate": [], "mkfs.ext4": [], "mount": [],
                                   "mount --bind": []}
    rpc: dict[str, list[float]] = {"CreateVolume": [], "NodeStageVolume": [],
                                   "NodePublishVolume": []}
    for i in range(ROUNDS):
        name = f"raw{i}"
        raw["lvcreate"].append(timed(run, "lvcreate", "--yes", "--thin", f"{vg.name}/{vg.pool}",
                                     "--virtualsize", "64m", "--name", name))
        dev = f"/dev/{vg.name}/{name}"
        raw["mkfs.ext4"].append(timed(run, "mkfs.ext4", "-q", "-F", "-m", "0", "-E",
                                      "nodiscard,lazy_itable_init=1", dev))
        mnt, bind = plugin.path(f"raw-m{i}"), plugin.path(f"raw-b{i}")
        os.makedirs(mnt)
        os.makedirs(bind)
        raw["mount"].append(timed(run, "mount", "-t", "ext4", dev, mnt))
        raw["mount --bind"].append(timed(run, "mount", "--bind", mnt, bind))
        run("umount", bind)
        run("umount", mnt)

        t0 = time.perf_counter()
        vid = create(plugin, f"bench{i}", size=64 * MiB)
        rpc["CreateVolume"].append(time.perf_counter() - t0)
        staging, target = plugin.path(f"b-s{i}"), plugin.path(f"b-t{i}")
        rpc["NodeStageVolume"].append(timed(stage, plugin, vid, staging, mount_cap()))
        rpc["NodePublishVolume"].append(timed(publish, plugin, vid, staging, target))
        unpublish(plugin, vid, target)
        unstage(plugin, vid, staging)
        plugin.controller.DeleteVolume(pb.DeleteVolumeRequest(volume_id=vid))

    def med(xs: list[float]) -> float:
        return statistics.median(xs)

    pairs = [("CreateVolume", "lvcreate", ["lvcreate"]),
             ("NodeStageVolume", "mkfs.ext4 + mount", ["mkfs.ext4", "mount"]),
             ("NodePublishVolume", "mount --bind", ["mount --bind"])]
    print(f"\nlatency, median of {ROUNDS} (seconds; TCG-emulated VM, so absolute times are slow)")
    print(f"{'RPC':<20}{'rpc':>8}   {'raw command(s)':<20}{'raw':>8}{'ratio':>8}")
    for name, label, keys in pairs:
        r = med(rpc[name])
        w = sum(med(raw[k]) for k in keys)
        print(f"{name:<20}{r:>8.2f}   {label:<20}{w:>8.2f}{r / w:>8.2f}")
    assert all(len(v) == ROUNDS for v in rpc.values())
