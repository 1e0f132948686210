"""Helpers shared by the sanity tests: configuration, stubs, capabilities, resource tracking."""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import re
import subprocess
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest

from csi_local.volumes.sizes import parse_size
from sanity import csi_pb2, csi_pb2_grpc

__all__ = ["parse_size"]  # re-exported: the suite's options take sizes



def normalize_endpoint(endpoint: str) -> str:
    """Accept ``unix:///path``, ``unix:/path``, ``/path`` or ``host:port``; return a gRPC target."""
    if endpoint.startswith("/"):
        return "unix://" + endpoint
    return endpoint


@dataclass
class Config:
    endpoint: str
    controller_endpoint: str
    staging_dir: Path
    mount_dir: Path
    volume_size: int
    expand_size: int
    access_type: str
    fs_type: str
    volume_parameters: dict[str, str] = field(default_factory=dict)
    snapshot_parameters: dict[str, str] = field(default_factory=dict)
    mutable_parameters: dict[str, str] = field(default_factory=dict)
    repeats: int = 3
    timeout: float = 120.0
    cbt_granularity: int = 1 << 20


class _TimeoutStub:
    """Wrap a generated stub so that every call gets a default deadline."""

    def __init__(self, stub: Any, timeout: float) -> None:
        self._stub = stub
        self._timeout = timeout

    def __getattr__(self, name: str) -> Callable[..., Any]:
        method = getattr(self._stub, name)

        def call(request: Any, **kwargs: Any) -> Any:
            kwargs.setdefault("timeout", self._timeout)
            return method(request, **kwargs)

        return call


@dataclass
class Stubs:
    identity: Any
    controller_identity: Any
    controller: Any
    node: Any
    group_controller: Any
    snapshot_metadata: Any


def make_stubs(node_ch: grpc.Channel, ctrl_ch: grpc.Channel, timeout: float) -> Stubs:
    # GroupController and SnapshotMetadata work on snapshots, which are the Controller's, so
    # they are called at the controller endpoint. The deadline of a streaming call covers the
    # whole stream: a plugin that never ends its stream fails instead of hanging the suite.
    return Stubs(
        identity=_TimeoutStub(csi_pb2_grpc.IdentityStub(node_ch), timeout),
        controller_identity=_TimeoutStub(csi_pb2_grpc.IdentityStub(ctrl_ch), timeout),
        controller=_TimeoutStub(csi_pb2_grpc.ControllerStub(ctrl_ch), timeout),
        node=_TimeoutStub(csi_pb2_grpc.NodeStub(node_ch), timeout),
        group_controller=_TimeoutStub(csi_pb2_grpc.GroupControllerStub(ctrl_ch), timeout),
        snapshot_metadata=_TimeoutStub(csi_pb2_grpc.SnapshotMetadataStub(ctrl_ch), timeout),
    )


@dataclass
class Capabilities:
    plugin: set[str]
    expansion: set[str]
    controller: set[str]
    node: set[str]

    def require_plugin(self, name: str) -> None:
        if name not in self.plugin:
            pytest.skip(f"plugin does not advertise {name}")

    def require_controller(self, *names: str) -> None:
        self.require_plugin("CONTROLLER_SERVICE")
        for name in names:
            if name not in self.controller:
                pytest.skip(f"plugin does not advertise {name}")

    def require_node(self, *names: str) -> None:
        for name in names:
            if name not in self.node:
                pytest.skip(f"plugin does not advertise node capability {name}")

    @property
    def has_controller(self) -> bool:
        return "CONTROLLER_SERVICE" in self.plugin

    def ctrl(self, name: str) -> bool:
        return self.has_controller and name in self.controller


def _plugin_caps(stub: Any) -> tuple[set[str], set[str]]:
    resp = stub.GetPluginCapabilities(csi_pb2.GetPluginCapabilitiesRequest())
    services: set[str] = set()
    expansion: set[str] = set()
    for cap in resp.capabilities:
        kind = cap.WhichOneof("type")
        if kind == "service":
            services.add(csi_pb2.PluginCapability.Service.Type.Name(cap.service.type))
        elif kind == "volume_expansion":
            expansion.add(
                csi_pb2.PluginCapability.VolumeExpansion.Type.Name(cap.volume_expansion.type)
            )
    return services, expansion


def discover_capabilities(stubs: Stubs, separate_controller: bool) -> Capabilities:
    plugin, expansion = _plugin_caps(stubs.identity)
    if separate_controller:
        p2, e2 = _plugin_caps(stubs.controller_identity)
        plugin |= p2
        expansion |= e2
    controller: set[str] = set()
    if "CONTROLLER_SERVICE" in plugin:
        resp = stubs.controller.ControllerGetCapabilities(
            csi_pb2.ControllerGetCapabilitiesRequest()
        )
        for cap in resp.capabilities:
            controller.add(csi_pb2.ControllerServiceCapability.RPC.Type.Name(cap.rpc.type))
    node: set[str] = set()
    resp_n = stubs.node.NodeGetCapabilities(csi_pb2.NodeGetCapabilitiesRequest())
    for ncap in resp_n.capabilities:
        node.add(csi_pb2.NodeServiceCapability.RPC.Type.Name(ncap.rpc.type))
    return Capabilities(plugin, expansion, controller, node)


def volume_capability(
    access_type: str, fs_type: str = "ext4", mode: str = "SINGLE_NODE_WRITER"
) -> csi_pb2.VolumeCapability:
    cap = csi_pb2.VolumeCapability(
        access_mode=csi_pb2.VolumeCapability.AccessMode(
            mode=csi_pb2.VolumeCapability.AccessMode.Mode.Value(mode)
        )
    )
    if access_type == "block":
        cap.block.SetInParent()
    else:
        cap.mount.fs_type = fs_type
    return cap


def expect_code(codes: grpc.StatusCode | Iterable[grpc.StatusCode], fn: Callable[[], Any]) -> Any:
    """Call ``fn`` and assert it fails with one of ``codes``; return the error."""
    wanted = {codes} if isinstance(codes, grpc.StatusCode) else set(codes)
    try:
        fn()
    except grpc.RpcError as err:
        got = err.code()
        assert got in wanted, (
            f"expected {'/'.join(sorted(c.name for c in wanted))}, "
            f"got {got.name}: {err.details()}"
        )
        return err
    pytest.fail(f"expected {'/'.join(sorted(c.name for c in wanted))}, but the call succeeded")


# ---------------------------------------------------------------- mount table (mountinfo only)


def _unescape(field_: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field_)


def mount_points() -> list[str]:
    """Mount points from /proc/self/mountinfo (field 5), unescaped."""
    points = []
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as fh:
        for line in fh:
            parts = line.split()
            if len(parts) > 4:
                points.append(_unescape(parts[4]))
    return points


def is_mount_point(path: str | os.PathLike[str]) -> bool:
    real = os.path.realpath(path)
    return any(p == real for p in mount_points())


def mounts_under(path: str | os.PathLike[str]) -> list[str]:
    real = os.path.realpath(path)
    return [p for p in mount_points() if p == real or p.startswith(real.rstrip("/") + "/")]


def force_unmount_under(path: str | os.PathLike[str]) -> list[str]:
    """Lazily unmount everything below ``path`` (deepest first); return what was mounted."""
    left = sorted(set(mounts_under(path)), key=len, reverse=True)
    for point in left:
        subprocess.run(["umount", "-l", point], check=False, capture_output=True)
    return left


# ---------------------------------------------------------------- data through a published volume

DATA_FILE = "sanity-data.bin"


def write_data(target: str, access_type: str, payload: bytes) -> None:
    if access_type == "block":
        fd = os.open(target, os.O_RDWR)
        try:
            os.pwrite(fd, payload, 0)
            os.fsync(fd)
        finally:
            os.close(fd)
        return
    path = os.path.join(target, DATA_FILE)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, payload)
        os.fsync(fd)
    finally:
        os.close(fd)
    dfd = os.open(target, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    os.sync()


def read_data(target: str, access_type: str, length: int) -> bytes:
    if access_type == "block":
        fd = os.open(target, os.O_RDONLY)
        try:
            return os.pread(fd, length, 0)
        finally:
            os.close(fd)
    with open(os.path.join(target, DATA_FILE), "rb") as fh:
        return fh.read()


def write_fails_readonly(target: str, access_type: str) -> int:
    """Try to write through a read-only publication; return the errno it failed with."""
    try:
        if access_type == "block":
            fd = os.open(target, os.O_WRONLY)
            try:
                os.pwrite(fd, b"x" * 512, 0)
                os.fsync(fd)
            finally:
                os.close(fd)
        else:
            with open(os.path.join(target, "sanity-ro-probe"), "wb") as fh:
                fh.write(b"x")
    except OSError as err:
        return err.errno or 0
    pytest.fail(f"writing through the read-only publication at {target} succeeded")


READONLY_ERRNOS = {errno.EROFS, errno.EACCES, errno.EPERM}


def device_size(path: str) -> int:
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.lseek(fd, 0, os.SEEK_END)
    finally:
        os.close(fd)


# ---------------------------------------------------------------- snapshots

READY_TIMEOUT = 120.0


def wait_ready(stubs: Stubs, caps: Capabilities, snap: csi_pb2.Snapshot) -> csi_pb2.Snapshot:
    """Poll GetSnapshot (or ListSnapshots) until the snapshot is ready_to_use."""
    deadline = time.monotonic() + READY_TIMEOUT
    while not snap.ready_to_use:
        if time.monotonic() > deadline:
            pytest.fail(f"snapshot {snap.snapshot_id} not ready_to_use after {READY_TIMEOUT}s")
        time.sleep(1)
        if "GET_SNAPSHOT" in caps.controller:
            snap = stubs.controller.GetSnapshot(
                csi_pb2.GetSnapshotRequest(snapshot_id=snap.snapshot_id)).snapshot
        elif "LIST_SNAPSHOTS" in caps.controller:
            resp = stubs.controller.ListSnapshots(
                csi_pb2.ListSnapshotsRequest(snapshot_id=snap.snapshot_id))
            assert len(resp.entries) == 1, "snapshot not listed while waiting for it"
            snap = resp.entries[0].snapshot
        else:
            pytest.fail("snapshot not ready_to_use and no GET_SNAPSHOT/LIST_SNAPSHOTS to poll")
    return snap


# ---------------------------------------------------------------- resource tracker


@dataclass
class Attachment:
    volume_id: str
    staging: str = ""
    target: str = ""
    publish_context: dict[str, str] = field(default_factory=dict)


class Tracker:
    """Creates resources for a test and undoes everything at teardown, even on failure."""

    def __init__(self, cfg: Config, stubs: Stubs, caps: Capabilities, node_id: str) -> None:
        self.cfg = cfg
        self.stubs = stubs
        self.caps = caps
        self.node_id = node_id
        self.volumes: dict[str, csi_pb2.Volume] = {}
        self.snapshots: list[str] = []
        # group_snapshot_id -> its member snapshot ids (DeleteVolumeGroupSnapshot needs them)
        self.group_snapshots: dict[str, list[str]] = {}
        self.attached: list[str] = []
        self.publish_context: dict[str, dict[str, str]] = {}
        self.staged: list[tuple[str, str]] = []
        self.published: list[tuple[str, str]] = []
        self.dirs: list[Path] = []

    # -- names and paths
    @staticmethod
    def name(kind: str = "vol") -> str:
        return f"sanity-{kind}-{uuid.uuid4().hex[:16]}"

    def _dir(self, base: Path) -> Path:
        d = base / uuid.uuid4().hex[:12]
        d.mkdir(parents=True)
        self.dirs.append(d)
        return d

    def staging_path(self) -> str:
        """A fresh directory: the CO creates the staging directory."""
        path = self._dir(self.cfg.staging_dir) / "staging"
        path.mkdir()
        return str(path)

    def target_path(self) -> str:
        """A fresh path whose parent exists: the SP creates the target itself."""
        return str(self._dir(self.cfg.mount_dir) / "target")

    def cap(self, mode: str = "SINGLE_NODE_WRITER") -> csi_pb2.VolumeCapability:
        return volume_capability(self.cfg.access_type, self.cfg.fs_type, mode)

    # -- controller
    def create_request(
        self,
        name: str | None = None,
        *,
        required: int | None = None,
        limit: int = 0,
        caps: list[csi_pb2.VolumeCapability] | None = None,
        source: csi_pb2.VolumeContentSource | None = None,
        params: dict[str, str] | None = None,
    ) -> csi_pb2.CreateVolumeRequest:
        req = csi_pb2.CreateVolumeRequest(
            name=name or self.name(),
            capacity_range=csi_pb2.CapacityRange(
                required_bytes=self.cfg.volume_size if required is None else required,
                limit_bytes=limit,
            ),
            volume_capabilities=caps or [self.cap()],
            parameters=self.cfg.volume_parameters if params is None else params,
        )
        if source is not None:
            req.volume_content_source.CopyFrom(source)
        return req

    def create(self, req: csi_pb2.CreateVolumeRequest) -> csi_pb2.Volume:
        vol: csi_pb2.Volume = self.stubs.controller.CreateVolume(req).volume
        assert vol.volume_id, "CreateVolume returned an empty volume_id"
        self.volumes[vol.volume_id] = vol
        return vol

    def create_volume(self, name: str | None = None, **kwargs: Any) -> csi_pb2.Volume:
        return self.create(self.create_request(name, **kwargs))

    def delete_volume(self, volume_id: str) -> None:
        self.stubs.controller.DeleteVolume(csi_pb2.DeleteVolumeRequest(volume_id=volume_id))
        self.volumes.pop(volume_id, None)

    def create_snapshot(self, source_id: str, name: str | None = None) -> csi_pb2.Snapshot:
        snap: csi_pb2.Snapshot = self.stubs.controller.CreateSnapshot(
            csi_pb2.CreateSnapshotRequest(
                source_volume_id=source_id,
                name=name or self.name("snap"),
                parameters=self.cfg.snapshot_parameters,
            )
        ).snapshot
        assert snap.snapshot_id, "CreateSnapshot returned an empty snapshot_id"
        if snap.snapshot_id not in self.snapshots:
            self.snapshots.append(snap.snapshot_id)
        return snap

    def delete_snapshot(self, snapshot_id: str) -> None:
        self.stubs.controller.DeleteSnapshot(csi_pb2.DeleteSnapshotRequest(snapshot_id=snapshot_id))
        if snapshot_id in self.snapshots:
            self.snapshots.remove(snapshot_id)

    def group_snapshot_request(
        self, source_ids: list[str], name: str | None = None
    ) -> csi_pb2.CreateVolumeGroupSnapshotRequest:
        # --snapshot-parameters go to groups too: a plugin that needs parameters to snapshot
        # a volume is likely to need the same ones to snapshot several together.
        return csi_pb2.CreateVolumeGroupSnapshotRequest(
            name=name or self.name("group"),
            source_volume_ids=source_ids,
            parameters=self.cfg.snapshot_parameters,
        )

    def create_group(
        self, req: csi_pb2.CreateVolumeGroupSnapshotRequest
    ) -> csi_pb2.VolumeGroupSnapshot:
        group: csi_pb2.VolumeGroupSnapshot = self.stubs.group_controller.CreateVolumeGroupSnapshot(
            req).group_snapshot
        self.track_group(group)
        assert group.group_snapshot_id, "CreateVolumeGroupSnapshot returned no group_snapshot_id"
        return group

    def track_group(self, group: csi_pb2.VolumeGroupSnapshot) -> None:
        """Remember a group (and its members, for the delete request) for teardown."""
        if group.group_snapshot_id:
            self.group_snapshots[group.group_snapshot_id] = [
                s.snapshot_id for s in group.snapshots]

    def create_group_snapshot(
        self, source_ids: list[str], name: str | None = None
    ) -> csi_pb2.VolumeGroupSnapshot:
        return self.create_group(self.group_snapshot_request(source_ids, name))

    def delete_group_snapshot(self, group_id: str, snapshot_ids: list[str] | None = None) -> None:
        members = self.group_snapshots.get(group_id, []) if snapshot_ids is None else snapshot_ids
        self.stubs.group_controller.DeleteVolumeGroupSnapshot(
            csi_pb2.DeleteVolumeGroupSnapshotRequest(
                group_snapshot_id=group_id, snapshot_ids=members))
        self.group_snapshots.pop(group_id, None)

    # -- node
    def _attach(self, volume_id: str, cap: csi_pb2.VolumeCapability, readonly: bool) -> None:
        if not self.caps.ctrl("PUBLISH_UNPUBLISH_VOLUME") or volume_id in self.attached:
            return
        resp = self.stubs.controller.ControllerPublishVolume(
            csi_pb2.ControllerPublishVolumeRequest(
                volume_id=volume_id,
                node_id=self.node_id,
                volume_capability=cap,
                readonly=readonly,
                volume_context=self._context(volume_id),
            )
        )
        self.attached.append(volume_id)
        self.publish_context[volume_id] = dict(resp.publish_context)

    def _context(self, volume_id: str) -> dict[str, str]:
        vol = self.volumes.get(volume_id)
        return dict(vol.volume_context) if vol is not None else {}

    @property
    def stages(self) -> bool:
        return "STAGE_UNSTAGE_VOLUME" in self.caps.node

    def stage_request(
        self, volume_id: str, staging: str, cap: csi_pb2.VolumeCapability | None = None
    ) -> csi_pb2.NodeStageVolumeRequest:
        return csi_pb2.NodeStageVolumeRequest(
            volume_id=volume_id,
            staging_target_path=staging,
            volume_capability=cap or self.cap(),
            publish_context=self.publish_context.get(volume_id, {}),
            volume_context=self._context(volume_id),
        )

    def stage(self, volume_id: str, cap: csi_pb2.VolumeCapability | None = None) -> str:
        """ControllerPublish (if advertised) and NodeStage (if advertised); return staging path."""
        cap = cap or self.cap()
        self._attach(volume_id, cap, False)
        if not self.stages:
            return ""
        staging = self.staging_path()
        os.makedirs(staging, exist_ok=True)
        self.staged.append((volume_id, staging))
        self.stubs.node.NodeStageVolume(self.stage_request(volume_id, staging, cap))
        return staging

    def unstage(self, volume_id: str, staging: str) -> None:
        self.stubs.node.NodeUnstageVolume(
            csi_pb2.NodeUnstageVolumeRequest(volume_id=volume_id, staging_target_path=staging)
        )
        with contextlib.suppress(ValueError):
            self.staged.remove((volume_id, staging))

    def publish_request(
        self,
        volume_id: str,
        staging: str,
        target: str,
        readonly: bool = False,
        cap: csi_pb2.VolumeCapability | None = None,
    ) -> csi_pb2.NodePublishVolumeRequest:
        return csi_pb2.NodePublishVolumeRequest(
            volume_id=volume_id,
            staging_target_path=staging,
            target_path=target,
            volume_capability=cap or self.cap(),
            readonly=readonly,
            publish_context=self.publish_context.get(volume_id, {}),
            volume_context=self._context(volume_id),
        )

    def publish(
        self,
        volume_id: str,
        staging: str,
        readonly: bool = False,
        cap: csi_pb2.VolumeCapability | None = None,
        target: str | None = None,
    ) -> str:
        target = target or self.target_path()
        self.published.append((volume_id, target))
        self.stubs.node.NodePublishVolume(
            self.publish_request(volume_id, staging, target, readonly, cap)
        )
        return target

    def unpublish(self, volume_id: str, target: str) -> None:
        self.stubs.node.NodeUnpublishVolume(
            csi_pb2.NodeUnpublishVolumeRequest(volume_id=volume_id, target_path=target)
        )
        with contextlib.suppress(ValueError):
            self.published.remove((volume_id, target))

    def make_available(
        self, volume_id: str, readonly: bool = False, cap: csi_pb2.VolumeCapability | None = None
    ) -> tuple[str, str]:
        staging = self.stage(volume_id, cap)
        return staging, self.publish(volume_id, staging, readonly, cap)

    def release(self, volume_id: str, staging: str, target: str) -> None:
        self.unpublish(volume_id, target)
        if staging:
            self.unstage(volume_id, staging)
        self.detach(volume_id)

    def detach(self, volume_id: str) -> None:
        if volume_id in self.attached:
            self.stubs.controller.ControllerUnpublishVolume(
                csi_pb2.ControllerUnpublishVolumeRequest(volume_id=volume_id, node_id=self.node_id)
            )
            self.attached.remove(volume_id)

    # -- teardown
    def cleanup(self) -> list[str]:
        errors: list[str] = []

        def attempt(what: str, fn: Callable[[], Any]) -> None:
            try:
                fn()
            except grpc.RpcError as err:
                errors.append(f"{what}: {err.code().name}: {err.details()}")
            except Exception as err:  # teardown must go on
                errors.append(f"{what}: {err!r}")

        for vol_id, target in reversed(list(self.published)):
            attempt(f"NodeUnpublishVolume {vol_id} {target}",
                    functools.partial(self.unpublish, vol_id, target))
        for vol_id, staging in reversed(list(self.staged)):
            attempt(f"NodeUnstageVolume {vol_id} {staging}",
                    functools.partial(self.unstage, vol_id, staging))
        for vol_id in reversed(list(self.attached)):
            attempt(f"ControllerUnpublishVolume {vol_id}", functools.partial(self.detach, vol_id))
        # Members of a group cannot be deleted alone (DeleteSnapshot gives INVALID_ARGUMENT),
        # so groups go first, as a whole.
        for group_id in reversed(list(self.group_snapshots)):
            attempt(f"DeleteVolumeGroupSnapshot {group_id}",
                    functools.partial(self.delete_group_snapshot, group_id))
        for snap_id in reversed(list(self.snapshots)):
            attempt(f"DeleteSnapshot {snap_id}", functools.partial(self.delete_snapshot, snap_id))
        for vol_id in reversed(list(self.volumes)):
            attempt(f"DeleteVolume {vol_id}", functools.partial(self.delete_volume, vol_id))
        for d in self.dirs:
            leftover = force_unmount_under(d)
            if leftover:
                errors.append(f"mounts left behind after teardown (force-unmounted): {leftover}")
            _remove_tree(d)
        return errors


def _remove_tree(path: Path) -> None:
    """Remove a scratch tree, but never descend into something still mounted."""
    if not path.exists() and not path.is_symlink():
        return
    if mounts_under(path):
        return
    for root, dirs, files in os.walk(path, topdown=False):
        for f in files:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(root, f))
        for d in dirs:
            p = os.path.join(root, d)
            with contextlib.suppress(OSError):
                if os.path.islink(p):
                    os.unlink(p)
                else:
                    os.rmdir(p)
    with contextlib.suppress(OSError):
        path.rmdir()


def remove_tree(path: Path) -> None:
    _remove_tree(path)


def list_all_volumes(stubs: Stubs, max_entries: int = 0) -> Iterator[list[str]]:
    """Yield pages of volume ids, following next_token."""
    token = ""
    while True:
        resp = stubs.controller.ListVolumes(
            csi_pb2.ListVolumesRequest(max_entries=max_entries, starting_token=token)
        )
        yield [e.volume.volume_id for e in resp.entries]
        token = resp.next_token
        if not token:
            return


def list_all_snapshots(
    stubs: Stubs, max_entries: int = 0, snapshot_id: str = "", source_volume_id: str = ""
) -> Iterator[list[str]]:
    token = ""
    while True:
        resp = stubs.controller.ListSnapshots(
            csi_pb2.ListSnapshotsRequest(
                max_entries=max_entries,
                starting_token=token,
                snapshot_id=snapshot_id,
                source_volume_id=source_volume_id,
            )
        )
        yield [e.snapshot.snapshot_id for e in resp.entries]
        token = resp.next_token
        if not token:
            return
