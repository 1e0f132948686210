"""What can go wrong below the RPCs, said without any gRPC status code.

The layers below the front ends (volumes/, storage/, host/, nodestate/) raise
these. They do not know which RPC called them, so they do not choose the code:
a full thin pool is RESOURCE_EXHAUSTED for CreateVolume but OUT_OF_RANGE for
ControllerExpandVolume, and a missing volume group must never look like a
missing volume. `csi_local.csi.rpc` maps them, per RPC, in one table; the host
volume plugin reports their messages to Nomad. No grpc imports here: the
host volume plugin must start fast.
"""

from __future__ import annotations

import errno
from collections.abc import Sequence
from enum import StrEnum


class StorageError(Exception):
    """A failure of the storage layer; `message` is for people."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class CommandError(StorageError):
    """A command exited non-zero or timed out: argv, exit code and output."""

    def __init__(
        self,
        argv: Sequence[str],
        returncode: int,
        stdout: str,
        stderr: str,
        *,
        timed_out: bool = False,
    ) -> None:
        self.argv = list(argv)
        self.returncode = returncode
        self.stdout = stdout
        self.stderr = stderr
        self.timed_out = timed_out
        what = "timed out" if timed_out else f"exited {returncode}"
        detail = stderr.strip().splitlines()[-1] if stderr.strip() else ""
        super().__init__(f"{self.argv[0]} {what}: {detail}".rstrip(": "))


class SyscallError(CommandError):
    """A mount-table system call (mount(2), umount2(2)) failed: the call, its
    arguments and errno. A CommandError, so that callers treat a failed mount
    alike whether a program or the kernel said it."""

    def __init__(self, call: str, args: Sequence[str], errno_: int, strerror: str) -> None:
        super().__init__([call, *args], errno_, "", strerror)
        self.errno = errno_
        name = errno.errorcode.get(errno_, str(errno_))
        self.message = f"{call} {' '.join(args)}: {name} ({strerror})"
        self.args = (self.message,)


class VolumeGroupMissing(StorageError):
    """The configured VG or its thin pool is absent: the node cannot serve
    volumes now, and a caller must retry rather than forget anything."""


class UnknownDeviceClass(StorageError):
    """A request names a device class this node does not define, or one its
    source is not in."""


class NameTaken(StorageError):
    """A name asked for is taken by something other than what is asked for:
    a volume or snapshot of another source, size or class, or an LV that is
    none of the plugin's."""


class Difference(StrEnum):
    """What a volume that exists has other than a repeated create asks."""

    NOT_OURS = "not ours"  # no volume of the asker's, of that name
    NO_CLASS = "no class"  # in no device class of this node
    CLASS = "class"  # in another device class
    SOURCE = "source"  # made from another content source
    ENCRYPTION = "encryption"  # encrypted, or not, against the request


class VolumeDiffers(NameTaken):
    """A create names a volume that exists, and the volume differs from what
    the create asks in what never changes (`difference`); each front end
    words it (volumes/creation.py, check_repeat)."""

    def __init__(self, message: str, difference: Difference) -> None:
        super().__init__(message)
        self.difference = difference


class AmbiguousName(StorageError):
    """A name has an LV in more than one of the classes' volume groups (LVM
    keeps names unique only within one): which is the object is unknown, so
    none is met again, copied or made anew until an operator removes or
    renames the others (volumes/placement.py). `lvs`: those LVs, "VG/LV"."""

    def __init__(self, message: str, lvs: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.lvs = lvs


class SourceMismatch(StorageError):
    """A request asks that a copy of its content source (a restore or a
    clone) differ from the source where no copy can: its encryption."""


class FormatTooNew(StorageError):
    """A volume, snapshot or file of an on-disk format newer than this
    version's (docs/on-disk-format.md): made or changed by a newer csi-local,
    so its tags or fields may mean what this version cannot tell. Nothing is
    done to it; the message names both formats."""


class LvNotFound(StorageError):
    """The LV (a volume or snapshot, of either plugin) does not exist: LVM's
    "not found", mapped once, in storage/lvm.py."""


class PoolUnusable(StorageError):
    """The thin pool exists but cannot take volumes (not a thin pool)."""


class NoRoom(StorageError):
    """The thin pool has no room for what was asked."""


class NoRoomForVolumes(NoRoom):
    """No further LV fits, whatever its size: the VG's metadata area is full,
    or the thin pool has run out of device IDs."""


class SizeOutOfRange(StorageError):
    """No size meets the requested range (whole extents, a file system's
    minimum, a source's size), or the request would shrink a volume."""


class LockBusy(StorageError):
    """Another operation on the same volume or the pool holds its lock."""


class LockDirError(StorageError):
    """The lock directory or a lock file is not safely ours."""


class VolumeInUse(StorageError):
    """The device is open or mounted, so LVM will not remove it."""


class UsedDifferently(StorageError):
    """The volume is staged already, or published at the target already, but
    not as the request asks: at another staging path, with another
    capability, read-only flag or mount flags."""


class AccessTypeMismatch(StorageError):
    """A publish asks for the raw device of a volume staged as a file system,
    or for a file system where it is staged raw."""


class NotStaged(StorageError):
    """A publish names a staging path the volume is not staged at, or whose
    mount is gone (unmounted behind the plugin's back)."""


class NotAtPath(StorageError):
    """The volume is neither staged nor published at the path a request names."""


class WriterTaken(StorageError):
    """A writable publish of a single-writer volume (or beside a single-writer
    publish) while another target of the node writes to it."""


class DeviceMissing(StorageError):
    """A volume's device node did not appear (udev did not make it in time)."""


class FormatRefused(StorageError):
    """The one formatting rule said no: the device may hold data."""


class KeyMissing(StorageError):
    """An encrypted volume was to be opened or resized, and no key was given."""


class KeyRefused(StorageError):
    """The key given opens none of a LUKS2 header's keyslots."""


class EncryptionMismatch(StorageError):
    """An encrypted volume's device is not what it should be: a mapper device
    of its name over another device, or a volume tagged encrypted whose LV
    holds no LUKS2 header but was used before."""


class VolumeTooSmall(StorageError):
    """An encrypted volume's LV ends where its LUKS2 header says its data
    starts, or before: nothing fits behind the header (made too small by an
    older version; growing the volume makes room)."""


class StillMounted(StorageError):
    """Something stays mounted where it was to be unmounted."""


class MountOptionError(StorageError):
    """A mount option that is malformed or not allowed; the message names it."""


class UnsupportedFilesystem(StorageError):
    """A file system this plugin does not make, mount or grow."""


class SnapshotsNotComparable(StorageError):
    """Two snapshots whose difference was asked for are not a base and a later
    target of one volume."""


class OffsetPastEnd(StorageError):
    """A byte offset beyond the end of the volume or snapshot it is into."""


class MetadataUnavailable(StorageError):
    """A thin pool's block mappings cannot be read now: the pool is not active,
    or another program reserved the pool's one metadata snapshot."""


class MetadataSnapshotReserved(MetadataUnavailable):
    """Another program reserved the pool's one metadata snapshot (not released
    by csi-local: it is theirs); a read can be retried once they release it."""


class MappingToolsMissing(StorageError):
    """dmsetup or thin-provisioning-tools are not installed, so no block
    mappings can be read (no changed-block tracking)."""


class CannotQuiesce(StorageError):
    """Volumes cannot be snapshotted at one instant: a member cannot be held
    still (a raw block device in use, a file system that will not freeze), or
    this kernel does not let LVM snapshot a frozen file system."""


class FreezeTimeout(StorageError):
    """File systems frozen for a snapshot (a group's members, an encrypted
    source) stayed frozen for the freeze limit before every snapshot was cut:
    thawed, nothing kept; a retry can succeed."""


class OriginFrozen(StorageError):
    """LVM could not suspend a thin snapshot's origin because its file system
    is frozen (a kernel that cannot nest LVM's freeze inside another)."""


class DeviceMapperMissing(SyscallError):
    """/dev/mapper/control cannot be opened because there is no device-mapper
    here: the node is missing (a container without the host's /dev) or the
    kernel has no dm-mod. A SyscallError, so callers that already handle a
    failed system call need nothing new; its own class, so that a doctor or a
    start-up check can say what to fix."""

    def __init__(self, errno_: int, strerror: str) -> None:
        super().__init__("open(2)", ("/dev/mapper/control",), errno_, strerror)
        self.message += (": no device-mapper (load dm-mod; in a container, mount the "
                         "host's /dev)")
        self.args = (self.message,)


class DmStatusUnusable(PoolUnusable):
    """A device's device-mapper status cannot answer the question: it is not
    the target asked about (not thin, not thin-pool, no live table), the pool
    is failed ("Fail") or could not read its metadata ("Error"), or the text
    does not parse. A PoolUnusable (FAILED_PRECONDITION): the pool cannot
    vouch for the device until someone looks. Callers must take it as "not
    known", never as "empty"."""


class DmReplyMalformed(StorageError):
    """The kernel's DM_TABLE_STATUS reply does not hold together (an offset
    past its end, a string without its NUL): a bug here or in the kernel."""


class CgroupError(StorageError):
    """A workload's cgroup file could not be written: the cgroup went (its
    workload ended), or the io controller is not enabled for it. IO limits
    never fail a mount: the node logs it and reports the limit not enforced
    (docs/qos.md), so no RPC answers with it."""
