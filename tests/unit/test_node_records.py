"""The node's records and their rules (volumes/node_records.py), row by row:
where a block volume's device is bound at its stage (and back), where a
stage mounts its device, a repeated publish, and the single-writer rule."""

from __future__ import annotations

import pytest

from csi_local._gen import csi_pb2 as pb
from csi_local.volumes.node_records import (
    SINGLE_NODE_SINGLE_WRITER,
    AccessType,
    Publish,
    Staging,
    block_stage_file,
    block_staging_path,
    writer_in_the_way,
)

V = "csi-v-" + "a" * 32
Mode = pb.VolumeCapability.AccessMode
SSW, SNW = Mode.SINGLE_NODE_SINGLE_WRITER, Mode.SINGLE_NODE_WRITER
SNMW = Mode.SINGLE_NODE_MULTI_WRITER


def test_the_records_single_writer_is_the_specs() -> None:
    # The state file stores access modes as the spec's numbers.
    assert SINGLE_NODE_SINGLE_WRITER == Mode.SINGLE_NODE_SINGLE_WRITER


@pytest.mark.parametrize("staging_path", ["/k/staging/pv1", "/var/lib/nomad/staging/x/y"])
def test_block_stage_file_and_back(staging_path: str) -> None:
    assert block_stage_file(staging_path, V) == f"{staging_path}/{V}"
    assert block_staging_path(block_stage_file(staging_path, V), V) == staging_path


@pytest.mark.parametrize("mount_point,volume_id,want", [
    pytest.param(f"/k/staging/{V}", V, "/k/staging", id="our-shape"),
    pytest.param("/k/staging/other", V, None, id="another-file"),
    pytest.param(f"/k/staging/{V}/x", V, None, id="below-it"),
    pytest.param(f"/k/staging/{V}x", V, None, id="longer-name"),
])
def test_block_staging_path(mount_point: str, volume_id: str, want: str | None) -> None:
    assert block_staging_path(mount_point, volume_id) == want


@pytest.mark.parametrize("staging,want", [
    pytest.param(Staging("/s", AccessType.MOUNT, "ext4"), "/s", id="file-system"),
    pytest.param(Staging("/s", AccessType.BLOCK), f"/s/{V}", id="block"),
])
def test_mount_point_of_a_stage(staging: Staging, want: str) -> None:
    assert staging.mount_point(V) == want


@pytest.mark.parametrize("have,want,same", [
    pytest.param(Publish(False, SNW, ("noatime",)), Publish(False, SNW, ("noatime",)), True,
                 id="same"),
    pytest.param(Publish(False, SNW), Publish(True, SNW), False, id="read-only-differs"),
    pytest.param(Publish(False, SNW), Publish(False, SSW), False, id="mode-differs"),
    pytest.param(Publish(False, 0), Publish(False, SSW), True, id="mode-unknown"),
    pytest.param(Publish(False, SNW, ("ro",)), Publish(False, SNW), False, id="flags-differ"),
    pytest.param(Publish(False, SNW, (), flags_known=False), Publish(False, SNW, ("x",)), True,
                 id="flags-unknown"),
])
def test_a_repeated_publish(have: Publish, want: Publish, same: bool) -> None:
    assert have.matches(want) is same


W = Publish(readonly=False, access_mode=SNW)
R = Publish(readonly=True, access_mode=SNW)
SW = Publish(readonly=False, access_mode=SSW)
SR = Publish(readonly=True, access_mode=SSW)
MW = Publish(readonly=False, access_mode=SNMW)
UNKNOWN = Publish(readonly=False, access_mode=0, flags_known=False)  # rebuilt from mountinfo


@pytest.mark.parametrize("publishes,target,want,blocker", [
    pytest.param({}, "/t", SW, None, id="first-publish"),
    pytest.param({"/a": W}, "/t", SW, "/a", id="single-writer-beside-a-writer"),
    pytest.param({"/a": SW}, "/t", W, "/a", id="writer-beside-a-single-writer"),
    pytest.param({"/a": SW}, "/t", MW, "/a", id="multi-writer-beside-a-single-writer"),
    pytest.param({"/a": UNKNOWN}, "/t", SW, "/a", id="single-writer-beside-a-rebuilt-writer"),
    pytest.param({"/a": R}, "/t", SW, None, id="single-writer-beside-a-reader"),
    pytest.param({"/a": SR}, "/t", W, None, id="writer-beside-a-single-writer-reader"),
    pytest.param({"/a": SW}, "/t", R, None, id="reader-beside-a-single-writer"),
    pytest.param({"/a": W}, "/t", W, None, id="writers-without-single-writer"),
    pytest.param({"/a": W, "/b": MW}, "/t", MW, None, id="multi-writers"),
    pytest.param({"/t": SW}, "/t", SW, None, id="the-same-target-again"),
    pytest.param({"/a": R, "/b": W}, "/t", SW, "/b", id="names-the-writer"),
])
def test_single_writer_rule(publishes: dict[str, Publish], target: str, want: Publish,
                            blocker: str | None) -> None:
    assert writer_in_the_way(publishes, target, want) == blocker
