"""The device-mapper ioctl layer without a kernel: the request bytes, replies
fabricated the way drivers/md/dm-ioctl.c lays them out, and the status
grammars of the thin and thin-pool targets; and, over it through the Kernel,
storage/lv_devices.py, which finds an LV's devices as LVM names and stacks
them. (The ioctls themselves are proven against real LVM in
tests/integration/test_device_mapper.py.)"""

from __future__ import annotations

import errno
import fcntl
import os
import struct
from collections.abc import Callable, Sequence

import pytest

from csi_local.errors import (
    DeviceMapperMissing,
    DmReplyMalformed,
    DmStatusUnusable,
    PoolUnusable,
    SyscallError,
)
from csi_local.host import device_mapper as dm
from csi_local.host.device_mapper import (
    DM_ACTIVE_PRESENT_FLAG,
    DM_BUFFER_FULL_FLAG,
    DM_SUSPEND_FLAG,
    HEADER_SIZE,
    DmDevice,
    PoolUsage,
    Target,
)
from csi_local.host.kernel import Kernel
from csi_local.storage import lv_devices

HEADER = struct.Struct("=3I I I I i I I I Q 128s 129s 7s")
SPEC = struct.Struct("=Q Q i I 16s")


def huge_encode_dev(major: int, minor: int) -> int:
    """The kernel's encoding of dev_t in struct dm_ioctl (new_encode_dev)."""
    return (minor & 0xFF) | (major << 8) | ((minor & ~0xFF) << 12)


def reply(size: int = 4096, *, targets: Sequence[tuple[int, int, str, str]] = (),
          flags: int = DM_ACTIVE_PRESENT_FLAG, open_count: int = 0,
          dev: int = huge_encode_dev(254, 4), name: bytes = b"vg-lv") -> bytearray:
    """A reply as the kernel writes it: the header, then from data_start (the
    header's size rounded up to 8) each target spec and its NUL-terminated
    status, the next spec 8-aligned, `next` counted from data_start, and
    data_size cut to the end of the last string."""
    buf = bytearray(size)
    data_start = (HEADER_SIZE + 7) & ~7
    offset = data_start
    used = 0
    for start, length, ttype, params in targets:
        text = params.encode() + b"\0"
        end = offset + SPEC.size + len(text)
        following = (end + 7) & ~7
        SPEC.pack_into(buf, offset, start, length, 0, following - data_start, ttype.encode())
        buf[offset + SPEC.size:end] = text
        used = end
        offset = following
    HEADER.pack_into(buf, 0, 4, 48, 0, used or size, data_start, len(targets), open_count,
                     flags, 0, 0, dev, name, b"", b"")
    return buf


# Names.

@pytest.mark.parametrize(("vg", "lv", "expected"), [
    ("vg", "lv", "vg-lv"),
    ("vg-x", "po-ol", "vg--x-po--ol"),
    ("a--b", "c", "a----b-c"),
    ("csitest1", "pvc-1a2b", "csitest1-pvc--1a2b"),
    ("vg", "pool-tpool", "vg-pool--tpool"),
])
def test_dm_name(vg: str, lv: str, expected: str) -> None:
    assert lv_devices.dm_name(vg, lv) == expected


# Requests.

def test_ioctl_numbers_are_iowr_0xfd_of_the_312_byte_header() -> None:
    assert HEADER_SIZE == 312
    assert dm.DM_LIST_DEVICES == 0xC138FD02  # `dmsetup ls` asks it (strace names it)
    assert dm.DM_DEV_STATUS == 0xC138FD07
    assert dm.DM_TABLE_STATUS == 0xC138FD0C


@pytest.mark.parametrize(("size", "flags"), [(HEADER_SIZE, 0), (4096, 0), (16384, 1 << 11)])
def test_pack_request(size: int, flags: int) -> None:
    buf = dm.pack_request("vg--x-po--ol", size, flags)
    assert len(buf) == size
    fields = HEADER.unpack_from(buf, 0)
    assert fields[0:3] == (4, 0, 0)
    assert (fields[3], fields[4]) == (size, HEADER_SIZE)  # data_size, data_start
    assert fields[5:7] == (0, 0) and fields[7] == flags and fields[8:11] == (0, 0, 0)
    assert fields[11].rstrip(b"\0") == b"vg--x-po--ol" and fields[11][-1] == 0
    assert fields[12] == bytes(129)  # no uuid: the kernel wants a name or a uuid, not both
    assert not any(buf[HEADER_SIZE:])


def test_a_127_byte_name_fits() -> None:
    name = "n" * 127
    assert HEADER.unpack_from(dm.pack_request(name), 0)[11] == name.encode() + b"\0"


@pytest.mark.parametrize("name", ["", "n" * 128, "a\0b", "vg/lv", "é" * 64])
def test_names_that_cannot_be_device_mapper_names_are_refused(name: str) -> None:
    # The kernel would cut a long name to 127 bytes and maybe find another device.
    with pytest.raises(ValueError, match="not a device-mapper name"):
        dm.pack_request(name)


def test_a_request_smaller_than_the_header_is_refused() -> None:
    with pytest.raises(ValueError):
        dm.pack_request("vg-lv", HEADER_SIZE - 1)


# Replies: the device.

@pytest.mark.parametrize(("flags", "live", "suspended"), [
    (DM_ACTIVE_PRESENT_FLAG, True, False),
    (DM_ACTIVE_PRESENT_FLAG | DM_SUSPEND_FLAG, True, True),
    (0, False, False),  # created, no table loaded (or only an inactive one)
    (DM_SUSPEND_FLAG, False, True),
    (DM_ACTIVE_PRESENT_FLAG | (1 << 18) | (1 << 0), True, False),  # internal suspend, read-only
])
def test_device_from_reply_flags(flags: int, live: bool, suspended: bool) -> None:
    got = dm.device_from_reply(reply(HEADER_SIZE, flags=flags, open_count=2))
    assert got == DmDevice(major=254, minor=4, open_count=2, live=live, suspended=suspended)


@pytest.mark.parametrize(("major", "minor"), [(254, 0), (253, 255), (254, 256), (259, 1048575),
                                              (4095, 70000)])
def test_device_numbers_decode_the_kernels_encoding(major: int, minor: int) -> None:
    got = dm.device_from_reply(reply(HEADER_SIZE, dev=huge_encode_dev(major, minor)))
    assert (got.major, got.minor) == (major, minor)


def test_a_short_reply_is_malformed() -> None:
    with pytest.raises(DmReplyMalformed):
        dm.unpack_header(bytes(HEADER_SIZE - 1))


# Replies: the targets.

@pytest.mark.parametrize("targets", [
    pytest.param([(0, 131072, "thin", "6144 6143")], id="one-thin"),
    pytest.param([(0, 1048576, "thin-pool",
                   "1 112/1024 48/8192 - rw discard_passdown queue_if_no_space - 256 ")],
                 id="one-thin-pool"),
    pytest.param([(0, 1048576, "linear", "")], id="empty-status"),
    pytest.param([(0, 2048, "linear", ""), (2048, 8, "zero", ""),
                  (2056, 100, "thin", "0 -"), (2156, 1 << 40, "error", "x" * 300)],
                 id="several-unaligned"),
    pytest.param([], id="no-live-table"),
])
def test_unpack_targets(targets: list[tuple[int, int, str, str]]) -> None:
    assert dm.unpack_targets(reply(targets=targets)) == [Target(*t) for t in targets]


def test_a_full_buffer_means_ask_again() -> None:
    full = reply(targets=[(0, 8, "thin", "")], flags=DM_ACTIVE_PRESENT_FLAG | DM_BUFFER_FULL_FLAG)
    assert dm.unpack_targets(full) is None


def test_the_buffer_grows_to_a_limit() -> None:
    assert dm.next_status_size(4096) == 16384
    with pytest.raises(DmReplyMalformed):
        dm.next_status_size(dm.MAX_STATUS_SIZE)


def test_a_type_name_of_all_16_bytes_is_read() -> None:
    got = dm.unpack_targets(reply(targets=[(0, 8, "x" * 16, "ok")]))
    assert got == [Target(0, 8, "x" * 16, "ok")]


def test_a_status_without_its_nul_is_malformed() -> None:
    buf = reply(targets=[(0, 8, "thin", "0 -")])
    struct.pack_into("=I", buf, 12, HEADER_SIZE + SPEC.size + 2)  # data_size cuts "0 -"
    with pytest.raises(DmReplyMalformed, match="NUL"):
        dm.unpack_targets(buf)


def test_a_target_past_the_end_is_malformed() -> None:
    buf = reply(targets=[(0, 8, "thin", "0 -")])
    struct.pack_into("=I", buf, 20, 2)  # target_count 2, one spec written
    with pytest.raises(DmReplyMalformed):
        dm.unpack_targets(buf)


def test_a_next_that_does_not_move_on_is_malformed() -> None:
    buf = reply(targets=[(0, 8, "zero", ""), (8, 8, "zero", "")])
    struct.pack_into("=I", buf, HEADER_SIZE + 20, 0)  # the first spec's next
    with pytest.raises(DmReplyMalformed, match="next"):
        dm.unpack_targets(buf)


# Replies: the device list.

def name_list(devices: Sequence[tuple[str, int, int]], size: int = 4096,
              flags: int = 0) -> bytearray:
    """A DM_LIST_DEVICES reply as dm-ioctl.c's list_devices writes it: from
    data_start, each struct dm_name_list (dev, next, the name and its NUL),
    then the event number and the UUID, the next entry 8-aligned, `next`
    counted from the entry itself; a first dev of 0 when there is none."""
    buf = bytearray(size)
    data_start = (HEADER_SIZE + 7) & ~7
    offset = data_start
    previous = None
    for name, major, minor in devices:
        if previous is not None:
            struct.pack_into("=I", buf, previous + 8, offset - previous)
        struct.pack_into("=Q I", buf, offset, huge_encode_dev(major, minor), 0)
        text = name.encode() + b"\0"
        buf[offset + 12:offset + 12 + len(text)] = text
        event = (offset + 12 + len(text) + 7) & ~7
        struct.pack_into("=I I", buf, event, 3, 1)  # event_nr, then a flag: a UUID follows
        uuid = b"LVM-" + name.encode()[:60] + b"\0"
        buf[event + 8:event + 8 + len(uuid)] = uuid
        previous, offset = offset, (event + 8 + len(uuid) + 7) & ~7
    HEADER.pack_into(buf, 0, 4, 48, 0, max(offset, data_start + 16), data_start, 0, 0,
                     flags, 0, 0, 0, b"", b"", b"")
    return buf


@pytest.mark.parametrize("devices", [
    pytest.param([], id="none"),
    pytest.param([("vg-pool-tpool", 254, 2)], id="one"),
    pytest.param([("vg-pool", 254, 3), ("vg-pool--tpool", 254, 2), ("a" * 127, 254, 300),
                  ("vg-csi--v--1", 259, 1 << 12)], id="several"),
])
def test_unpack_names(devices: list[tuple[str, int, int]]) -> None:
    assert dm.unpack_names(name_list(devices)) == {n: (a, b) for n, a, b in devices}


def test_a_full_list_means_ask_again() -> None:
    assert dm.unpack_names(name_list([("vg-lv", 254, 1)], flags=DM_BUFFER_FULL_FLAG)) is None


def test_a_list_entry_past_the_end_or_going_nowhere_is_malformed() -> None:
    buf = name_list([("vg-a", 254, 1), ("vg-b", 254, 2)])
    struct.pack_into("=I", buf, HEADER_SIZE + 8, 1 << 20)  # the first entry's next
    with pytest.raises(DmReplyMalformed, match="outside"):
        dm.unpack_names(buf)
    struct.pack_into("=I", buf, HEADER_SIZE + 8, 4)  # back into the first entry
    with pytest.raises(DmReplyMalformed, match="next"):
        dm.unpack_names(buf)


def test_devices_retries_with_a_bigger_buffer(monkeypatch: pytest.MonkeyPatch) -> None:
    sizes: list[int] = []
    many = [(f"vg-lv{i:04d}" + "x" * 80, 254, i) for i in range(1000)]  # about 190 KiB

    def ioctl(request: int, call: str, name: str, buf: bytearray) -> bool:
        assert request == dm.DM_LIST_DEVICES and HEADER.unpack_from(buf, 0)[11] == bytes(128)
        sizes.append(len(buf))
        whole = name_list(many, size=1 << 20)
        if len(buf) < HEADER.unpack_from(whole, 0)[3]:
            buf[:HEADER_SIZE] = name_list([], size=HEADER_SIZE + 16,
                                          flags=DM_BUFFER_FULL_FLAG)[:HEADER_SIZE]
        else:
            buf[:] = whole[:len(buf)]
        return True

    monkeypatch.setattr(dm, "_ioctl", ioctl)
    got = dm.devices()
    assert len(got) == 1000 and got["vg-lv0999" + "x" * 80] == (254, 999)
    assert sizes == [dm.FIRST_LIST_SIZE, dm.FIRST_LIST_SIZE * 4]


# Status grammars.

@pytest.mark.parametrize(("params", "expected"), [
    ("0 -", 0),
    ("6144 16383", 6144),
    ("6144 6143", 6144),
    ("128 1048575", 128),
    ("0 - ", 0),
])
def test_thin_status(params: str, expected: int) -> None:
    assert dm.parse_thin_status(params) == expected


@pytest.mark.parametrize("params", [
    "Fail", "Error", "-", "", "garbage", "0", "0 - extra", "-1 -", "00 -", "+0 -", "0x10 17",
    "0 17",  # nothing mapped, yet a highest mapped sector: trusted neither way
    "5 -",
    "6144 x",
    "\u0660 -",  # an Arabic-Indic zero: int() would take it
])
def test_thin_status_that_cannot_be_trusted(params: str) -> None:
    with pytest.raises(DmStatusUnusable):
        dm.parse_thin_status(params)


def test_status_unusable_is_a_pool_unusable() -> None:
    assert issubclass(DmStatusUnusable, PoolUnusable)


POOL = "1 112/1024 48/8192 - rw discard_passdown queue_if_no_space - 256"


def usage(tid: int = 1, meta: tuple[int, int] = (112, 1024), data: tuple[int, int] = (48, 8192),
          ro: bool = False, full: bool = False, check: bool = False,
          held: bool = False) -> PoolUsage:
    return PoolUsage(transaction_id=tid, metadata_used=meta[0], metadata_total=meta[1],
                     data_used=data[0], data_total=data[1], read_only=ro,
                     out_of_data_space=full, needs_check=check, metadata_snapshot_held=held,
                     metadata_snapshot_root=77 if held else None)


@pytest.mark.parametrize(("params", "expected"), [
    pytest.param("1 112/1024 48/8192 - rw discard_passdown queue_if_no_space - 256 ",
                 usage(), id="rw-6.1"),
    pytest.param("0 111/1024 0/8192 - rw discard_passdown queue_if_no_space -",
                 usage(tid=0, meta=(111, 1024), data=(0, 8192)), id="rw-no-watermark"),
    pytest.param("7 300/1024 8192/8192 - out_of_data_space no_discard_passdown "
                 "error_if_no_space - 256", usage(7, (300, 1024), (8192, 8192), full=True),
                 id="out-of-data-space"),
    pytest.param("7 1024/1024 10/8192 - ro ignore_discard queue_if_no_space - 256",
                 usage(7, (1024, 1024), (10, 8192), ro=True), id="ro"),
    pytest.param("3 112/1024 48/8192 77 ro discard_passdown queue_if_no_space needs_check 256",
                 usage(3, ro=True, check=True, held=True), id="needs-check-held-root"),
    pytest.param("18446744073709551615 1/2 3/4 - rw discard_passdown queue_if_no_space - 1 x",
                 usage(2**64 - 1, (1, 2), (3, 4)), id="big-and-more-fields"),
])
def test_thin_pool_status(params: str, expected: PoolUsage) -> None:
    assert dm.parse_thin_pool_status(params) == expected


@pytest.mark.parametrize("params", [
    "Fail", "Error", "", "garbage",
    "1 112/1024 48/8192 - rw discard_passdown queue_if_no_space",  # 7 fields
    "x 112/1024 48/8192 - rw discard_passdown queue_if_no_space - 256",
    "1 112-1024 48/8192 - rw discard_passdown queue_if_no_space - 256",
    "1 112/1024 9000/8192 - rw discard_passdown queue_if_no_space - 256",  # used > total
    "1 112/1024 0/0 - rw discard_passdown queue_if_no_space - 256",
    "1 112/1024 48/8192 x rw discard_passdown queue_if_no_space - 256",
    "1 112/1024 48/8192 - fail discard_passdown queue_if_no_space - 256",
    "1 112/1024 48/8192 - rw discard queue_if_no_space - 256",
    "1 112/1024 48/8192 - rw discard_passdown queue - 256",
    "1 112/1024 48/8192 - rw discard_passdown queue_if_no_space maybe 256",
])
def test_thin_pool_status_that_cannot_be_read(params: str) -> None:
    with pytest.raises(DmStatusUnusable):
        dm.parse_thin_pool_status(params)


@pytest.mark.parametrize("targets", [
    [], [Target(0, 8, "linear", "")], [Target(0, 8, "thin", "0 -"), Target(8, 8, "thin", "0 -")],
])
def test_single_target_refuses_anything_but_one_of_the_type(targets: list[Target]) -> None:
    with pytest.raises(DmStatusUnusable, match="vg-lv"):
        dm.single_target("vg-lv", targets, "thin")


# The calls, with the kernel replaced by a fake behind _ioctl.

Ioctl = Callable[[int, str, str, bytearray], bool]


def fake_kernel(devices: dict[str, list[bytearray | None]]) -> tuple[Ioctl, list[int]]:
    """An _ioctl that answers each call for a name with the next of its
    replies (the last one repeats; None: no such device, ENXIO), copied into
    the caller's buffer as far as it fits, and records the buffer sizes it
    was given."""
    sizes: list[int] = []

    def ioctl(request: int, call: str, name: str, buf: bytearray) -> bool:
        assert request in (dm.DM_DEV_STATUS, dm.DM_TABLE_STATUS)
        assert HEADER.unpack_from(buf, 0)[11].rstrip(b"\0") == name.encode()
        sizes.append(len(buf))
        answers = devices.get(name) or [None]
        answer = answers.pop(0) if len(answers) > 1 else answers[0]
        if answer is None:
            return False
        n = min(len(buf), len(answer))
        buf[:n] = answer[:n]
        return True

    return ioctl, sizes


def test_status_retries_with_a_bigger_buffer_while_the_kernel_says_full(
        monkeypatch: pytest.MonkeyPatch) -> None:
    full = reply(HEADER_SIZE, flags=DM_ACTIVE_PRESENT_FLAG | DM_BUFFER_FULL_FLAG)
    good = reply(targets=[(0, 8, "thin", "6144 6143")])
    ioctl, sizes = fake_kernel({"vg-lv": [full, full, good]})
    monkeypatch.setattr(dm, "_ioctl", ioctl)
    assert dm.status("vg-lv") == [Target(0, 8, "thin", "6144 6143")]
    assert sizes == [dm.FIRST_STATUS_SIZE, dm.FIRST_STATUS_SIZE * 4, dm.FIRST_STATUS_SIZE * 16]


def test_the_calls_on_a_fake_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    ioctl, _ = fake_kernel({
        "vg-thin": [reply(targets=[(0, 8, "thin", "0 -")], open_count=1)],
        "vg-data": [reply(targets=[(0, 8, "thin", "128 4095")])],
        "vg-lin": [reply(targets=[(0, 8, "linear", "")])],
        "vg-pool-tpool": [reply(targets=[(0, 8, "thin-pool", POOL)])],
        "vg-bare": [reply(HEADER_SIZE, flags=0)],
        "vg-failed": [reply(targets=[(0, 8, "thin", "Fail")])],
    })
    monkeypatch.setattr(dm, "_ioctl", ioctl)
    host = Kernel()
    assert host.dm_device("vg-thin") == DmDevice(254, 4, 1, live=True, suspended=False)
    assert host.dm_device("vg-none") is None
    assert host.dm_status("vg-none") is None
    assert host.dm_status("vg-bare") == []
    assert host.dm_status("vg-pool-tpool") == [Target(0, 8, "thin-pool", POOL)]
    # A thin volume's mapped sectors; None whenever the count is not proof
    # (no device, not one thin target, a failed pool): "may hold data".
    assert lv_devices.thin_mapped_sectors(host, "vg", "thin") == 0
    assert lv_devices.thin_mapped_sectors(host, "vg", "data") == 128
    for lv in ("none", "lin", "bare", "failed"):
        assert lv_devices.thin_mapped_sectors(host, "vg", lv) is None, lv


@pytest.mark.parametrize(("devices", "expected"), [
    pytest.param({"vg-pool-tpool": [reply(targets=[(0, 8, "thin-pool", POOL)])],
                  "vg-pool": [reply(targets=[(0, 8, "linear", "")])]}, usage(), id="stacked"),
    pytest.param({"vg-pool": [reply(targets=[(0, 8, "thin-pool", POOL)])]}, usage(),
                 id="alone"),
    pytest.param({}, None, id="inactive"),
    # LVM stacks the pool between the two lookups: asked again, found in -tpool.
    pytest.param({"vg-pool-tpool": [None, reply(targets=[(0, 8, "thin-pool", POOL)])],
                  "vg-pool": [reply(targets=[(0, 8, "linear", "")])]}, usage(), id="race"),
])
def test_pool_usage_finds_the_thin_pool_target(monkeypatch: pytest.MonkeyPatch,
                                               devices: dict[str, list[bytearray | None]],
                                               expected: PoolUsage | None) -> None:
    monkeypatch.setattr(dm, "_ioctl", fake_kernel(devices)[0])
    assert lv_devices.pool_usage(Kernel(), "vg", "pool") == expected


@pytest.mark.parametrize(("devices", "why"), [
    pytest.param({"vg-pool": [reply(targets=[(0, 8, "linear", "")])]}, "neither",
                 id="never-the-target"),
    pytest.param({"vg-pool-tpool": [reply(targets=[(0, 8, "thin", "0 -")])]},
                 "not a single thin-pool", id="another-target"),
    pytest.param({"vg-pool": [reply(targets=[(0, 8, "thin-pool", "Fail")])]}, "failed",
                 id="failed-pool"),
])
def test_pool_usage_that_cannot_be_trusted(monkeypatch: pytest.MonkeyPatch,
                                           devices: dict[str, list[bytearray | None]],
                                           why: str) -> None:
    monkeypatch.setattr(dm, "_ioctl", fake_kernel(devices)[0])
    with pytest.raises(DmStatusUnusable, match=why):
        lv_devices.pool_usage(Kernel(), "vg", "pool")


# The control device and the ioctl's errors, with os.open and fcntl.ioctl faked.

@pytest.mark.parametrize("code", [errno.ENOENT, errno.ENODEV])
def test_no_control_device_is_device_mapper_missing(monkeypatch: pytest.MonkeyPatch,
                                                    code: int) -> None:
    def no_control(path: str, flags: int, mode: int = 0o777) -> int:
        assert path == dm.CONTROL and flags & os.O_CLOEXEC
        raise OSError(code, os.strerror(code), path)

    monkeypatch.setattr(os, "open", no_control)
    with pytest.raises(DeviceMapperMissing) as info:
        dm.device("vg-lv")
    assert isinstance(info.value, SyscallError) and info.value.errno == code
    assert dm.CONTROL in info.value.message and "no device-mapper" in info.value.message


def test_a_control_device_we_may_not_open_is_a_syscall_error(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def denied(path: str, flags: int, mode: int = 0o777) -> int:
        raise PermissionError(errno.EACCES, "Permission denied", path)

    monkeypatch.setattr(os, "open", denied)
    with pytest.raises(SyscallError) as info:
        dm.status("vg-lv")
    assert not isinstance(info.value, DeviceMapperMissing) and info.value.errno == errno.EACCES


@pytest.mark.parametrize(("code", "outcome"), [(errno.ENXIO, None), (errno.EACCES, SyscallError),
                                               (errno.EINVAL, SyscallError)])
def test_ioctl_errors(monkeypatch: pytest.MonkeyPatch, code: int,
                      outcome: type[Exception] | None) -> None:
    closed: list[int] = []
    real_close = os.close
    monkeypatch.setattr(dm, "_open_control", lambda: 1000)
    monkeypatch.setattr(os, "close",
                        lambda fd: closed.append(fd) if fd == 1000 else real_close(fd))

    def failing(fd: int, request: int, buf: bytearray, mutate: bool) -> int:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(fcntl, "ioctl", failing)
    if outcome is None:
        assert dm.device("vg-lv") is None
    else:
        with pytest.raises(outcome) as info:
            dm.device("vg-lv")
        assert "DM_DEV_STATUS vg-lv" in str(info.value)
    assert closed == [1000]  # closed on every path
