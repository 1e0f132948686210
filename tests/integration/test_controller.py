"""Controller service against real LVM: every success path and error code."""

from __future__ import annotations

import concurrent.futures
import subprocess
from typing import Any

import grpc
import pytest

from csi_local._gen import csi_pb2 as pb
from tests.integration.conftest import LoopVG, PluginProcess, block_cap, expect_code, mount_cap, run

pytestmark = pytest.mark.integration
MiB = 1 << 20
Code = grpc.StatusCode
RPC = pb.ControllerServiceCapability.RPC
KEY = "topology.lvm.csi-local.dev/node"


def create(p: PluginProcess, name: str, size: int = 16 * MiB,
           cap: pb.VolumeCapability | None = None, **kw: Any) -> pb.Volume:
    req = pb.CreateVolumeRequest(
        name=name, capacity_range=pb.CapacityRange(required_bytes=size),
        volume_capabilities=[mount_cap() if cap is None else cap], **kw,
    )
    return p.controller.CreateVolume(req).volume


def lv_names(vg: LoopVG) -> list[str]:
    return vg.lv_names()


def test_create_is_idempotent_and_rounds_to_extents(plugin: PluginProcess, vg: LoopVG) -> None:
    vol = create(plugin, "pvc-a", size=5 * MiB + 1)
    assert vol.capacity_bytes == 8 * MiB  # 4 MiB extents
    assert vol.volume_id in lv_names(vg)
    assert [dict(t.segments) for t in vol.accessible_topology] == [{KEY: "node-1"}]
    again = create(plugin, "pvc-a", size=5 * MiB + 1)
    assert again == vol
    assert lv_names(vg) == [vol.volume_id]
    # Same name, incompatible size: ALREADY_EXISTS, nothing new.
    expect_code(Code.ALREADY_EXISTS, create, plugin, "pvc-a", size=64 * MiB)
    assert lv_names(vg) == [vol.volume_id]


def test_name_mapping_survives_restart_and_state_loss(plugin: PluginProcess) -> None:
    vol = create(plugin, "pvc-persist")
    plugin.kill()
    (plugin.state_dir / "state.json").unlink(missing_ok=True)
    plugin.start()
    assert create(plugin, "pvc-persist").volume_id == vol.volume_id


def test_concurrent_identical_creates_yield_one_lv(plugin: PluginProcess, vg: LoopVG) -> None:
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        vols = list(pool.map(lambda _: create(plugin, "pvc-race"), range(6)))
    assert len({v.volume_id for v in vols}) == 1
    assert lv_names(vg) == [vols[0].volume_id]


def test_capacity_range_errors(plugin: PluginProcess, vg: LoopVG) -> None:
    def with_range(req: int, lim: int) -> object:
        return plugin.controller.CreateVolume(pb.CreateVolumeRequest(
            name="pvc-range", capacity_range=pb.CapacityRange(required_bytes=req, limit_bytes=lim),
            volume_capabilities=[mount_cap()]))
    expect_code(Code.OUT_OF_RANGE, with_range, 5 * MiB, 6 * MiB)
    expect_code(Code.OUT_OF_RANGE, with_range, 10 * MiB, 5 * MiB)
    assert lv_names(vg) == []
    vol = with_range(0, 10 * MiB).volume  # type: ignore[attr-defined]
    assert vol.capacity_bytes == 8 * MiB


def test_request_validation(plugin: PluginProcess, vg: LoopVG) -> None:
    expect_code(Code.INVALID_ARGUMENT, plugin.controller.CreateVolume,
                pb.CreateVolumeRequest(name="", volume_capabilities=[mount_cap()]))
    expect_code(Code.INVALID_ARGUMENT, plugin.controller.CreateVolume,
                pb.CreateVolumeRequest(name="x"))
    err = expect_code(Code.INVALID_ARGUMENT, create, plugin, "x", parameters={"speed": "fast"})
    assert "'speed'" in (err.details() or "")
    multi = mount_cap(mode=pb.VolumeCapability.AccessMode.MULTI_NODE_MULTI_WRITER)
    expect_code(Code.INVALID_ARGUMENT, create, plugin, "x", cap=multi)
    vol = create(plugin, "x", parameters={"csi.storage.k8s.io/pvc/name": "data"})
    assert vol.volume_id
    assert lv_names(vg) == [vol.volume_id]


def test_topology(plugin: PluginProcess, vg: LoopVG) -> None:
    other = pb.TopologyRequirement(requisite=[pb.Topology(segments={KEY: "node-2"})])
    expect_code(Code.RESOURCE_EXHAUSTED, create, plugin, "t", accessibility_requirements=other)
    here = pb.TopologyRequirement(requisite=[pb.Topology(segments={KEY: "node-2"}),
                                             pb.Topology(segments={KEY: "node-1"})])
    assert create(plugin, "t", accessibility_requirements=here).volume_id
    info = plugin.node.NodeGetInfo(pb.NodeGetInfoRequest())
    assert dict(info.accessible_topology.segments) == {KEY: "node-1"}


def test_capacity_gates_creation_and_matches_getcapacity(plugin: PluginProcess, vg: LoopVG) -> None:
    cap = plugin.controller.GetCapacity(pb.GetCapacityRequest()).available_capacity
    pool_size = int(run("lvs", "--noheadings", "--units", "b", "--nosuffix", "-o", "lv_size",
                        f"{vg.name}/{vg.pool}").stdout)
    assert 0 < cap <= pool_size and pool_size - cap < 4 * MiB
    expect_code(Code.RESOURCE_EXHAUSTED, create, plugin, "huge", size=cap + 4 * MiB)
    assert lv_names(vg) == []
    create(plugin, "fits", size=64 * MiB)
    after = plugin.controller.GetCapacity(pb.GetCapacityRequest()).available_capacity
    assert after == cap - 64 * MiB
    elsewhere = plugin.controller.GetCapacity(pb.GetCapacityRequest(
        accessible_topology=pb.Topology(segments={KEY: "node-9"}))).available_capacity
    assert elsewhere == 0


def test_overprovisioning_ratio(plugin_factory: object, vg: LoopVG) -> None:
    p = plugin_factory("--overprovision-ratio", "3")  # type: ignore[operator]
    cap = p.controller.GetCapacity(pb.GetCapacityRequest()).available_capacity
    pool_size = int(run("lvs", "--noheadings", "--units", "b", "--nosuffix", "-o", "lv_size",
                        f"{vg.name}/{vg.pool}").stdout)
    assert cap > 2 * pool_size
    assert create(p, "big", size=pool_size + 64 * MiB).capacity_bytes >= pool_size


def test_delete_volume(plugin: PluginProcess, vg: LoopVG) -> None:
    vol = create(plugin, "del")
    plugin.controller.DeleteVolume(pb.DeleteVolumeRequest(volume_id=vol.volume_id))
    assert lv_names(vg) == []
    plugin.controller.DeleteVolume(pb.DeleteVolumeRequest(volume_id=vol.volume_id))
    plugin.controller.DeleteVolume(pb.DeleteVolumeRequest(volume_id="no-such-volume"))
    expect_code(Code.INVALID_ARGUMENT, plugin.controller.DeleteVolume, pb.DeleteVolumeRequest())


def test_delete_refused_while_staged(plugin: PluginProcess, vg: LoopVG) -> None:
    vol = create(plugin, "busy")
    staging = plugin.path("stage-busy")
    plugin.node.NodeStageVolume(pb.NodeStageVolumeRequest(
        volume_id=vol.volume_id, staging_target_path=staging, volume_capability=mount_cap()))
    expect_code(Code.FAILED_PRECONDITION, plugin.controller.DeleteVolume,
                pb.DeleteVolumeRequest(volume_id=vol.volume_id))
    assert vol.volume_id in lv_names(vg)
    plugin.node.NodeUnstageVolume(pb.NodeUnstageVolumeRequest(
        volume_id=vol.volume_id, staging_target_path=staging))
    plugin.controller.DeleteVolume(pb.DeleteVolumeRequest(volume_id=vol.volume_id))
    assert lv_names(vg) == []


def test_list_volumes_pagination(plugin: PluginProcess) -> None:
    ids = sorted(create(plugin, f"list-{i}", size=4 * MiB).volume_id for i in range(5))
    first = plugin.controller.ListVolumes(pb.ListVolumesRequest(max_entries=2))
    assert len(first.entries) == 2 and first.next_token
    # Between pages: one listed volume and one unlisted are deleted, one is added.
    gone_listed = first.entries[0].volume.volume_id
    remaining = [i for i in ids if i not in {e.volume.volume_id for e in first.entries}]
    plugin.controller.DeleteVolume(pb.DeleteVolumeRequest(volume_id=gone_listed))
    plugin.controller.DeleteVolume(pb.DeleteVolumeRequest(volume_id=remaining[-1]))
    added = create(plugin, "list-new", size=4 * MiB).volume_id
    seen = [e.volume.volume_id for e in first.entries]
    token = first.next_token
    while token:
        page = plugin.controller.ListVolumes(pb.ListVolumesRequest(max_entries=2,
                                                                   starting_token=token))
        seen += [e.volume.volume_id for e in page.entries]
        token = page.next_token
    stayed = set(ids) - {gone_listed, remaining[-1]}
    assert all(seen.count(i) == 1 for i in stayed)
    assert remaining[-1] not in seen
    assert len(seen) == len(set(seen))
    assert added in seen or added < first.entries[-1].volume.volume_id
    expect_code(Code.ABORTED, plugin.controller.ListVolumes,
                pb.ListVolumesRequest(starting_token="not-a-token"))


def test_controller_get_volume_and_condition(plugin: PluginProcess, vg: LoopVG) -> None:
    vol = create(plugin, "cond")
    got = plugin.controller.ControllerGetVolume(
        pb.ControllerGetVolumeRequest(volume_id=vol.volume_id))
    assert got.volume.volume_id == vol.volume_id
    assert got.status.volume_condition.abnormal is False
    run("lvchange", "--activate", "n", f"{vg.name}/{vol.volume_id}")
    got = plugin.controller.ControllerGetVolume(
        pb.ControllerGetVolumeRequest(volume_id=vol.volume_id))
    assert got.status.volume_condition.abnormal is True
    assert "not active" in got.status.volume_condition.message
    expect_code(Code.NOT_FOUND, plugin.controller.ControllerGetVolume,
                pb.ControllerGetVolumeRequest(volume_id="csi-v-" + "0" * 32))


def test_validate_volume_capabilities(plugin: PluginProcess) -> None:
    vol = create(plugin, "val")
    ok = plugin.controller.ValidateVolumeCapabilities(pb.ValidateVolumeCapabilitiesRequest(
        volume_id=vol.volume_id, volume_capabilities=[mount_cap(), block_cap()]))
    assert len(ok.confirmed.volume_capabilities) == 2
    multi = mount_cap(mode=pb.VolumeCapability.AccessMode.MULTI_NODE_READER_ONLY)
    no = plugin.controller.ValidateVolumeCapabilities(pb.ValidateVolumeCapabilitiesRequest(
        volume_id=vol.volume_id, volume_capabilities=[multi]))
    assert not no.HasField("confirmed") and "MULTI_NODE_READER_ONLY" in no.message
    expect_code(Code.NOT_FOUND, plugin.controller.ValidateVolumeCapabilities,
                pb.ValidateVolumeCapabilitiesRequest(volume_id="csi-v-" + "1" * 32,
                                                     volume_capabilities=[mount_cap()]))
    expect_code(Code.INVALID_ARGUMENT, plugin.controller.ValidateVolumeCapabilities,
                pb.ValidateVolumeCapabilitiesRequest(volume_id=vol.volume_id))


def test_controller_capabilities(plugin_factory: object) -> None:
    p = plugin_factory()  # type: ignore[operator]
    caps = {c.rpc.type for c in p.controller.ControllerGetCapabilities(
        pb.ControllerGetCapabilitiesRequest()).capabilities}
    assert RPC.PUBLISH_UNPUBLISH_VOLUME not in caps
    assert {RPC.CREATE_DELETE_VOLUME, RPC.GET_CAPACITY, RPC.LIST_VOLUMES, RPC.GET_VOLUME,
            RPC.VOLUME_CONDITION, RPC.EXPAND_VOLUME, RPC.CLONE_VOLUME,
            RPC.CREATE_DELETE_SNAPSHOT, RPC.LIST_SNAPSHOTS, RPC.GET_SNAPSHOT} <= caps
    q = plugin_factory("--node-expansion-only")  # type: ignore[operator]
    caps = {c.rpc.type for c in q.controller.ControllerGetCapabilities(
        pb.ControllerGetCapabilitiesRequest()).capabilities}
    assert RPC.EXPAND_VOLUME not in caps


def test_pool_exhaustion_is_clean_and_others_stay_readable(plugin_factory: object) -> None:
    from tests.integration.conftest import make_vg

    small = make_vg(size=128 * MiB)
    try:
        p = plugin_factory(target_vg=small)  # type: ignore[operator]
        keep = create(p, "keep", size=16 * MiB)
        staging = p.path("keep-stage")
        p.node.NodeStageVolume(pb.NodeStageVolumeRequest(
            volume_id=keep.volume_id, staging_target_path=staging, volume_capability=mount_cap()))
        with open(f"{staging}/data", "w") as f:
            f.write("still here")
        made = 1
        while True:
            try:
                create(p, f"fill-{made}", size=16 * MiB)
                made += 1
            except grpc.RpcError as err:
                assert err.code() == Code.RESOURCE_EXHAUSTED
                assert "room for" in (err.details() or "")
                break
            assert made < 20
        names = small.lv_names()
        assert len(names) == made  # nothing half-made
        with open(f"{staging}/data") as f:
            assert f.read() == "still here"
        p.node.NodeUnstageVolume(pb.NodeUnstageVolumeRequest(
            volume_id=keep.volume_id, staging_target_path=staging))
        p.stop()
    finally:
        subprocess.run(["vgremove", "-ff", "-y", small.name], capture_output=True)
        small.destroy()
