"""The thin pool's guard and autoextend, over the in-memory host: new volumes
and snapshots are refused above the high-water marks (both plugins), volumes
report the fill level as abnormal before the pool is full, and autoextend
grows data and metadata within the VG's free space, once, under the pool lock."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import pytest

from csi_local._gen import csi_pb2 as pb
from csi_local.config import Config, ConfigError
from csi_local.dhv.config import PluginConfig
from csi_local.dhv.host_volumes import HostVolumes
from csi_local.dhv.request import parse_request
from csi_local.errors import NoRoom
from csi_local.host.locks import Locks
from csi_local.storage.lvm import LogicalVolume, Lvm
from csi_local.volumes.pool import Pool, PoolPolicy
from csi_local.volumes.pool_monitor import PoolMonitor
from tests.unit.fakehost import FakeHost
from tests.unit.servicers import GiB, MiB, Node, call, make_node, mount_cap

GUARD = PoolPolicy(data_limit=90, metadata_limit=80)
AUTO = PoolPolicy(data_limit=95, metadata_limit=95, autoextend_threshold=80,
                  autoextend_percent=20)


def create(n: Node, name: str, size: int = 64 * MiB) -> tuple[str, object]:
    return call(n.controller.CreateVolume, pb.CreateVolumeRequest(
        name=name, volume_capabilities=[mount_cap()],
        capacity_range=pb.CapacityRange(required_bytes=size)))


def fill(host: FakeHost, data: float = 0.0, metadata: float = 0.0) -> None:
    pool = host.lv(host.pool_name)
    pool.data_percent, pool.metadata_percent = data, metadata


@pytest.mark.parametrize(("data", "meta", "refused", "named"), [
    (89.9, 10.0, False, ""),
    (90.0, 10.0, True, "data 90.0% full (limit 90%)"),
    (10.0, 80.5, True, "metadata 80.5% full (limit 80%)"),
    (97.0, 99.0, True, "data 97.0% full (limit 90%), metadata 99.0% full (limit 80%)"),
])
def test_create_volume_refused_above_the_high_water_mark(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, data: float, meta: float,
        refused: bool, named: str) -> None:
    n = make_node(tmp_path, monkeypatch, policy=GUARD)
    fill(n.host, data, meta)
    code, reply = create(n, "a")
    if not refused:
        assert code == "OK", reply
        return
    assert code == "RESOURCE_EXHAUSTED"
    assert f"thin pool vg0/pool0 is above its high-water mark: {named}" in str(reply)
    assert not n.host.commands("lvcreate")


def test_snapshot_and_clone_refused_above_the_mark_but_expansion_allowed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    n = make_node(tmp_path, monkeypatch, policy=GUARD)
    code, reply = create(n, "a")
    assert code == "OK"
    vid = reply.volume.volume_id  # type: ignore[attr-defined]
    fill(n.host, 95.0)
    code, msg = call(n.controller.CreateSnapshot,
                     pb.CreateSnapshotRequest(source_volume_id=vid, name="s"))
    assert code == "RESOURCE_EXHAUSTED" and "high-water mark" in msg
    code, msg = call(n.controller.CreateVolume, pb.CreateVolumeRequest(
        name="clone", volume_capabilities=[mount_cap()],
        volume_content_source=pb.VolumeContentSource(
            volume=pb.VolumeContentSource.VolumeSource(volume_id=vid))))
    assert code == "RESOURCE_EXHAUSTED" and "high-water mark" in msg
    assert len(n.host.commands("lvcreate")) == 1
    # Growing an existing volume is not a new volume: the guard does not stop it.
    code, reply = call(n.controller.ControllerExpandVolume, pb.ControllerExpandVolumeRequest(
        volume_id=vid, capacity_range=pb.CapacityRange(required_bytes=128 * MiB)))
    assert code == "OK" and reply.capacity_bytes == 128 * MiB


def test_volumes_report_the_fill_level_before_the_pool_is_full(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    n = make_node(tmp_path, monkeypatch, policy=GUARD)
    code, reply = create(n, "a")
    vid = reply.volume.volume_id  # type: ignore[attr-defined]
    code, got = call(n.controller.ControllerGetVolume,
                     pb.ControllerGetVolumeRequest(volume_id=vid))
    assert code == "OK" and not got.status.volume_condition.abnormal
    fill(n.host, 92.5)
    code, got = call(n.controller.ControllerGetVolume,
                     pb.ControllerGetVolumeRequest(volume_id=vid))
    cond = got.status.volume_condition
    assert cond.abnormal and "data 92.5% full (limit 90%)" in cond.message
    stage, target = n.path("stage"), n.path("target")
    assert call(n.node.NodeStageVolume, pb.NodeStageVolumeRequest(
        volume_id=vid, staging_target_path=stage, volume_capability=mount_cap()))[0] == "OK"
    code, stats = call(n.node.NodeGetVolumeStats,
                       pb.NodeGetVolumeStatsRequest(volume_id=vid, volume_path=stage))
    assert code == "OK" and stats.volume_condition.abnormal
    assert "data 92.5% full" in stats.volume_condition.message
    del target


def test_host_volume_plugin_honours_the_guard(tmp_path: Path) -> None:
    host = FakeHost(vg="vg0", pool="pool0")
    fill(host, 91.0)
    config = PluginConfig(volume_group="vg0", thin_pool="pool0",
                          lock_dir=str(tmp_path / "locks"))
    env = {"DHV_OPERATION": "create", "DHV_VOLUME_ID": "vol-1", "DHV_VOLUMES_DIR":
           str(tmp_path / "volumes"), "DHV_PLUGIN_DIR": str(tmp_path), "DHV_PARAMETERS": "{}",
           "DHV_CAPACITY_MIN_BYTES": str(64 * MiB)}
    plugin = HostVolumes(config, host, host)
    with pytest.raises(NoRoom, match=r"data 91\.0% full"):
        plugin.create(parse_request("create", env))
    assert not host.commands("lvcreate")
    fill(host, 50.0)
    path, size = plugin.create(parse_request("create", env))
    assert size == 64 * MiB and path.endswith("/vol-1")


def _pool(tmp_path: Path, host: FakeHost, policy: PoolPolicy = AUTO) -> Pool:
    lvm = Lvm(host, host.vg, host.pool_name)
    return Pool(lvm, Locks(str(tmp_path / "locks"), timeout=0.2), 1.0, policy)


def test_autoextend_grows_data_by_its_share(tmp_path: Path) -> None:
    host = FakeHost(vg="vg0", pool="pool0", pool_size=10 * GiB, vg_size=20 * GiB)
    fill(host, 85.0)
    pool = _pool(tmp_path, host)
    assert pool.needs_extension(pool.lvm.report())
    assert pool.autoextend() == [("data", 2 * GiB)]
    assert host.lv("pool0").size == 12 * GiB
    assert host.commands("lvextend") == [("lvextend", "--size", f"+{2 * GiB}b", "vg0/pool0")]
    assert not pool.needs_extension(pool.lvm.report())  # 85% of 10 GiB is ~71% of 12


def test_autoextend_grows_metadata_with_its_own_option(tmp_path: Path) -> None:
    host = FakeHost(vg="vg0", pool="pool0", vg_size=20 * GiB)
    fill(host, 10.0, 90.0)
    pool = _pool(tmp_path, host)
    meta = host.lv("pool0").metadata_size
    added = pool.autoextend()
    assert added == [("metadata", -(-meta * 20 // 100 // (4 * MiB)) * 4 * MiB)]
    assert host.commands("lvextend")[0][1] == "--poolmetadatasize"
    assert host.lv("pool0").size == 10 * GiB  # data untouched


def test_autoextend_never_beyond_the_vg_free_space(tmp_path: Path,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    host = FakeHost(vg="vg0", pool="pool0", pool_size=10 * GiB,
                    vg_size=10 * GiB + 8 * MiB + 512 * MiB)
    fill(host, 85.0)
    pool = _pool(tmp_path, host)
    assert pool.autoextend() == [("data", 512 * MiB)]  # all there was, not 2 GiB
    fill(host, 99.0)
    with caplog.at_level(logging.ERROR):
        assert pool.autoextend() == []
    assert "no free extents" in caplog.text
    assert len(host.commands("lvextend")) == 1


def test_no_autoextend_below_the_threshold_or_when_off(tmp_path: Path) -> None:
    host = FakeHost(vg="vg0", pool="pool0", vg_size=20 * GiB)
    fill(host, 79.9, 79.9)
    assert _pool(tmp_path, host).autoextend() == []
    fill(host, 99.0, 99.0)
    assert _pool(tmp_path, host, GUARD).autoextend() == []
    assert not host.commands("lvextend")


def test_monitor_round_extends_and_reports(tmp_path: Path) -> None:
    host = FakeHost(vg="vg0", pool="pool0", vg_size=20 * GiB)
    pool = _pool(tmp_path, host)
    seen: list[tuple[str, int]] = []
    monitor = PoolMonitor(pool.lvm, pool, interval=60, on_extend=lambda w, b: seen.append((w, b)))
    monitor.check()
    assert seen == [] and not host.commands("lvextend")
    fill(host, 81.0)
    monitor.check()
    assert seen == [("data", 2 * GiB)]
    reading = monitor.latest(max_age=60)
    assert reading is not None and reading.report.find("pool0").size == 12 * GiB  # type: ignore[union-attr]
    lvs_before = len(host.commands("lvs"))
    assert monitor.latest(max_age=60) is reading  # fresh enough: no LVM call
    assert len(host.commands("lvs")) == lvs_before
    host.vg_present = False
    assert monitor.latest(max_age=0) is None


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"pool_data_limit_percent": 0.0}, "data_limit"),
    ({"pool_metadata_limit_percent": 101.0}, "metadata_limit"),
    ({"pool_autoextend_threshold_percent": 90.0}, "below the high-water marks"),
    ({"pool_autoextend_threshold_percent": 50.0, "pool_autoextend_percent": 0.0},
     "autoextend percent"),
    ({"pool_monitor_interval": 0.0}, "interval"),
])
def test_pool_flags_are_checked_at_start(kwargs: dict[str, float], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        Config(endpoint="unix:///run/x.sock", node_id="n", volume_group="vg",
               thin_pool="pool", **kwargs)  # type: ignore[arg-type]


class _Committed:
    """A committed-metadata reader that answers with `lvs`, or not at all (None)."""

    def __init__(self, lvs: list[LogicalVolume] | None) -> None:
        self.lvs = lvs
        self.asked = 0

    def listing(self, vgs: list[str]) -> list[LogicalVolume] | None:
        self.asked += 1
        return self.lvs

    def thin_pools(self, places: list[tuple[str, str]]
                   ) -> dict[tuple[str, str], LogicalVolume | None] | None:
        self.asked += 1
        if self.lvs is None:
            return None
        found = {(lv.vg, lv.name): lv for lv in self.lvs}
        return {place: found.get(place) for place in places}


@pytest.mark.parametrize("answers", [True, False])
def test_listing_and_probe_read_without_lvs_when_the_metadata_answers(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, answers: bool) -> None:
    n = make_node(tmp_path, monkeypatch)
    code, made = create(n, "listed")
    assert code == "OK" and isinstance(made, pb.CreateVolumeResponse)
    vid = made.volume.volume_id
    pools = n.backend.pools
    scanned, _ = pools.scan()
    reader = _Committed([lv for _, lv in scanned] if answers else None)
    pools.committed = reader  # type: ignore[assignment]
    n.host.calls.clear()
    code, reply = call(n.controller.ListVolumes, pb.ListVolumesRequest())
    assert code == "OK" and [e.volume.volume_id for e in reply.entries] == [vid]
    assert not reply.entries[0].status.volume_condition.abnormal
    found, missing = pools.read_thin_pools()
    assert found[pools.default.class_name] is not None and missing == []
    assert reader.asked == 2
    # Not answered: one `lvs` each, as without a reader.
    assert len(n.host.commands("lvs")) == (0 if answers else 2)



class _PoolReader:
    """A committed-metadata reader for the pool monitor: the VG's report and
    space as LVM says them (`answers`), or no answer (None). What it reads
    to answer is taken off the host's calls: only the monitor's own count."""

    def __init__(self, host: FakeHost, answers: bool) -> None:
        self.host = host
        self.lvm = Lvm(host, "vg0", "pool0")
        self.answers = answers

    def _quietly(self, read: Callable[[], object]) -> object:
        if not self.answers:
            return None
        before = len(self.host.calls)
        try:
            return read()
        finally:
            del self.host.calls[before:]

    def report(self, vg: str, pool: str) -> object:
        return self._quietly(self.lvm.report)

    def space(self, vg: str) -> object:
        return self._quietly(self.lvm.volume_group)


@pytest.mark.parametrize("answers", [True, False])
def test_an_idle_monitor_starts_no_process_and_a_scrape_one(tmp_path: Path,
                                                            answers: bool) -> None:
    """The periodic round reads the pool's fill off the PVs and the kernel; a
    reading refreshed for the metrics runs one `lvs` (the volumes' fill) and
    takes the VG's size and free space off the PVs. `lvs` and `vgs` only when
    the metadata does not answer."""
    host = FakeHost(vg="vg0", pool="pool0", vg_size=20 * GiB)
    pool = _pool(tmp_path, host)
    pool.committed = _PoolReader(host, answers)  # type: ignore[assignment]
    monitor = PoolMonitor(pool.lvm, pool, interval=60)
    host.calls.clear()
    monitor.check()
    assert [c[0] for c in host.calls] == ([] if answers else ["lvs"])
    host.calls.clear()
    reading = monitor.latest(max_age=0)
    assert reading is not None and reading.vg.size == 20 * GiB and reading.vg.free > 0
    assert [c[0] for c in host.calls] == (["lvs"] if answers else ["lvs", "vgs"])
    fill(host, 81.0)
    host.calls.clear()
    monitor.check()
    assert len(host.commands("lvextend")) == 1  # a pool that needs it still grows
