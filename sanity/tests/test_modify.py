"""ControllerModifyVolume (MODIFY_VOLUME) and CreateVolume's mutable_parameters.

CSI v1.12: a plugin that advertises MODIFY_VOLUME changes the mutable
parameters of a volume in place; an empty volume_id is INVALID_ARGUMENT, a
volume that does not exist NOT_FOUND, and a mutable parameter the plugin does
not support INVALID_ARGUMENT, at create and at modify alike. The specs that
modify a volume need the mutable parameters to send (--volume-mutable-parameters).
"""

from __future__ import annotations

import grpc
import pytest

from sanity import csi_pb2
from sanity.csi import Capabilities, Config, Stubs, Tracker, expect_code

# Run in both passes: the volumes modified are of --access-type.
pytestmark = pytest.mark.access_type

UNKNOWN = {"sanity-unknown-mutable-key": "sanity-value"}


@pytest.fixture
def modify(caps: Capabilities) -> Capabilities:
    caps.require_controller("CREATE_DELETE_VOLUME", "MODIFY_VOLUME")
    return caps


def _mutable(cfg: Config) -> dict[str, str]:
    if not cfg.mutable_parameters:
        pytest.skip("no --volume-mutable-parameters given")
    return cfg.mutable_parameters


def _modify(stubs: Stubs, volume_id: str, params: dict[str, str]) -> object:
    return stubs.controller.ControllerModifyVolume(csi_pb2.ControllerModifyVolumeRequest(
        volume_id=volume_id, mutable_parameters=params))


def test_modify_without_a_volume_id_is_invalid(modify: Capabilities, stubs: Stubs,
                                               cfg: Config) -> None:
    expect_code(grpc.StatusCode.INVALID_ARGUMENT,
                lambda: _modify(stubs, "", cfg.mutable_parameters or UNKNOWN))


def test_modify_of_a_volume_that_does_not_exist_is_not_found(
        modify: Capabilities, stubs: Stubs, cfg: Config) -> None:
    expect_code(grpc.StatusCode.NOT_FOUND,
                lambda: _modify(stubs, "sanity-no-such-volume", cfg.mutable_parameters))


def test_modify_with_an_unknown_mutable_parameter_is_invalid(
        modify: Capabilities, stubs: Stubs, tracker: Tracker) -> None:
    vol = tracker.create_volume()
    expect_code(grpc.StatusCode.INVALID_ARGUMENT,
                lambda: _modify(stubs, vol.volume_id, UNKNOWN))


@pytest.mark.parametrize("created_with", [False, True],
                         ids=["created-without-mutable", "created-with-mutable"])
def test_modify_a_volume(modify: Capabilities, stubs: Stubs, tracker: Tracker, cfg: Config,
                         created_with: bool) -> None:
    params = _mutable(cfg)
    req = tracker.create_request()
    if created_with:
        req.mutable_parameters.update(params)
    vol = tracker.create(req)
    assert _modify(stubs, vol.volume_id, params) is not None
    # A repeat is a no-op that succeeds (a CO retries).
    assert _modify(stubs, vol.volume_id, params) is not None


def test_create_with_mutable_parameters(modify: Capabilities, tracker: Tracker,
                                        cfg: Config) -> None:
    req = tracker.create_request()
    req.mutable_parameters.update(_mutable(cfg))
    assert tracker.create(req).volume_id


def test_create_with_an_unknown_mutable_parameter_is_invalid(
        modify: Capabilities, stubs: Stubs, tracker: Tracker) -> None:
    req = tracker.create_request()
    req.mutable_parameters.update(UNKNOWN)
    expect_code(grpc.StatusCode.INVALID_ARGUMENT, lambda: tracker.create(req))


def test_a_volume_created_with_mutable_parameters_refuses_unknown_ones(
        modify: Capabilities, stubs: Stubs, tracker: Tracker, cfg: Config) -> None:
    req = tracker.create_request()
    req.mutable_parameters.update(_mutable(cfg))
    vol = tracker.create(req)
    expect_code(grpc.StatusCode.INVALID_ARGUMENT,
                lambda: _modify(stubs, vol.volume_id, UNKNOWN))
