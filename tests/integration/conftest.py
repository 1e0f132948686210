"""Fixtures for integration tests: loop-backed VGs and thin pools, and a
running csi-local server. These need root, device-mapper, mkfs and mount:
inside the test VM (or a qualifying host). The VGs and the server process
themselves come from benchmarks/lab.py, the one home the benchmarks share;
here are the tests' defaults and the fixtures' life cycle."""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeAlias

import grpc
import pytest

from benchmarks import lab
from benchmarks.lab import LoopVG, PluginProcess, run, unmount_under
from csi_local._gen import csi_pb2 as pb
from csi_local.host import mounts

# What the tests import from here (the lab's names among them).
__all__ = ["SCRATCH", "AccessModeValue", "LoopVG", "PluginProcess", "block_cap",
           "expect_code", "make_vg", "mount_cap", "run", "unmount_under"]


def pytest_itemcollected(item: pytest.Item) -> None:
    """Mark every test under this directory `integration`, so the VM harness
    takes it even where its module forgets `pytestmark` (a `pytestmark` in a
    conftest has no effect)."""
    if Path(str(item.path)).is_relative_to(Path(__file__).parent):
        item.add_marker(pytest.mark.integration)


SCRATCH = Path("/run/csi-local-tests")
# An access mode as the generated stubs type it (an int at run time).
AccessModeValue: TypeAlias = pb.VolumeCapability.AccessMode.Mode.ValueType


def make_vg(size: int = 4 << 30, pool_percent: int = 80, *, errorwhenfull: bool = True,
            metadatasize: str | None = None, dataalignment: str | None = None,
            chunk_size: str | None = None) -> LoopVG:
    """A VG of the tests' own (csitest..., its image in SCRATCH) with a thin
    pool: `benchmarks.lab.make_vg`, whose doc says what the options do."""
    return lab.make_vg(size, scratch=SCRATCH, prefix="csitest", pool_percent=pool_percent,
                       errorwhenfull=errorwhenfull, metadatasize=metadatasize,
                       dataalignment=dataalignment, chunk_size=chunk_size)


# Where LVM archives each VG's metadata before a change (the host's lvm.conf:
# kept for 30 days). In the test VM /etc is a copy-on-write layer in the
# guest's memory, and the walk and the other tests make thousands of changes
# a run: their archive files alone filled it (ENOSPC in the middle of a run).
LVM_ARCHIVE = Path("/etc/lvm/archive")


@pytest.fixture(autouse=True)
def _lvm_archive_in_the_vm() -> Iterator[None]:
    """After each test in the VM, the archive files it left: none of the
    tests reads them (test_lvm_archive.py archives into a directory of its
    own), and the host's /etc/lvm is never written (read-only in the guest)."""
    yield
    if os.environ.get("CSI_LOCAL_IN_VM") == "1" and LVM_ARCHIVE.is_dir():
        for path in LVM_ARCHIVE.glob("*.vg"):
            path.unlink(missing_ok=True)


@pytest.fixture(scope="session")
def session_vg() -> Iterator[LoopVG]:
    vg = make_vg()
    yield vg
    shared = _shared.pop(vg.name, None)
    if shared is not None:
        _discard(shared, False)
    vg.destroy()


@pytest.fixture
def vg(session_vg: LoopVG) -> Iterator[LoopVG]:
    """The session's VG and pool, emptied after each test."""
    yield session_vg
    session_vg.clean()


def _failed(request: pytest.FixtureRequest) -> bool:
    return bool(getattr(request.node, "rep_call_failed", False))


def _discard(plugin: PluginProcess, show_log: bool) -> None:
    plugin.stop()
    if show_log:
        print(f"--- plugin log {plugin.log_path} ---\n{plugin.log()[-20000:]}")
    unmount_under(plugin.workdir)
    shutil.rmtree(plugin.workdir, ignore_errors=True)


def _new_plugin(vg: LoopVG, extra_args: list[str]) -> PluginProcess:
    workdir = SCRATCH / f"p-{uuid.uuid4().hex[:8]}"
    workdir.mkdir(parents=True)
    return PluginProcess(vg=vg, workdir=workdir, extra_args=extra_args)


@pytest.fixture
def plugin_factory(vg: LoopVG, request: pytest.FixtureRequest) -> Iterator[Any]:
    """Plugins of a test's own (extra flags, another VG); gone after the test."""
    made: list[PluginProcess] = []

    def factory(*extra_args: str, target_vg: LoopVG | None = None,
                start: bool = True) -> PluginProcess:
        plugin = _new_plugin(target_vg or vg, list(extra_args))
        made.append(plugin)
        if start:
            plugin.start()
        return plugin

    yield factory
    for plugin in made:
        _discard(plugin, _failed(request))


def _reset(plugin: PluginProcess) -> bool:
    """Undo a test's node work through the plugin's own RPCs; False if that failed."""
    try:
        state_file = plugin.state_dir / "state.json"
        records = json.loads(state_file.read_text())["volumes"] if state_file.exists() else {}
        for vid, rec in records.items():
            for target in rec.get("publishes", {}):
                plugin.node.NodeUnpublishVolume(pb.NodeUnpublishVolumeRequest(
                    volume_id=vid, target_path=target), timeout=120)
            if rec.get("staging"):
                plugin.node.NodeUnstageVolume(pb.NodeUnstageVolumeRequest(
                    volume_id=vid, staging_target_path=rec["staging"]["path"]), timeout=120)
        left = json.loads(state_file.read_text())["volumes"] if state_file.exists() else {}
    except (grpc.RpcError, OSError, ValueError, KeyError):
        return False
    prefix = str(plugin.workdir) + "/"
    stray = [m for m in mounts.read_mounts() if m.mount_point.startswith(prefix)]
    return not left and not stray


_shared: dict[str, PluginProcess] = {}


@pytest.fixture
def plugin(vg: LoopVG, request: pytest.FixtureRequest) -> Iterator[PluginProcess]:
    """A running csi-local on the session VG's pool.

    Starting Python with grpc under software emulation costs seconds, so one
    server process serves test after test; after each test its stages and
    publishes are undone through its own RPCs (the VG is emptied by `vg`), and
    a process that fails that, or that a test killed, is replaced.
    """
    p = _shared.get(vg.name)
    if p is None:
        p = _shared[vg.name] = _new_plugin(vg, [])
    if p.proc is None or p.proc.poll() is not None or p.channel is None:
        p.start()
    log_mark = len(p.log())
    yield p
    if _failed(request):
        print(f"--- plugin log (this test) ---\n{p.log()[log_mark:][-20000:]}")
        kernel = run("dmesg", check=False).stdout.splitlines()[-30:]
        print("--- kernel log (tail) ---\n" + "\n".join(kernel))
    paths = p.workdir / "paths"
    if not _reset(p):
        del _shared[vg.name]
        _discard(p, False)
        return
    unmount_under(paths)
    shutil.rmtree(paths, ignore_errors=True)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report = yield
    if report.when == "call":
        item.rep_call_failed = report.failed  # type: ignore[attr-defined]
    return report


def mount_cap(fs_type: str = "ext4", flags: tuple[str, ...] = (),
              mode: AccessModeValue = pb.VolumeCapability.AccessMode.SINGLE_NODE_WRITER,
              ) -> pb.VolumeCapability:
    return pb.VolumeCapability(
        mount=pb.VolumeCapability.MountVolume(fs_type=fs_type, mount_flags=list(flags)),
        access_mode=pb.VolumeCapability.AccessMode(mode=mode),
    )


def block_cap(mode: AccessModeValue = pb.VolumeCapability.AccessMode.SINGLE_NODE_WRITER,
              ) -> pb.VolumeCapability:
    return pb.VolumeCapability(
        block=pb.VolumeCapability.BlockVolume(),
        access_mode=pb.VolumeCapability.AccessMode(mode=mode),
    )


def expect_code(code: grpc.StatusCode, fn: Any, *args: Any, **kwargs: Any) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        fn(*args, **kwargs)
    got = info.value.code()
    assert got == code, f"expected {code.name}, got {got.name}: {info.value.details()}"
    return info.value


