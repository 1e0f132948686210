"""The RPC edge: errors that carry a gRPC status code, and the one table that
turns storage errors into codes.

Servicers raise `RpcError`s for what only a request can be wrong about (a
missing field, a path the volume is not at). Everything below them raises
`csi_local.errors.StorageError`s, and `status_of` chooses the code here,
per RPC where the CSI spec's error tables differ. The server's interceptor
is the only caller. Codes are names, not grpc objects, so this module and
its tests need no grpc.
"""

from __future__ import annotations

from csi_local import errors


class RpcError(Exception):
    """An error with a defined CSI status code."""

    code: str = "INTERNAL"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidArgument(RpcError):
    code = "INVALID_ARGUMENT"


class NotFound(RpcError):
    code = "NOT_FOUND"


class AlreadyExists(RpcError):
    code = "ALREADY_EXISTS"


class OutOfRange(RpcError):
    code = "OUT_OF_RANGE"


class ResourceExhausted(RpcError):
    code = "RESOURCE_EXHAUSTED"


class FailedPrecondition(RpcError):
    code = "FAILED_PRECONDITION"


class Aborted(RpcError):
    code = "ABORTED"


class Unimplemented(RpcError):
    code = "UNIMPLEMENTED"


# The code of each storage error, whatever the RPC. The most specific class
# wins (the table is searched along the exception's MRO).
CODES: dict[type[errors.StorageError], str] = {
    errors.StorageError: "INTERNAL",
    errors.CommandError: "INTERNAL",
    errors.SyscallError: "INTERNAL",
    # A CO retries UNAVAILABLE and forgets nothing: a VG that is not attached
    # yet must never make a volume look deleted.
    errors.VolumeGroupMissing: "UNAVAILABLE",
    errors.LvNotFound: "NOT_FOUND",
    # CreateVolume's and CreateSnapshot's "incompatible with the name".
    errors.NameTaken: "ALREADY_EXISTS",
    errors.VolumeDiffers: "ALREADY_EXISTS",
    errors.UnknownDeviceClass: "INVALID_ARGUMENT",
    # Two LVs of one name in the classes' VGs: no retry helps until an
    # operator removes or renames one, and the request is not at fault.
    errors.AmbiguousName: "FAILED_PRECONDITION",
    errors.SourceMismatch: "INVALID_ARGUMENT",
    # A newer csi-local's volume or snapshot: nothing is wrong with the
    # request, and no retry of it succeeds until the plugin is upgraded.
    errors.FormatTooNew: "FAILED_PRECONDITION",
    errors.PoolUnusable: "FAILED_PRECONDITION",
    errors.NoRoom: "RESOURCE_EXHAUSTED",
    # CreateVolume's and CreateSnapshot's "unable to provision": the node's
    # room for another LV is gone, whatever its size.
    errors.NoRoomForVolumes: "RESOURCE_EXHAUSTED",
    errors.SizeOutOfRange: "OUT_OF_RANGE",
    errors.LockBusy: "ABORTED",  # the spec's "operation pending for volume"
    errors.LockDirError: "FAILED_PRECONDITION",
    errors.VolumeInUse: "FAILED_PRECONDITION",
    # The node's records against a request: NodeStageVolume's and
    # NodePublishVolume's "volume ... is incompatible" (ALREADY_EXISTS); a
    # publish before its stage, or of a capability the stage was not, is the
    # CO's order or argument at fault (FAILED_PRECONDITION, INVALID_ARGUMENT);
    # NodeUnstageVolume, NodeGetVolumeStats and NodeExpandVolume name a path
    # the volume is not at: their "volume does not exist" (NOT_FOUND).
    errors.UsedDifferently: "ALREADY_EXISTS",
    errors.AccessTypeMismatch: "INVALID_ARGUMENT",
    errors.NotStaged: "FAILED_PRECONDITION",
    errors.NotAtPath: "NOT_FOUND",
    # NodePublishVolume's "exceeds capabilities": the volume has one writer.
    errors.WriterTaken: "FAILED_PRECONDITION",
    errors.DeviceMissing: "FAILED_PRECONDITION",
    errors.FormatRefused: "FAILED_PRECONDITION",
    errors.StillMounted: "FAILED_PRECONDITION",
    # The spec's "Missing required field": the node-stage (or node-expand)
    # secret with the volume's key. Kubelet passes it only when the
    # StorageClass names the secret.
    errors.KeyMissing: "INVALID_ARGUMENT",
    # The spec's general table: "The invoked RPC does not carry secrets that
    # are valid for authentication"; the caller fixes the secret and retries.
    # Not FAILED_PRECONDITION (nothing is wrong with the volume, which is left
    # untouched) nor INVALID_ARGUMENT (the request is well formed; only its
    # secret's value is wrong).
    errors.KeyRefused: "UNAUTHENTICATED",
    errors.EncryptionMismatch: "FAILED_PRECONDITION",
    # Nothing a retry changes: the volume must grow first.
    errors.VolumeTooSmall: "FAILED_PRECONDITION",
    errors.MountOptionError: "INVALID_ARGUMENT",
    errors.UnsupportedFilesystem: "INVALID_ARGUMENT",
    errors.SnapshotsNotComparable: "INVALID_ARGUMENT",
    errors.OffsetPastEnd: "OUT_OF_RANGE",
    # Retry later: the pool comes up, the other program releases its snapshot.
    errors.MetadataUnavailable: "UNAVAILABLE",
    # Another program's metadata snapshot (never released by csi-local): the
    # spec's tables have no row for it; it passes when they are done, so a
    # retry, not a full backup (FAILED_PRECONDITION would say CBT is off).
    errors.MetadataSnapshotReserved: "UNAVAILABLE",
    # GetMetadataDelta's "changed block tracking is not enabled": back up in full.
    errors.MappingToolsMissing: "FAILED_PRECONDITION",
    # CreateVolumeGroupSnapshot's "cannot snapshot multiple volumes together".
    errors.CannotQuiesce: "FAILED_PRECONDITION",
    errors.OriginFrozen: "FAILED_PRECONDITION",
    # A freeze past its limit (volumes/freezes.py), in CreateVolumeGroupSnapshot,
    # CreateSnapshot or a clone's CreateVolume. Not in their tables: nothing is
    # wrong with the volumes (FAILED_PRECONDITION would tell the CO to fix them) nor with the
    # room (RESOURCE_EXHAUSTED); LVM was slow for a while, nothing was kept,
    # and the same call can succeed: gRPC's "retry the failing call" code.
    errors.FreezeTimeout: "UNAVAILABLE",
    # The node cannot ask the kernel: fixed by loading dm-mod or mounting /dev.
    errors.DeviceMapperMissing: "FAILED_PRECONDITION",
    errors.DmStatusUnusable: "FAILED_PRECONDITION",
    errors.DmReplyMalformed: "INTERNAL",
    # Caught below the RPCs (IO limits never fail a publish): INTERNAL if one
    # ever got this far.
    errors.CgroupError: "INTERNAL",
}

# Where an RPC's error table says otherwise.
PER_RPC: dict[tuple[str, type[errors.StorageError]], str] = {
    # The expansion tables have no RESOURCE_EXHAUSTED: a capacity the plugin
    # cannot give is "Unsupported capacity", OUT_OF_RANGE.
    ("ControllerExpandVolume", errors.NoRoom): "OUT_OF_RANGE",
    ("NodeExpandVolume", errors.NoRoom): "OUT_OF_RANGE",
}


def status_of(method: str, err: Exception) -> tuple[str, str]:
    """(code name, message) for an error raised by RPC `method`; INTERNAL for
    anything that is neither an RpcError nor a StorageError."""
    if isinstance(err, RpcError):
        return err.code, err.message
    if isinstance(err, errors.StorageError):
        for cls in type(err).__mro__:
            if not (isinstance(cls, type) and issubclass(cls, errors.StorageError)):
                continue
            code = PER_RPC.get((method, cls)) or CODES.get(cls)
            if code is not None:
                return code, err.message
    return "INTERNAL", f"internal error: {err}"
