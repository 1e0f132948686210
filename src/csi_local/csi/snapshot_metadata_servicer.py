"""CSI SnapshotMetadata service: changed-block tracking for backup tools.

GetMetadataAllocated streams the byte ranges of a snapshot that hold data;
GetMetadataDelta the ranges where a later snapshot of the same volume
differs from a base one. The ranges are read whole (the pool's metadata
snapshot is held only for that; the tool's output is merged as it is
printed and the runs kept as machine integers, 16 bytes each) and then
streamed, `max_results` a message, each message made as it is sent, so a
slow reader never keeps the pool's metadata snapshot held.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TypeVar

import grpc

from csi_local._gen import csi_pb2 as pb
from csi_local._gen import csi_pb2_grpc
from csi_local.csi.rpc import InvalidArgument, OutOfRange
from csi_local.volumes.changed_blocks import BlockMap, ChangedBlocks

# Tuples per message when the caller leaves max_results 0: ~16 KiB messages,
# far below gRPC's 4 MiB limit, few enough messages for a large delta.
DEFAULT_MAX_RESULTS = 1024
Reply = TypeVar("Reply", pb.GetMetadataAllocatedResponse, pb.GetMetadataDeltaResponse)


def _check(starting_offset: int, max_results: int) -> None:
    # The error tables: a negative offset is OUT_OF_RANGE ("negative or exceeds
    # the volume size"); max_results is an int32 with no table entry, so a
    # negative one is an invalid argument.
    if starting_offset < 0:
        raise OutOfRange(f"starting_offset {starting_offset} is negative")
    if max_results < 0:
        raise InvalidArgument(f"max_results {max_results} is negative")


def _stream(blocks: BlockMap, starting_offset: int, max_results: int,
            reply: type[Reply]) -> Iterator[Reply]:
    """The replies: the volume's capacity in each, VARIABLE_LENGTH extents from
    `starting_offset` (not past the end: ChangedBlocks checked), at most
    `max_results` per message; none left is one message with no extents."""
    def message(batch: list[pb.BlockMetadata]) -> Reply:
        return reply(block_metadata_type=pb.VARIABLE_LENGTH,
                     volume_capacity_bytes=blocks.capacity, block_metadata=batch)

    per_message = max_results or DEFAULT_MAX_RESULTS
    batch: list[pb.BlockMetadata] = []
    sent = False
    for e in blocks.starting_at(starting_offset):  # made as they are sent: none held
        batch.append(pb.BlockMetadata(byte_offset=e.offset, size_bytes=e.length))
        if len(batch) == per_message:
            yield message(batch)
            batch, sent = [], True
    if batch or not sent:
        yield message(batch)


class SnapshotMetadataServicer(csi_pb2_grpc.SnapshotMetadataServicer):
    def __init__(self, changed: ChangedBlocks) -> None:
        self.changed = changed

    def GetMetadataAllocated(self, request: pb.GetMetadataAllocatedRequest,
                             context: grpc.ServicerContext
                             ) -> Iterator[pb.GetMetadataAllocatedResponse]:
        if not request.snapshot_id:
            raise InvalidArgument("snapshot_id is required")
        _check(request.starting_offset, request.max_results)
        blocks = self.changed.allocated(request.snapshot_id, request.starting_offset)
        yield from _stream(blocks, request.starting_offset, request.max_results,
                           pb.GetMetadataAllocatedResponse)

    def GetMetadataDelta(self, request: pb.GetMetadataDeltaRequest,
                         context: grpc.ServicerContext
                         ) -> Iterator[pb.GetMetadataDeltaResponse]:
        if not request.base_snapshot_id:
            raise InvalidArgument("base_snapshot_id is required")
        if not request.target_snapshot_id:
            raise InvalidArgument("target_snapshot_id is required")
        _check(request.starting_offset, request.max_results)
        blocks = self.changed.delta(request.base_snapshot_id, request.target_snapshot_id,
                                   request.starting_offset)
        yield from _stream(blocks, request.starting_offset, request.max_results,
                           pb.GetMetadataDeltaResponse)
