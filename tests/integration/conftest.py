"""Fixtures for integration tests: loop-backed VGs and thin pools, and a
running csi-local server. These need root, device-mapper, mkfs and mount:
inside the test VM (or a qualifying host)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeAlias

import grpc
import pytest

from csi_local._gen import csi_pb2 as pb
from csi_local._gen import csi_pb2_grpc
from csi_local.host import mounts


def pytest_itemcollected(item: pytest.Item) -> None:
    """Mark every test under this directory `integration`, so the VM harness
    takes it even where its module forgets `pytestmark` (a `pytestmark` in a
    conftest has no effect)."""
    if Path(str(item.path)).is_relative_to(Path(__file__).parent):
        item.add_marker(pytest.mark.integration)


SCRATCH = Path("/run/csi-local-tests")
# An access mode as the generated stubs type it (an int at run time).
AccessModeValue: TypeAlias = pb.VolumeCapability.AccessMode.Mode.ValueType


def run(*argv: str, check: bool = True,
        input: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "LC_ALL": "C", "LVM_SUPPRESS_FD_WARNINGS": "1"}
    proc = subprocess.run(list(argv), capture_output=True, text=True, check=False, env=env,
                          input=input)
    if check and proc.returncode != 0:
        raise AssertionError(f"{argv} exited {proc.returncode}: {proc.stderr.strip()}")
    return proc


@dataclass
class LoopVG:
    """A VG on a sparse file in tmpfs, with one thin pool."""

    name: str
    pool: str
    image: Path
    loop: str
    size: int

    def lv_names(self) -> list[str]:
        out = run("lvs", "--noheadings", "-o", "lv_name", self.name).stdout
        return sorted(x.strip() for x in out.split() if x.strip() and x.strip() != self.pool)

    def clean(self) -> None:
        """Remove every LV but the pool (mounts must be gone first)."""
        if self.lv_names():
            run("lvremove", "--yes", "--select", f"lv_name!={self.pool}", self.name)

    def destroy(self) -> None:
        run("vgremove", "--yes", "--force", self.name, check=False)
        run("losetup", "--detach", self.loop, check=False)
        self.image.unlink(missing_ok=True)


def make_vg(size: int = 4 << 30, pool_percent: int = 80, *, errorwhenfull: bool = True,
            metadatasize: str | None = None, dataalignment: str | None = None) -> LoopVG:
    """`metadatasize`: the PV's metadata area (pvcreate --metadatasize; None:
    LVM's default). pvcreate grows the area up to where the data starts,
    aligned to `dataalignment` (LVM's default: 1 MiB)."""
    SCRATCH.mkdir(parents=True, exist_ok=True)
    name = f"csitest{uuid.uuid4().hex[:8]}"
    image = SCRATCH / f"{name}.img"
    with open(image, "wb") as f:
        f.truncate(size)
    loop = run("losetup", "--find", "--show", str(image)).stdout.strip()
    if metadatasize is not None:
        align = ["--dataalignment", dataalignment] if dataalignment else []
        run("pvcreate", "--yes", "--metadatasize", metadatasize, *align, loop)
    run("vgcreate", "--yes", name, loop)
    run("lvcreate", "--yes", "--type", "thin-pool", "--extents", f"{pool_percent}%VG",
        "--name", "pool", name)
    # A full pool fails writes at once instead of queueing them for a minute.
    run("lvchange", "--errorwhenfull", "y" if errorwhenfull else "n", f"{name}/pool")
    return LoopVG(name=name, pool="pool", image=image, loop=loop, size=size)


def unmount_under(root: Path) -> None:
    prefix = str(root) + "/"
    for _ in range(5):
        stale = [m.mount_point for m in mounts.read_mounts()
                 if m.mount_point.startswith(prefix)]
        if not stale:
            return
        for point in sorted(stale, key=len, reverse=True):
            run("umount", "-l", point, check=False)


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


@dataclass
class PluginProcess:
    """A csi-local server process and clients for its three services."""

    vg: LoopVG
    workdir: Path
    extra_args: list[str] = field(default_factory=list)
    node_id: str = "node-1"
    # Device classes from this file (--config) instead of the VG's pool by flags.
    config_file: Path | None = None
    proc: subprocess.Popen[bytes] | None = None
    channel: grpc.Channel | None = None

    @property
    def socket(self) -> str:
        return str(self.workdir / "csi.sock")

    @property
    def endpoint(self) -> str:
        return f"unix://{self.socket}"

    @property
    def state_dir(self) -> Path:
        return self.workdir / "state"

    @property
    def log_path(self) -> Path:
        return self.workdir / "plugin.log"

    def argv(self) -> list[str]:
        return [
            sys.executable, "-m", "csi_local", "serve",
            "--endpoint", self.endpoint, "--node-id", self.node_id,
            *(["--config", str(self.config_file)] if self.config_file is not None
              else ["--volume-group", self.vg.name, "--thin-pool", self.vg.pool]),
            "--state-dir", str(self.state_dir), "--lock-dir", str(self.workdir / "locks"),
            "--log-level", "debug", *self.extra_args,
        ]

    def start(self) -> None:
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.argv(), stdout=log, stderr=log, stdin=subprocess.DEVNULL)
        log.close()
        self.channel = grpc.insecure_channel(self.endpoint)
        deadline = time.monotonic() + 240  # emulated CPUs start Python+grpc slowly
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"plugin exited {self.proc.returncode}:\n{self.log()}")
            try:
                self.identity.Probe(pb.ProbeRequest(), timeout=5)
                return
            except grpc.RpcError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def kill(self) -> None:
        """SIGKILL: no clean-up of any kind."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()
        self._close_channel()

    def stop(self) -> int | None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._close_channel()
        return None if self.proc is None else self.proc.returncode

    def restart(self, kill: bool = True) -> None:
        if kill:
            self.kill()
        else:
            self.stop()
        self.start()

    def _close_channel(self) -> None:
        if self.channel is not None:
            self.channel.close()
            self.channel = None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    @property
    def identity(self) -> csi_pb2_grpc.IdentityStub:
        assert self.channel is not None
        return csi_pb2_grpc.IdentityStub(self.channel)

    @property
    def controller(self) -> csi_pb2_grpc.ControllerStub:
        assert self.channel is not None
        return csi_pb2_grpc.ControllerStub(self.channel)

    @property
    def node(self) -> csi_pb2_grpc.NodeStub:
        assert self.channel is not None
        return csi_pb2_grpc.NodeStub(self.channel)

    def path(self, *parts: str) -> str:
        """A fresh path under the scratch directory (parent made, path itself not)."""
        p = self.workdir.joinpath("paths", *parts)
        p.parent.mkdir(parents=True, exist_ok=True)
        return str(p)


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


