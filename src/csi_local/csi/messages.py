"""CSI messages built from LVs, where more than one servicer sends the same
message (a snapshot: by the Controller and as a group's member)."""

from __future__ import annotations

from google.protobuf.timestamp_pb2 import Timestamp

from csi_local._gen import csi_pb2 as pb
from csi_local.storage.lvm import LogicalVolume
from csi_local.volumes import naming


def snapshot_message(lv: LogicalVolume) -> pb.Snapshot:
    src = naming.source_of(lv)
    return pb.Snapshot(
        snapshot_id=lv.name,
        source_volume_id=src.id if src else "",
        size_bytes=lv.size,
        creation_time=Timestamp(seconds=lv.created),
        ready_to_use=True,
        group_snapshot_id=naming.group_of(lv) or "",
    )
