"""The host's mount calls: the flags of a bind remount, and how a failed call reads.

The calls themselves are proven on real mounts in the VM
(tests/integration/test_node.py); here, the flag arithmetic the kernel
leaves to the caller.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from csi_local.errors import CommandError, SyscallError
from csi_local.host.kernel import (
    MS_BIND,
    MS_DIRSYNC,
    MS_I_VERSION,
    MS_LAZYTIME,
    MS_MANDLOCK,
    MS_NOATIME,
    MS_NODEV,
    MS_NODIRATIME,
    MS_NOEXEC,
    MS_NOSUID,
    MS_RDONLY,
    MS_RELATIME,
    MS_REMOUNT,
    MS_SILENT,
    MS_STRICTATIME,
    MS_SYNCHRONOUS,
    Kernel,
    mount_call,
    remount_flags,
)

ST_RDONLY, ST_NOSUID, ST_NODEV, ST_NOEXEC = os.ST_RDONLY, os.ST_NOSUID, os.ST_NODEV, os.ST_NOEXEC
ST_NOATIME, ST_NODIRATIME, ST_RELATIME = os.ST_NOATIME, os.ST_NODIRATIME, os.ST_RELATIME
BASE = MS_REMOUNT | MS_BIND


@pytest.mark.parametrize(("current", "options", "expected"), [
    # A read-only remount keeps what the mount had: dropping nosuid/nodev
    # would be a quiet privilege gain inside the workload.
    pytest.param(ST_NOSUID | ST_NODEV | ST_RELATIME, ["ro"],
                 MS_RDONLY | MS_NOSUID | MS_NODEV | MS_RELATIME, id="ro-keeps-nosuid-nodev"),
    pytest.param(ST_RDONLY | ST_NOEXEC | ST_RELATIME, ["rw"],
                 MS_NOEXEC | MS_RELATIME, id="rw-clears-only-ro"),
    pytest.param(ST_RELATIME, ["ro", "noexec", "nosuid"],
                 MS_RDONLY | MS_NOEXEC | MS_NOSUID | MS_RELATIME, id="adds-flags"),
    pytest.param(ST_NOSUID | ST_NODEV | ST_NOEXEC | ST_RELATIME, ["suid", "dev", "exec"],
                 MS_RELATIME, id="clears-flags"),
    # Each option sets or clears its one flag, as mount(8) applies it to the
    # options the mount shows; the kernel ranks the atime flags (noatime over
    # relatime, strictatime over both), not their order.
    pytest.param(ST_RELATIME, ["noatime"], MS_NOATIME | MS_RELATIME, id="noatime-added"),
    pytest.param(ST_NOATIME, ["strictatime"], MS_NOATIME | MS_STRICTATIME,
                 id="strictatime-added"),
    pytest.param(ST_NOATIME, ["atime"], 0, id="atime-clears-noatime"),
    # No atime flag on the mount is strictatime: said, or the kernel makes it relatime.
    pytest.param(ST_NODIRATIME, ["ro"], MS_RDONLY | MS_NODIRATIME | MS_STRICTATIME,
                 id="strictatime-kept"),
    pytest.param(ST_NOATIME | ST_NODIRATIME, [], MS_NOATIME | MS_NODIRATIME, id="nothing-asked"),
    # A file system's own options cannot change on a bind mount; the kernel ignores them.
    pytest.param(ST_RELATIME, ["discard", "ro"], MS_RDONLY | MS_RELATIME, id="fs-option-ignored"),
    pytest.param(ST_RELATIME, ["ro", "rw"], MS_RELATIME, id="last-one-wins"),
    pytest.param(ST_NODIRATIME, ["noatime"], MS_NODIRATIME | MS_NOATIME,
                 id="strictatime-mount-made-noatime"),
])
def test_remount_flags(current: int, options: list[str], expected: int) -> None:
    assert remount_flags(current, options) == expected | BASE


@pytest.mark.parametrize("options", [
    ["rw"], ["noatime", "rw"], ["rw", "ro", "rw"], ["rw,nosuid"], [],
])
def test_a_read_only_remount_is_read_only_whatever_the_options_say(options: list[str]) -> None:
    # Issue 30, defect 1: a StorageClass's mountOptions [rw] (or [noatime, rw])
    # made a read-only publish writable: "ro" came first, and a later "rw"
    # cleared it.
    flags = remount_flags(ST_RELATIME | ST_NOSUID, options, readonly=True)
    assert flags & MS_RDONLY


def test_a_failed_call_is_a_command_error_naming_the_call_and_errno(tmp_path: Path) -> None:
    # Not a mount point: EINVAL as root, EPERM for anyone else; either way the
    # kernel refuses, and nothing is unmounted.
    with pytest.raises(SyscallError) as info:
        Kernel().unmount(str(tmp_path))
    err = info.value
    assert isinstance(err, CommandError)  # callers handle a failed mount one way
    assert err.errno in (errno.EINVAL, errno.EPERM)
    assert err.argv == ["umount2(2)", str(tmp_path)]
    assert str(err) == (f"umount2(2) {tmp_path}: {errno.errorcode[err.errno]} "
                        f"({os.strerror(err.errno)})")


def test_a_bind_of_a_missing_source_fails_before_anything_is_mounted(tmp_path: Path) -> None:
    target = tmp_path / "t"
    target.mkdir()
    with pytest.raises(SyscallError) as info:
        Kernel().bind_mount(str(tmp_path / "missing"), str(target))
    assert info.value.errno in (errno.ENOENT, errno.EPERM)
    assert not Kernel().is_mount_point(str(target))



@pytest.mark.parametrize(("options", "expected"), [
    ([], (0, "")),
    (["rw"], (0, "")),
    (["ro", "nodev", "noatime"], (MS_RDONLY | MS_NODEV | MS_NOATIME, "")),
    # mount(8) passes both atime flags, whatever their order (strace in the VM:
    # "noatime,relatime" is MS_NOATIME|MS_RELATIME, and the kernel makes it noatime).
    (["noatime", "relatime"], (MS_NOATIME | MS_RELATIME, "")),
    (["strictatime", "noatime"], (MS_STRICTATIME | MS_NOATIME, "")),
    (["noatime", "atime"], (0, "")),
    (["ro", "rw"], (0, "")),
    (["sync", "dirsync", "lazytime"], (MS_SYNCHRONOUS | MS_DIRSYNC | MS_LAZYTIME, "")),
    (["nouuid", "nosuid"], (MS_NOSUID, "nouuid")),
    (["defaults"], (0, "")),
    (["defaults", "nostrictatime", "iversion", "mand", "silent"],
     (MS_MANDLOCK | MS_SILENT | MS_I_VERSION, "")),
    # Anything else is mount(8)'s to handle: its own options, a file system's.
    (["discard"], None),
    # SELinux contexts: mount(8) drops them where SELinux is disabled and
    # translates them where it is enabled; the kernel alone refuses them (EINVAL).
    (['context="system_u:object_r:container_file_t:s0:c10,c20"'], None),
    (["ro", "rootcontext=system_u:object_r:container_file_t:s0"], None),
    (["nofail"], None),
    (["errors=remount-ro"], None),
    (["ro", "user_xattr"], None),
])
def test_a_new_mount_is_one_call_for_the_options_it_knows(
        options: list[str], expected: tuple[int, str] | None) -> None:
    assert mount_call(options) == expected


def test_a_failed_filesystem_mount_names_the_call_and_errno(tmp_path: Path) -> None:
    with pytest.raises(SyscallError) as info:
        Kernel().mount_filesystem(str(tmp_path / "no-device"), str(tmp_path), "ext4", ["ro"])
    assert info.value.errno in (errno.ENOENT, errno.EPERM)
    assert info.value.message.startswith("mount(2) ")


def test_options_it_does_not_know_are_left_to_mount8(tmp_path: Path) -> None:
    assert Kernel().mount_filesystem(str(tmp_path / "dev"), str(tmp_path), "ext4",
                                   ["discard"]) is False


def test_a_file_systems_own_size_from_its_superblock(tmp_path: Path) -> None:
    """Kernel.filesystem_size reads ext4's and btrfs's superblocks (statvfs
    leaves out their metadata, or divides by btrfs's copies): the size the
    offline growth at stage compares with the device's."""
    import struct

    from csi_local.host.kernel import Kernel

    ext4 = bytearray(4096)
    struct.pack_into("<I", ext4, 1024 + 0x04, 0x1234)  # s_blocks_count_lo
    struct.pack_into("<I", ext4, 1024 + 0x18, 2)  # 4096-byte blocks
    struct.pack_into("<H", ext4, 1024 + 0x38, 0xEF53)
    struct.pack_into("<I", ext4, 1024 + 0x60, 0x80)  # 64bit: s_blocks_count_hi counts
    struct.pack_into("<I", ext4, 1024 + 0x150, 1)
    btrfs = bytearray(128 << 10)
    btrfs[(64 << 10) + 0x40:(64 << 10) + 0x48] = b"_BHRfS_M"
    struct.pack_into("<Q", btrfs, (64 << 10) + 0x70, 3 << 30)
    (tmp_path / "ext4").write_bytes(ext4)
    (tmp_path / "btrfs").write_bytes(btrfs)
    (tmp_path / "blank").write_bytes(bytes(128 << 10))
    host = Kernel()
    assert host.filesystem_size(str(tmp_path / "ext4"), "/", "ext4") == \
        ((1 << 32) + 0x1234) * 4096
    assert host.filesystem_size(str(tmp_path / "btrfs"), "/", "btrfs") == 3 << 30
    for fs in ("ext4", "btrfs"):  # no superblock: it cannot tell
        assert host.filesystem_size(str(tmp_path / "blank"), "/", fs) is None
    assert host.filesystem_size(str(tmp_path / "missing"), "/", "ext4") is None
