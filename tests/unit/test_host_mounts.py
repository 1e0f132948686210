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
from csi_local.host import (
    MS_BIND,
    MS_DIRSYNC,
    MS_LAZYTIME,
    MS_NOATIME,
    MS_NODEV,
    MS_NODIRATIME,
    MS_NOEXEC,
    MS_NOSUID,
    MS_RDONLY,
    MS_RELATIME,
    MS_REMOUNT,
    MS_STRICTATIME,
    MS_SYNCHRONOUS,
    Host,
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
    pytest.param(ST_RELATIME, ["noatime"], MS_NOATIME, id="noatime-replaces-relatime"),
    pytest.param(ST_NOATIME, ["strictatime"], MS_STRICTATIME, id="strictatime-replaces"),
    # No atime flag on the mount is strictatime: said, or the kernel makes it relatime.
    pytest.param(ST_NODIRATIME, ["ro"], MS_RDONLY | MS_NODIRATIME | MS_STRICTATIME,
                 id="strictatime-kept"),
    pytest.param(ST_NOATIME | ST_NODIRATIME, [], MS_NOATIME | MS_NODIRATIME, id="nothing-asked"),
    # A file system's own options cannot change on a bind mount; the kernel ignores them.
    pytest.param(ST_RELATIME, ["discard", "ro"], MS_RDONLY | MS_RELATIME, id="fs-option-ignored"),
    pytest.param(ST_RELATIME, ["ro", "rw"], MS_RELATIME, id="last-one-wins"),
])
def test_remount_flags(current: int, options: list[str], expected: int) -> None:
    assert remount_flags(current, options) == expected | BASE


def test_a_failed_call_is_a_command_error_naming_the_call_and_errno(tmp_path: Path) -> None:
    # Not a mount point: EINVAL as root, EPERM for anyone else; either way the
    # kernel refuses, and nothing is unmounted.
    with pytest.raises(SyscallError) as info:
        Host().unmount(str(tmp_path))
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
        Host().bind_mount(str(tmp_path / "missing"), str(target))
    assert info.value.errno in (errno.ENOENT, errno.EPERM)
    assert not Host().is_mount_point(str(target))



@pytest.mark.parametrize(("options", "expected"), [
    ([], (0, "")),
    (["rw"], (0, "")),
    (["ro", "nodev", "noatime"], (MS_RDONLY | MS_NODEV | MS_NOATIME, "")),
    (["noatime", "relatime"], (MS_RELATIME, "")),  # the last atime option wins
    (["ro", "rw"], (0, "")),
    (["sync", "dirsync", "lazytime"], (MS_SYNCHRONOUS | MS_DIRSYNC | MS_LAZYTIME, "")),
    (["nouuid", "nosuid"], (MS_NOSUID, "nouuid")),
    # Anything else is mount(8)'s to handle: its own options, a file system's.
    (["discard"], None),
    (["defaults"], None),
    (["nofail"], None),
    (["errors=remount-ro"], None),
    (["ro", "user_xattr"], None),
])
def test_a_new_mount_is_one_call_for_the_options_it_knows(
        options: list[str], expected: tuple[int, str] | None) -> None:
    assert mount_call(options) == expected


def test_a_failed_filesystem_mount_names_the_call_and_errno(tmp_path: Path) -> None:
    with pytest.raises(SyscallError) as info:
        Host().mount_filesystem(str(tmp_path / "no-device"), str(tmp_path), "ext4", ["ro"])
    assert info.value.errno in (errno.ENOENT, errno.EPERM)
    assert info.value.message.startswith("mount(2) ")


def test_options_it_does_not_know_are_left_to_mount8(tmp_path: Path) -> None:
    assert Host().mount_filesystem(str(tmp_path / "dev"), str(tmp_path), "ext4",
                                   ["discard"]) is False
