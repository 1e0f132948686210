"""Controller service: volumes, capacity ranges, GetCapacity, validation, ListVolumes paging."""

from __future__ import annotations

import grpc
import pytest

from sanity import csi_pb2, paging
from sanity.csi import Capabilities, Config, Stubs, Tracker, expect_code, list_all_volumes


@pytest.fixture
def cv(controller: Capabilities) -> Capabilities:
    controller.require_controller("CREATE_DELETE_VOLUME")
    return controller


def _all_volume_ids(stubs: Stubs) -> list[str]:
    return [v for page in list_all_volumes(stubs) for v in page]


def test_create_and_delete_volume(stubs: Stubs, cv: Capabilities, tracker: Tracker,
                                  cfg: Config) -> None:
    vol = tracker.create_volume()
    assert vol.capacity_bytes == 0 or vol.capacity_bytes >= cfg.volume_size
    if "LIST_VOLUMES" in cv.controller:
        assert vol.volume_id in _all_volume_ids(stubs), "created volume is not listed"
    tracker.delete_volume(vol.volume_id)
    if "LIST_VOLUMES" in cv.controller:
        assert vol.volume_id not in _all_volume_ids(stubs), "deleted volume is still listed"
    if "GET_VOLUME" in cv.controller:
        expect_code(grpc.StatusCode.NOT_FOUND, lambda: stubs.controller.ControllerGetVolume(
            csi_pb2.ControllerGetVolumeRequest(volume_id=vol.volume_id)))


def test_capacity_required_bytes_honoured(cv: Capabilities, tracker: Tracker,
                                          cfg: Config) -> None:
    required = cfg.volume_size + cfg.volume_size // 2
    vol = tracker.create_volume(required=required)
    assert vol.capacity_bytes == 0 or vol.capacity_bytes >= required, (
        f"capacity {vol.capacity_bytes} < required_bytes {required}")


def test_capacity_limit_bytes_honoured(cv: Capabilities, tracker: Tracker, cfg: Config) -> None:
    vol = tracker.create_volume(required=0, limit=cfg.volume_size)
    assert vol.capacity_bytes <= cfg.volume_size, (
        f"capacity {vol.capacity_bytes} > limit_bytes {cfg.volume_size}")


def test_capacity_exact_range(cv: Capabilities, tracker: Tracker, cfg: Config) -> None:
    vol = tracker.create_volume(required=cfg.volume_size, limit=cfg.volume_size)
    assert vol.capacity_bytes in (0, cfg.volume_size), (
        f"required=limit={cfg.volume_size} gave capacity {vol.capacity_bytes}")


def test_capacity_required_above_limit(cv: Capabilities, tracker: Tracker,
                                       cfg: Config) -> None:
    req = tracker.create_request(required=2 * cfg.volume_size, limit=cfg.volume_size)
    try:
        vol = tracker.create(req)
    except grpc.RpcError as err:
        assert err.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE), (
            f"expected INVALID_ARGUMENT or OUT_OF_RANGE, got {err.code().name}")
        return
    pytest.fail(f"required_bytes > limit_bytes was accepted (volume {vol.volume_id})")


def test_create_same_name_compatible_is_idempotent(cv: Capabilities, tracker: Tracker) -> None:
    name = tracker.name()
    a = tracker.create_volume(name)
    b = tracker.create_volume(name)
    assert a.volume_id == b.volume_id, "same name and parameters gave a different volume"


def test_create_same_name_incompatible(cv: Capabilities, tracker: Tracker, cfg: Config) -> None:
    name = tracker.name()
    tracker.create_volume(name)
    bigger = 4 * cfg.volume_size
    req = tracker.create_request(name, required=bigger, limit=bigger)
    try:
        vol = tracker.create(req)
    except grpc.RpcError as err:
        assert err.code() == grpc.StatusCode.ALREADY_EXISTS, (
            f"expected ALREADY_EXISTS, got {err.code().name}: {err.details()}")
        return
    pytest.fail(f"name reuse with an incompatible capacity succeeded ({vol.capacity_bytes} B)")


def test_get_capacity(stubs: Stubs, controller: Capabilities, tracker: Tracker,
                      cfg: Config) -> None:
    controller.require_controller("GET_CAPACITY")
    resp = stubs.controller.GetCapacity(csi_pb2.GetCapacityRequest(
        volume_capabilities=[tracker.cap()], parameters=cfg.volume_parameters))
    assert resp.available_capacity >= 0
    plain = stubs.controller.GetCapacity(csi_pb2.GetCapacityRequest())
    assert plain.available_capacity >= 0
    if resp.HasField("maximum_volume_size"):
        assert resp.maximum_volume_size.value >= 0
    if resp.HasField("minimum_volume_size") and resp.HasField("maximum_volume_size"):
        assert resp.minimum_volume_size.value <= resp.maximum_volume_size.value


def test_validate_volume_capabilities(stubs: Stubs, cv: Capabilities,
                                      tracker: Tracker) -> None:
    vol = tracker.create_volume()
    resp = stubs.controller.ValidateVolumeCapabilities(csi_pb2.ValidateVolumeCapabilitiesRequest(
        volume_id=vol.volume_id, volume_context=vol.volume_context,
        volume_capabilities=[tracker.cap()], parameters=tracker.cfg.volume_parameters))
    assert resp.HasField("confirmed"), f"supported capability not confirmed: {resp.message}"
    assert list(resp.confirmed.volume_capabilities) == [tracker.cap()]


def test_controller_get_volume(stubs: Stubs, cv: Capabilities, tracker: Tracker) -> None:
    cv.require_controller("GET_VOLUME")
    vol = tracker.create_volume()
    resp = stubs.controller.ControllerGetVolume(
        csi_pb2.ControllerGetVolumeRequest(volume_id=vol.volume_id))
    assert resp.volume.volume_id == vol.volume_id
    assert resp.HasField("status"), "ControllerGetVolumeResponse.status is REQUIRED"
    if "VOLUME_CONDITION" in cv.controller:
        assert resp.status.HasField("volume_condition"), (
            "VOLUME_CONDITION advertised but no volume_condition reported")
        assert not resp.status.volume_condition.abnormal, resp.status.volume_condition.message


def test_list_volumes_status_condition(stubs: Stubs, cv: Capabilities, tracker: Tracker) -> None:
    cv.require_controller("LIST_VOLUMES", "VOLUME_CONDITION")
    vol = tracker.create_volume()
    resp = stubs.controller.ListVolumes(csi_pb2.ListVolumesRequest())
    entry = next((e for e in resp.entries if e.volume.volume_id == vol.volume_id), None)
    assert entry is not None, "created volume is not listed"
    assert entry.status.HasField("volume_condition"), "VOLUME_CONDITION advertised, none listed"


# ---------------------------------------------------------------- ListVolumes pagination


def _volumes_page(stubs: Stubs) -> paging.ListPage:
    def list_page(max_entries: int, token: str) -> tuple[list[str], str]:
        resp = stubs.controller.ListVolumes(
            csi_pb2.ListVolumesRequest(max_entries=max_entries, starting_token=token))
        return [e.volume.volume_id for e in resp.entries], resp.next_token
    return list_page


@pytest.fixture
def listed(cv: Capabilities, tracker: Tracker) -> list[str]:
    cv.require_controller("LIST_VOLUMES")
    return [tracker.create_volume().volume_id for _ in range(5)]


def test_list_volumes_max_entries(stubs: Stubs, listed: list[str]) -> None:
    paging.check_max_entries(_volumes_page(stubs), listed)


def test_list_volumes_walk_all_pages(stubs: Stubs, listed: list[str]) -> None:
    paging.check_walk(_volumes_page(stubs), listed)


def test_list_volumes_invalid_token(stubs: Stubs, cv: Capabilities) -> None:
    cv.require_controller("LIST_VOLUMES")
    paging.check_invalid_token(_volumes_page(stubs))


def test_list_volumes_stable_while_changing(stubs: Stubs, listed: list[str],
                                            tracker: Tracker) -> None:
    paging.check_stability(_volumes_page(stubs), listed, tracker.delete_volume,
                           lambda: tracker.create_volume().volume_id)
