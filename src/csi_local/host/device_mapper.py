"""Facts from the kernel's device-mapper, asked by ioctl on /dev/mapper/control.

`dmsetup info` and `dmsetup status` each cost a process: 100-300 ms in the
emulated test VM, for an answer the kernel gives in one ioctl of a few
milliseconds. This module makes those ioctls itself (DM_DEV_STATUS,
DM_TABLE_STATUS and DM_LIST_DEVICES, the ones dmsetup makes), with no
process and no shell, and
parses the status lines of the two targets the plugin reads: a thin
device's mapped sectors and a thin pool's usage.

The byte layout (struct dm_ioctl and struct dm_target_spec) and the status
grammars are pure functions, so the unit tests can feed them fabricated
replies; only `_ioctl` touches the kernel.

Device names are the caller's: which device LVM makes of an LV, and how it
stacks a thin pool, is storage/lv_devices.py's (this module knows nothing of
LVM).

Thread safety: no state is shared between calls. Each call opens
/dev/mapper/control (O_CLOEXEC) and closes it again: the open is a few
microseconds against a millisecond ioctl, and a per-call descriptor needs no
lock, can never leak into a forked child that does not exec, and follows
/dev being remounted under a container. Request buffers are per call too.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import struct
from dataclasses import dataclass

from csi_local.errors import (
    DeviceMapperMissing,
    DmReplyMalformed,
    DmStatusUnusable,
    SyscallError,
)

CONTROL = "/dev/mapper/control"  # errors.DeviceMapperMissing names it too

# linux/dm-ioctl.h, struct dm_ioctl: version[3], data_size, data_start,
# target_count, open_count (signed), flags, event_nr, padding, dev (u64),
# name[128], uuid[129], data[7]. Native byte order: the kernel's own.
_HEADER = struct.Struct("=3I I I I i I I I Q 128s 129s 7s")
# struct dm_target_spec: sector_start, length, status (signed), next,
# target_type[16]; the target's status text follows it, NUL-terminated.
_SPEC = struct.Struct("=Q Q i I 16s")
HEADER_SIZE = _HEADER.size  # 312
SPEC_SIZE = _SPEC.size  # 40
# The kernel's ABI: a wrong format string fails at import, not in a call.
assert HEADER_SIZE == 312 and SPEC_SIZE == 40

DM_NAME_LEN = 128  # with its NUL: names are at most 127 bytes
# The interface version asked for. The kernel refuses another major, or a
# minor newer than its own, and writes its own version back; both calls here
# are as old as version 4.0.
_VERSION = (4, 0, 0)


def _iowr(nr: int, size: int) -> int:
    """_IOWR(DM_IOCTL = 0xfd, nr, struct dm_ioctl): direction read|write (3)."""
    return (3 << 30) | (size << 16) | (0xFD << 8) | nr


# The command numbers of linux/dm-ioctl.h's enum: DM_VERSION_CMD is 0,
# DM_REMOVE_ALL_CMD 1, DM_LIST_DEVICES_CMD 2 (3 would create a device).
DM_LIST_DEVICES = _iowr(2, HEADER_SIZE)
DM_DEV_STATUS = _iowr(7, HEADER_SIZE)
DM_TABLE_STATUS = _iowr(12, HEADER_SIZE)

# Flags (dm-ioctl.h).
DM_SUSPEND_FLAG = 1 << 1
DM_ACTIVE_PRESENT_FLAG = 1 << 5
DM_BUFFER_FULL_FLAG = 1 << 8

# A status reply starts small (a thin target's status is a few dozen bytes)
# and grows when the kernel says it ran out of room; the cap stops a loop on a
# kernel that keeps saying so.
FIRST_STATUS_SIZE = 4096
MAX_STATUS_SIZE = 16 << 20
# A list of every device: about 150 bytes each (name, event number, UUID).
FIRST_LIST_SIZE = 64 << 10
# struct dm_name_list: dev (u64), next (u32), then the name, NUL-terminated.
_NAME_LIST = struct.Struct("=Q I")


@dataclass(frozen=True)
class DmDevice:
    """What DM_DEV_STATUS says of a device-mapper device."""

    major: int
    minor: int
    open_count: int
    live: bool  # a live table is loaded (DM_ACTIVE_PRESENT_FLAG)
    suspended: bool  # suspended by request (dmsetup suspend), not internally


@dataclass(frozen=True)
class Target:
    """One target of a device's live table: its sectors, type and status text."""

    start: int
    length: int
    target_type: str
    params: str


@dataclass(frozen=True)
class PoolUsage:
    """A thin-pool target's status. Blocks: metadata blocks are 4 KiB; data
    blocks are the pool's chunk size."""

    transaction_id: int
    metadata_used: int
    metadata_total: int
    data_used: int
    data_total: int
    read_only: bool  # "ro": metadata trouble or out of metadata space
    out_of_data_space: bool
    needs_check: bool
    # A metadata snapshot is held (a reader such as thin_dump reserved one).
    metadata_snapshot_held: bool = False
    # Its root block in the metadata device (None: none held). It tells one
    # reservation from another: csi-local releases only the one it recorded.
    metadata_snapshot_root: int | None = None


@dataclass(frozen=True)
class Header:
    """The fields of a struct dm_ioctl reply this module reads."""

    version: tuple[int, int, int]
    data_size: int
    data_start: int
    target_count: int
    open_count: int
    flags: int
    dev: int


def _encode_name(name: str) -> bytes:
    """`name` as the kernel's name field takes it. ValueError for what cannot
    be a device-mapper name: the kernel would refuse an empty one (EINVAL) and
    silently cut a long one to 127 bytes, which could find another device."""
    raw = name.encode()
    if not raw or len(raw) >= DM_NAME_LEN or b"\0" in raw or b"/" in raw:
        raise ValueError(f"not a device-mapper name: {name!r}")
    return raw


def pack_request(name: str | None, size: int = HEADER_SIZE, flags: int = 0) -> bytearray:
    """A zeroed buffer of `size` bytes that starts with the struct dm_ioctl of
    a request for device `name` (None: a request about no one device, as a
    list): version 4.0.0, data_size `size` (how much the kernel may write
    back), data_start just past the header."""
    if size < HEADER_SIZE:
        raise ValueError(f"a device-mapper request needs at least {HEADER_SIZE} bytes")
    buf = bytearray(size)
    _HEADER.pack_into(buf, 0, *_VERSION, size, HEADER_SIZE, 0, 0, flags, 0, 0, 0,
                      b"" if name is None else _encode_name(name), b"", b"")
    return buf


def unpack_header(reply: bytes | bytearray) -> Header:
    """The struct dm_ioctl at the start of a reply."""
    if len(reply) < HEADER_SIZE:
        raise DmReplyMalformed(f"device-mapper reply of {len(reply)} bytes, "
                               f"shorter than its {HEADER_SIZE}-byte header")
    (v0, v1, v2, data_size, data_start, target_count, open_count, flags, _event_nr,
     _padding, dev, _name, _uuid, _data) = _HEADER.unpack_from(reply, 0)
    return Header((v0, v1, v2), data_size, data_start, target_count, open_count, flags, dev)


def device_from_reply(reply: bytes | bytearray) -> DmDevice:
    """The DmDevice of a DM_DEV_STATUS (or DM_TABLE_STATUS) reply. `dev` is
    the kernel's huge_encode_dev, which glibc's major()/minor() decode."""
    h = unpack_header(reply)
    return DmDevice(major=os.major(h.dev), minor=os.minor(h.dev), open_count=h.open_count,
                    live=bool(h.flags & DM_ACTIVE_PRESENT_FLAG),
                    suspended=bool(h.flags & DM_SUSPEND_FLAG))


def _c_string(reply: bytes | bytearray, start: int, end: int, what: str) -> str:
    nul = reply.find(b"\0", start, end)
    if nul < 0:
        raise DmReplyMalformed(f"device-mapper reply: {what} has no NUL before byte {end}")
    return bytes(reply[start:nul]).decode(errors="replace")


def unpack_targets(reply: bytes | bytearray) -> list[Target] | None:
    """The targets of a DM_TABLE_STATUS reply, in table order; None when the
    kernel ran out of room (DM_BUFFER_FULL_FLAG): ask again with more.

    The specs follow the header from data_start; each one's `next` counts
    from data_start (not from the spec itself, as in a table load) to the
    following spec, and its status text follows it up to a NUL. A device
    without a live table has no targets: []."""
    h = unpack_header(reply)
    if h.flags & DM_BUFFER_FULL_FLAG:
        return None
    end = min(len(reply), h.data_size)
    targets: list[Target] = []
    offset = h.data_start
    for i in range(h.target_count):
        if offset < HEADER_SIZE or offset + SPEC_SIZE > end:
            raise DmReplyMalformed(f"device-mapper reply: target {i} at byte {offset} "
                                   f"is outside the reply's {end} bytes")
        start, length, _status, next_, ttype = _SPEC.unpack_from(reply, offset)
        params = _c_string(reply, offset + SPEC_SIZE, end, f"target {i}'s status")
        targets.append(Target(start, length, ttype.split(b"\0", 1)[0].decode(errors="replace"),
                              params))
        following = h.data_start + next_
        if i + 1 < h.target_count and following <= offset:
            # A `next` that does not move on would read one spec twice.
            raise DmReplyMalformed(f"device-mapper reply: target {i}'s next ({next_}) "
                                   "does not lead past it")
        offset = following
    return targets


def unpack_names(reply: bytes | bytearray) -> dict[str, tuple[int, int]] | None:
    """{name: (major, minor)} of every device in a DM_LIST_DEVICES reply;
    None when the kernel ran out of room (DM_BUFFER_FULL_FLAG).

    The entries follow the header from data_start; each one's `next` counts
    from the entry itself to the following one, 0 on the last. A first entry
    with dev 0 means there is no device at all."""
    h = unpack_header(reply)
    if h.flags & DM_BUFFER_FULL_FLAG:
        return None
    end = min(len(reply), h.data_size)
    names: dict[str, tuple[int, int]] = {}
    offset = h.data_start
    while True:
        if offset < HEADER_SIZE or offset + _NAME_LIST.size > end:
            raise DmReplyMalformed(f"device-mapper list: an entry at byte {offset} is "
                                   f"outside the reply's {end} bytes")
        dev, next_ = _NAME_LIST.unpack_from(reply, offset)
        if dev == 0 and not names:
            return names  # no device-mapper device at all
        name = _c_string(reply, offset + _NAME_LIST.size, end, "a device's name")
        names[name] = (os.major(dev), os.minor(dev))
        if next_ == 0:
            return names
        if next_ < _NAME_LIST.size + len(name) + 1:
            raise DmReplyMalformed(f"device-mapper list: {name!r}'s next ({next_}) "
                                   "does not lead past it")
        offset += next_


def next_status_size(size: int) -> int:
    """The buffer to try after a reply of `size` bytes came back full."""
    bigger = size * 4
    if bigger > MAX_STATUS_SIZE:
        raise DmReplyMalformed(f"device-mapper status still full at {size} bytes")
    return bigger


# What a thin target and a thin-pool target say in place of their status
# when the pool has failed (PM_FAIL) or a metadata read failed.
_FAILED = ("Fail", "Error")
_COUNT = re.compile(r"0|[1-9][0-9]*")  # what %llu prints: no sign, no leading zero


def _count(text: str) -> int | None:
    return int(text) if _COUNT.fullmatch(text) else None


def parse_thin_status(params: str) -> int:
    """Mapped sectors, from a thin target's status "<mapped sectors>
    <highest mapped sector>" ("-" for the highest when nothing is mapped).

    0 only for exactly "0 -": callers take it to mean the volume holds no
    data at all, so anything else that is not two consistent numbers raises
    DmStatusUnusable ("Fail", "Error", a lone "-" for a device the pool has
    not opened, "0 17", "5 -", garbage)."""
    fields = params.split()
    if params.strip() in _FAILED:
        raise DmStatusUnusable(f"thin device status says {params.strip()!r}: the pool has "
                               "failed or cannot read its metadata")
    if len(fields) != 2:
        raise DmStatusUnusable(f"thin device status {params!r} is not "
                               "'<mapped sectors> <highest mapped sector>'")
    mapped, highest = _count(fields[0]), fields[1]
    if mapped is None or not (highest == "-" or _count(highest) is not None):
        raise DmStatusUnusable(f"thin device status {params!r} does not parse")
    # Nothing mapped has no highest sector, and the reverse: a status that
    # says otherwise is not trusted either way.
    if (mapped == 0) != (highest == "-"):
        raise DmStatusUnusable(f"thin device status {params!r} contradicts itself")
    return mapped


_POOL_MODES = {"rw": (False, False), "ro": (True, False), "out_of_data_space": (False, True)}
_DISCARD = ("discard_passdown", "no_discard_passdown", "ignore_discard")
_NO_SPACE = ("error_if_no_space", "queue_if_no_space")
_NEEDS_CHECK = {"needs_check": True, "-": False}


def _fraction(text: str) -> tuple[int, int] | None:
    used, sep, total = text.partition("/")
    u, t = _count(used), _count(total)
    if not sep or u is None or t is None or t == 0 or u > t:
        return None
    return u, t


def parse_thin_pool_status(params: str) -> PoolUsage:
    """A thin-pool target's status (Documentation/admin-guide/device-mapper/
    thin-provisioning.rst): "<transaction id> <used>/<total metadata blocks>
    <used>/<total data blocks> <held metadata root>|- ro|rw|out_of_data_space
    [no_]discard_passdown|ignore_discard error|queue_if_no_space
    needs_check|- [metadata_low_watermark ...]". Fields after the eighth
    (6.1 adds the low watermark) are not read. DmStatusUnusable for "Fail",
    "Error" and anything that does not parse."""
    if params.strip() in _FAILED:
        raise DmStatusUnusable(f"thin pool status says {params.strip()!r}: the pool has "
                               "failed or cannot read its metadata")
    fields = params.split()
    if len(fields) < 8:
        raise DmStatusUnusable(f"thin pool status {params!r} has fewer than 8 fields")
    tid, meta, data = _count(fields[0]), _fraction(fields[1]), _fraction(fields[2])
    held_ok = fields[3] == "-" or _count(fields[3]) is not None
    mode = _POOL_MODES.get(fields[4])
    needs_check = _NEEDS_CHECK.get(fields[7])
    if (tid is None or meta is None or data is None or not held_ok or mode is None
            or fields[5] not in _DISCARD or fields[6] not in _NO_SPACE or needs_check is None):
        raise DmStatusUnusable(f"thin pool status {params!r} does not parse")
    return PoolUsage(transaction_id=tid, metadata_used=meta[0], metadata_total=meta[1],
                     data_used=data[0], data_total=data[1], read_only=mode[0],
                     out_of_data_space=mode[1], needs_check=needs_check,
                     metadata_snapshot_held=fields[3] != "-",
                     metadata_snapshot_root=_count(fields[3]))


def single_target(name: str, targets: list[Target], target_type: str) -> Target:
    """The one target of `name`'s live table, which must be of `target_type`."""
    if len(targets) != 1 or targets[0].target_type != target_type:
        found = ", ".join(t.target_type for t in targets) or "no live table"
        raise DmStatusUnusable(f"device-mapper device {name} is not a single {target_type} "
                               f"target ({found})")
    return targets[0]


# The kernel calls.

def _open_control() -> int:
    try:
        return os.open(CONTROL, os.O_RDWR | os.O_CLOEXEC)
    except OSError as err:
        code = err.errno or 0
        if code in (errno.ENOENT, errno.ENODEV, errno.ENXIO):
            raise DeviceMapperMissing(code, os.strerror(code)) from None
        raise SyscallError("open(2)", (CONTROL,), code, os.strerror(code)) from None


def _ioctl(request: int, call: str, name: str, buf: bytearray) -> bool:
    """ioctl `request` on the control device with `buf` (written back in
    place); False when there is no device `name` (ENXIO), SyscallError for
    any other failure (EACCES without CAP_SYS_ADMIN, for one)."""
    fd = _open_control()
    try:
        fcntl.ioctl(fd, request, buf, True)
    except OSError as err:
        if err.errno == errno.ENXIO:
            return False
        code = err.errno or 0
        raise SyscallError(f"ioctl(2) {call}", (name,), code, os.strerror(code)) from None
    finally:
        os.close(fd)
    return True


def device(name: str) -> DmDevice | None:
    """DM_DEV_STATUS of device `name`: None when there is none.
    DeviceMapperMissing when this host has no device-mapper."""
    buf = pack_request(name)
    if not _ioctl(DM_DEV_STATUS, "DM_DEV_STATUS", name, buf):
        return None
    return device_from_reply(buf)


def devices() -> dict[str, tuple[int, int]]:
    """{name: (major, minor)} of every device-mapper device (what `dmsetup
    ls` prints), in one ioctl: an active LV is one of them."""
    size = FIRST_LIST_SIZE
    while True:
        buf = pack_request(None, size)
        if not _ioctl(DM_LIST_DEVICES, "DM_LIST_DEVICES", "", buf):
            raise DmReplyMalformed("device-mapper: DM_LIST_DEVICES found no device list")
        names = unpack_names(buf)
        if names is not None:
            return names
        size = next_status_size(size)


def status(name: str) -> list[Target] | None:
    """DM_TABLE_STATUS of device `name`: each live target and its status text
    (what `dmsetup status` prints); [] when no table is live, None when there
    is no such device."""
    size = FIRST_STATUS_SIZE
    while True:
        buf = pack_request(name, size)
        if not _ioctl(DM_TABLE_STATUS, "DM_TABLE_STATUS", name, buf):
            return None
        targets = unpack_targets(buf)
        if targets is not None:
            return targets
        size = next_status_size(size)
