"""Full lifecycle per access type: create, stage, publish, write, read, unpublish, unstage,
stage and publish again (the data must persist), then delete."""

from __future__ import annotations

import os

import pytest

from sanity.csi import (
    Capabilities,
    Config,
    Stubs,
    Tracker,
    is_mount_point,
    list_all_volumes,
    mounts_under,
    read_data,
    write_data,
)

pytestmark = pytest.mark.access_type


@pytest.mark.parametrize("access_type", ["mount", "block"])
def test_full_lifecycle(access_type: str, stubs: Stubs, caps: Capabilities, tracker: Tracker,
                        cfg: Config) -> None:
    if access_type != cfg.access_type:
        pytest.skip(f"access type {access_type} not selected (--access-type {cfg.access_type})")
    caps.require_controller("CREATE_DELETE_VOLUME")
    vol = tracker.create_volume()
    staging, target = tracker.make_available(vol.volume_id)
    payload = os.urandom(8192)
    write_data(target, access_type, payload)
    assert read_data(target, access_type, len(payload)) == payload
    tracker.release(vol.volume_id, staging, target)
    assert not is_mount_point(target)
    if staging:
        assert not mounts_under(staging)

    staging, target = tracker.make_available(vol.volume_id)
    assert read_data(target, access_type, len(payload)) == payload, "data did not persist"
    tracker.release(vol.volume_id, staging, target)
    tracker.delete_volume(vol.volume_id)
    if "LIST_VOLUMES" in caps.controller:
        assert vol.volume_id not in {v for p in list_all_volumes(stubs) for v in p}
