"""The clean-up of a bind whose remount fails, in the real mount table: it
takes down only the mount the bind stacked at the target, never a mount that
was there before (compared by mount ID in /proc/self/mountinfo).

The remount's failure is injected (no flag a bind remount takes makes the
kernel refuse it outside a user namespace); the bind, the mounts and their
unmounting are real."""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from csi_local.errors import CommandError, SyscallError
from csi_local.host import mounts
from csi_local.host.filesystems import Filesystems
from csi_local.host.kernel import Kernel
from csi_local.host.runner import ProcessRunner
from tests.integration.conftest import SCRATCH, run, unmount_under

pytestmark = pytest.mark.integration


def ids_at(path: Path) -> list[tuple[int, str]]:
    """(mount ID, source) of each mount at `path`, oldest first, from mountinfo."""
    return [(m.mount_id, m.source) for m in mounts.read_mounts_at(str(path))]


@pytest.fixture
def place() -> Iterator[Path]:
    root = SCRATCH / "bind-cleanup"
    (root / "source").mkdir(parents=True, exist_ok=True)
    (root / "target").mkdir(exist_ok=True)
    (root / "node").touch()
    try:
        yield root
    finally:
        unmount_under(root)


def refuse_remount(host: Kernel, monkeypatch: pytest.MonkeyPatch) -> None:
    def remount_bind(target: str, options: object, *, readonly: bool = False) -> None:
        raise SyscallError("mount(2) MS_REMOUNT|MS_BIND", (target, "ro"), errno.EPERM,
                           os.strerror(errno.EPERM))

    monkeypatch.setattr(host, "remount_bind", remount_bind)


@pytest.mark.parametrize("kind", ["directory", "device-node"])
def test_a_failed_remount_unmounts_only_its_own_bind(
        place: Path, monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    host = Kernel()
    fs = Filesystems(ProcessRunner(timeout=60), host)
    if kind == "directory":
        source, target = place / "source", place / "target"
        run("mount", "-t", "tmpfs", "-o", "size=1m", "theirs", str(target))
    else:  # as a block publish: a device node bound onto a file
        source, target = Path("/dev/zero"), place / "node"
        run("mount", "--bind", "/dev/null", str(target))
    before = ids_at(target)
    assert len(before) == 1
    stacked: list[list[tuple[int, str]]] = []
    real_bind = host.bind_mount

    def bind_mount(src: str, dst: str) -> None:
        real_bind(src, dst)
        stacked.append(ids_at(target))

    monkeypatch.setattr(host, "bind_mount", bind_mount)
    refuse_remount(host, monkeypatch)
    with pytest.raises(CommandError, match="EPERM"):
        fs.bind(str(source), str(target), readonly=True)
    assert len(stacked) == 1 and len(stacked[0]) == 2, "the bind was made on top"
    assert ids_at(target) == before, "the mount that was there before is still there"


def test_a_failed_remount_on_an_empty_target_leaves_nothing(
        place: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    host = Kernel()
    fs = Filesystems(ProcessRunner(timeout=60), host)
    refuse_remount(host, monkeypatch)
    with pytest.raises(CommandError):
        fs.bind(str(place / "source"), str(place / "target"), readonly=True, flags=["noatime"])
    assert ids_at(place / "target") == []
