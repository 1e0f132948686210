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
    MS_NOATIME,
    MS_NODEV,
    MS_NODIRATIME,
    MS_NOEXEC,
    MS_NOSUID,
    MS_RDONLY,
    MS_RELATIME,
    MS_REMOUNT,
    MS_STRICTATIME,
    Host,
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

