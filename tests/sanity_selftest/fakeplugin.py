"""A small, honest CSI plugin used to test the sanity suite itself.

Volumes are sparse files under --workdir. Mount access: mkfs on the file, ``mount -o loop``
at NodeStage, bind mount at NodePublish. Block access: a loop device (losetup) at NodeStage,
bind-mounted onto a file at NodePublish. Snapshots are sparse file copies (``cp
--sparse=always``, so blocks of zeros and discarded blocks become holes).

Group snapshots copy every member in turn; the fake does not hold writes back meanwhile, so
its groups are not write-order consistent (the suite cannot observe that from outside).

Snapshot metadata is computed from the snapshot files in 64 KiB blocks: a block is allocated
when it holds data (SEEK_DATA), and changed between two snapshots when its contents differ
(a block that is a hole in one and data in the other differs too). GetMetadataAllocated
answers in FIXED_LENGTH blocks and GetMetadataDelta in VARIABLE_LENGTH runs of blocks, so
that the suite sees both styles.

``--break NAME`` introduces exactly one defect:
  required-field        CreateVolume does not check volume_capabilities
  retry-id              a retried CreateVolume creates a new volume with a different ID
  leak-mount            NodeUnstageVolume reports success but leaves the staging mount behind
  wrong-restore         CreateVolume from a snapshot copies the source volume's current data
  cbt-ignores-offset    GetMetadataAllocated/Delta ignore starting_offset
  cbt-misses-range      GetMetadataAllocated/Delta leave out the last range
  cbt-max-results       GetMetadataAllocated/Delta ignore max_results
  cbt-delta-allocated   GetMetadataDelta returns the target's allocated blocks, not changes
  group-not-idempotent  a repeated CreateVolumeGroupSnapshot makes a new group
  field-order           NodePublishVolume answers FAILED_PRECONDITION for a missing
                        staging_target_path before it checks volume_capability
  modify-unknown        ControllerModifyVolume accepts a mutable parameter it does not know

Its one mutable parameter (MODIFY_VOLUME) is ``tier``; it is only recorded.

Run: fakeplugin.py --endpoint unix:///tmp/x.sock --workdir DIR [--break NAME]
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))
from csi_local._gen import csi_pb2, csi_pb2_grpc

BREAKS = ("required-field", "retry-id", "leak-mount", "wrong-restore", "cbt-ignores-offset",
          "cbt-misses-range", "cbt-max-results", "cbt-delta-allocated", "group-not-idempotent",
          "field-order", "modify-unknown")
MUTABLE = frozenset({"tier"})
DEFAULT_SIZE = 64 << 20
CBT_BLOCK = 64 << 10
CBT_RESULTS = 16  # tuples per message when max_results is 0: streams of several messages
MODES = {"SINGLE_NODE_WRITER", "SINGLE_NODE_READER_ONLY", "SINGLE_NODE_SINGLE_WRITER",
         "SINGLE_NODE_MULTI_WRITER"}
Code = grpc.StatusCode


class Abort(Exception):
    def __init__(self, code: grpc.StatusCode, msg: str) -> None:
        super().__init__(msg)
        self.code = code
        self.msg = msg


def need(value: Any, what: str) -> None:
    if not value:
        raise Abort(Code.INVALID_ARGUMENT, f"{what} is required")


def run(*args: str) -> str:
    proc = subprocess.run(list(args), capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise Abort(Code.INTERNAL, f"{' '.join(args)}: {proc.stderr.strip()}")
    return proc.stdout.strip()


def mount_source(path: str) -> str:
    real = os.path.realpath(path)
    with open("/proc/self/mountinfo", encoding="utf-8") as fh:
        for line in fh:
            parts = line.split()
            if parts[4] == real:
                return parts[parts.index("-") + 2]
    raise Abort(Code.INTERNAL, f"{path} is not mounted")


def is_mounted(path: str) -> bool:
    real = os.path.realpath(path)
    with open("/proc/self/mountinfo", encoding="utf-8") as fh:
        return any(line.split()[4] == real for line in fh)


@dataclass
class Volume:
    id: str
    name: str
    path: Path
    size: int
    source: str = ""
    formatted: bool = False


@dataclass
class Snapshot:
    id: str
    name: str
    source: str
    path: Path
    size: int
    created: float
    formatted: bool
    group: str = ""


@dataclass
class Group:
    id: str
    name: str
    sources: list[str]
    members: list[str]
    created: float


@dataclass
class Stage:
    volume_id: str
    cap: csi_pb2.VolumeCapability
    loop: str = ""


@dataclass
class Publication:
    volume_id: str
    staging: str
    readonly: bool
    cap: csi_pb2.VolumeCapability
    ro_loop: str = ""


@dataclass
class State:
    workdir: Path
    broken: str
    lock: threading.RLock = field(default_factory=threading.RLock)
    volumes: dict[str, Volume] = field(default_factory=dict)
    names: dict[str, str] = field(default_factory=dict)
    snapshots: dict[str, Snapshot] = field(default_factory=dict)
    snap_names: dict[str, str] = field(default_factory=dict)
    groups: dict[str, Group] = field(default_factory=dict)
    group_names: dict[str, str] = field(default_factory=dict)
    staged: dict[str, Stage] = field(default_factory=dict)  # by staging path
    published: dict[str, Publication] = field(default_factory=dict)  # by target path


def guarded(fn: Any) -> Any:
    def wrapper(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            with self.s.lock:
                return fn(self, request, context)
        except Abort as err:
            context.abort(err.code, err.msg)
    wrapper.__name__ = fn.__name__
    return wrapper


def access_type(cap: csi_pb2.VolumeCapability) -> str:
    return "block" if cap.HasField("block") else "mount"


def check_cap(cap: csi_pb2.VolumeCapability) -> None:
    if not cap.HasField("access_mode"):
        raise Abort(Code.INVALID_ARGUMENT, "volume_capability.access_mode is required")
    if cap.WhichOneof("access_type") is None:
        raise Abort(Code.INVALID_ARGUMENT, "volume_capability access_type is required")
    mode = csi_pb2.VolumeCapability.AccessMode.Mode.Name(cap.access_mode.mode)
    if mode not in MODES:
        raise Abort(Code.INVALID_ARGUMENT, f"access mode {mode} not supported")
    if cap.HasField("mount") and cap.mount.fs_type not in ("", "ext4"):
        raise Abort(Code.INVALID_ARGUMENT, f"fs_type {cap.mount.fs_type} not supported")


def page(ids: list[str], prefix: str, max_entries: int, token: str) -> tuple[list[str], str]:
    """Stable paging: the token is the last ID returned, IDs are walked in sorted order."""
    ids = sorted(ids)
    if token:
        if not token.startswith(prefix):
            raise Abort(Code.ABORTED, f"invalid starting_token {token!r}")
        ids = [i for i in ids if i > token[len(prefix):]]
    if max_entries < 0:
        raise Abort(Code.INVALID_ARGUMENT, "max_entries must not be negative")
    if max_entries and len(ids) > max_entries:
        ids = ids[:max_entries]
        return ids, prefix + ids[-1]
    return ids, ""


class Identity(csi_pb2_grpc.IdentityServicer):
    def __init__(self, s: State) -> None:
        self.s = s

    def GetPluginInfo(self, request: Any, context: Any) -> Any:
        return csi_pb2.GetPluginInfoResponse(name="fake.sanity.csi-local.example",
                                             vendor_version="0.0.1")

    def GetPluginCapabilities(self, request: Any, context: Any) -> Any:
        pc = csi_pb2.PluginCapability
        return csi_pb2.GetPluginCapabilitiesResponse(capabilities=[
            pc(service=pc.Service(type=pc.Service.CONTROLLER_SERVICE)),
            pc(service=pc.Service(type=pc.Service.GROUP_CONTROLLER_SERVICE)),
            pc(service=pc.Service(type=pc.Service.SNAPSHOT_METADATA_SERVICE)),
            pc(volume_expansion=pc.VolumeExpansion(type=pc.VolumeExpansion.ONLINE)),
            pc(volume_expansion=pc.VolumeExpansion(type=pc.VolumeExpansion.OFFLINE)),
        ])

    def Probe(self, request: Any, context: Any) -> Any:
        return csi_pb2.ProbeResponse()


CTRL_CAPS = ["CREATE_DELETE_VOLUME", "LIST_VOLUMES", "GET_CAPACITY", "CREATE_DELETE_SNAPSHOT",
             "LIST_SNAPSHOTS", "CLONE_VOLUME", "EXPAND_VOLUME", "GET_VOLUME", "GET_SNAPSHOT",
             "SINGLE_NODE_MULTI_WRITER", "VOLUME_CONDITION", "MODIFY_VOLUME"]
NODE_CAPS = ["STAGE_UNSTAGE_VOLUME", "GET_VOLUME_STATS", "EXPAND_VOLUME",
             "SINGLE_NODE_MULTI_WRITER", "VOLUME_CONDITION"]


class Controller(csi_pb2_grpc.ControllerServicer):
    def __init__(self, s: State) -> None:
        self.s = s

    # Not offered (no PUBLISH_UNPUBLISH_VOLUME capability):
    # UNIMPLEMENTED, as the generated base class answers, spelled out because
    # the typed stubs declare every method abstract.
    def ControllerPublishVolume(self, request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(Code.UNIMPLEMENTED, "ControllerPublishVolume is not supported")

    def ControllerUnpublishVolume(self, request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(Code.UNIMPLEMENTED, "ControllerUnpublishVolume is not supported")

    def _check_mutable(self, params: Any) -> None:
        unknown = sorted(set(params) - MUTABLE)
        if unknown and self.s.broken != "modify-unknown":
            raise Abort(Code.INVALID_ARGUMENT, f"unknown mutable parameters: {unknown}")

    @guarded
    def ControllerModifyVolume(self, request: Any, context: Any) -> Any:
        need(request.volume_id, "volume_id")
        self._check_mutable(request.mutable_parameters)
        self._vol(request.volume_id)
        return csi_pb2.ControllerModifyVolumeResponse()

    def ControllerGetCapabilities(self, request: Any, context: Any) -> Any:
        t = csi_pb2.ControllerServiceCapability
        return csi_pb2.ControllerGetCapabilitiesResponse(capabilities=[
            t(rpc=t.RPC(type=t.RPC.Type.Value(n))) for n in CTRL_CAPS])

    def _vol(self, vid: str) -> Volume:
        vol = self.s.volumes.get(vid)
        if vol is None:
            raise Abort(Code.NOT_FOUND, f"volume {vid} not found")
        return vol

    def _msg(self, v: Volume) -> csi_pb2.Volume:
        msg = csi_pb2.Volume(volume_id=v.id, capacity_bytes=v.size)
        if v.source.startswith("snap:"):
            msg.content_source.snapshot.snapshot_id = v.source[5:]
        elif v.source.startswith("vol:"):
            msg.content_source.volume.volume_id = v.source[4:]
        return msg

    @guarded
    def CreateVolume(self, request: Any, context: Any) -> Any:
        need(request.name, "name")
        if self.s.broken != "required-field":
            need(len(request.volume_capabilities), "volume_capabilities")
        for cap in request.volume_capabilities:
            check_cap(cap)
        self._check_mutable(request.mutable_parameters)
        req, lim = request.capacity_range.required_bytes, request.capacity_range.limit_bytes
        if req < 0 or lim < 0 or (lim and req > lim):
            raise Abort(Code.OUT_OF_RANGE, f"bad capacity range {req}..{lim}")
        size = req or (min(lim, DEFAULT_SIZE) if lim else DEFAULT_SIZE)
        src_kind = request.volume_content_source.WhichOneof("type")
        source = ""
        copy_from: Path | None = None
        if src_kind == "snapshot":
            sid = request.volume_content_source.snapshot.snapshot_id
            snap = self.s.snapshots.get(sid)
            if snap is None:
                raise Abort(Code.NOT_FOUND, f"snapshot {sid} not found")
            if lim and lim < snap.size:
                raise Abort(Code.OUT_OF_RANGE, "volume smaller than the snapshot")
            size = max(size, snap.size)
            source, copy_from = "snap:" + sid, snap.path
            if self.s.broken == "wrong-restore" and snap.source in self.s.volumes:
                copy_from = self.s.volumes[snap.source].path
        elif src_kind == "volume":
            vid = request.volume_content_source.volume.volume_id
            src = self._vol(vid)
            if lim and lim < src.size:
                raise Abort(Code.OUT_OF_RANGE, "volume smaller than the source")
            size = max(size, src.size)
            source, copy_from = "vol:" + vid, src.path
        existing = self.s.names.get(request.name)
        if existing is not None and self.s.broken != "retry-id":
            v = self.s.volumes[existing]
            if v.size < req or (lim and v.size > lim) or v.source != source:
                raise Abort(Code.ALREADY_EXISTS, f"volume {request.name} exists, incompatible")
            return csi_pb2.CreateVolumeResponse(volume=self._msg(v))
        vid = "vol-" + uuid.uuid4().hex[:16]
        path = self.s.workdir / "volumes" / vid
        formatted = False
        if copy_from is not None:
            run("cp", "--sparse=always", str(copy_from), str(path))
        with open(path, "ab") as fh:
            fh.truncate(max(size, path.stat().st_size))
        if src_kind == "snapshot":
            formatted = self.s.snapshots[source[5:]].formatted
        elif src_kind == "volume":
            formatted = self.s.volumes[source[4:]].formatted
        v = Volume(vid, request.name, path, size, source, formatted)
        self.s.volumes[vid] = v
        self.s.names[request.name] = vid
        return csi_pb2.CreateVolumeResponse(volume=self._msg(v))

    @guarded
    def DeleteVolume(self, request: Any, context: Any) -> Any:
        need(request.volume_id, "volume_id")
        v = self.s.volumes.pop(request.volume_id, None)
        if v is not None:
            if self.s.names.get(v.name) == v.id:
                del self.s.names[v.name]
            v.path.unlink(missing_ok=True)
        return csi_pb2.DeleteVolumeResponse()

    @guarded
    def ValidateVolumeCapabilities(self, request: Any, context: Any) -> Any:
        need(request.volume_id, "volume_id")
        need(len(request.volume_capabilities), "volume_capabilities")
        self._vol(request.volume_id)
        try:
            for cap in request.volume_capabilities:
                check_cap(cap)
        except Abort as err:
            return csi_pb2.ValidateVolumeCapabilitiesResponse(message=err.msg)
        return csi_pb2.ValidateVolumeCapabilitiesResponse(
            confirmed=csi_pb2.ValidateVolumeCapabilitiesResponse.Confirmed(
                volume_capabilities=request.volume_capabilities))

    def _status(self) -> Any:
        return {"volume_condition": csi_pb2.VolumeCondition(abnormal=False, message="ok")}

    @guarded
    def ListVolumes(self, request: Any, context: Any) -> Any:
        ids, token = page(list(self.s.volumes), "v1:", request.max_entries,
                          request.starting_token)
        E = csi_pb2.ListVolumesResponse.Entry
        return csi_pb2.ListVolumesResponse(next_token=token, entries=[
            E(volume=self._msg(self.s.volumes[i]),
              status=csi_pb2.ListVolumesResponse.VolumeStatus(**self._status())) for i in ids])

    @guarded
    def ControllerGetVolume(self, request: Any, context: Any) -> Any:
        need(request.volume_id, "volume_id")
        v = self._vol(request.volume_id)
        return csi_pb2.ControllerGetVolumeResponse(
            volume=self._msg(v),
            status=csi_pb2.ControllerGetVolumeResponse.VolumeStatus(**self._status()))

    @guarded
    def GetCapacity(self, request: Any, context: Any) -> Any:
        st = os.statvfs(self.s.workdir)
        return csi_pb2.GetCapacityResponse(available_capacity=st.f_bavail * st.f_frsize)

    def _snap_msg(self, sn: Snapshot) -> csi_pb2.Snapshot:
        msg = csi_pb2.Snapshot(snapshot_id=sn.id, source_volume_id=sn.source,
                               size_bytes=sn.size, ready_to_use=True, group_snapshot_id=sn.group)
        msg.creation_time.FromNanoseconds(int(sn.created * 1e9))
        return msg

    @guarded
    def CreateSnapshot(self, request: Any, context: Any) -> Any:
        need(request.source_volume_id, "source_volume_id")
        need(request.name, "name")
        existing = self.s.snap_names.get(request.name)
        if existing is not None:
            sn = self.s.snapshots[existing]
            if sn.source != request.source_volume_id:
                raise Abort(Code.ALREADY_EXISTS, f"snapshot {request.name} has another source")
            return csi_pb2.CreateSnapshotResponse(snapshot=self._snap_msg(sn))
        v = self._vol(request.source_volume_id)
        sn = self.take_snapshot(v, request.name)
        return csi_pb2.CreateSnapshotResponse(snapshot=self._snap_msg(sn))

    def take_snapshot(self, v: Volume, name: str, group: str = "") -> Snapshot:
        sid = "snap-" + uuid.uuid4().hex[:16]
        path = self.s.workdir / "snapshots" / sid
        os.sync()
        run("cp", "--sparse=always", str(v.path), str(path))
        sn = Snapshot(sid, name, v.id, path, v.size, time.time(), v.formatted, group)
        self.s.snapshots[sid] = sn
        self.s.snap_names[name] = sid
        return sn

    def drop_snapshot(self, sn: Snapshot) -> None:
        self.s.snapshots.pop(sn.id, None)
        self.s.snap_names.pop(sn.name, None)
        sn.path.unlink(missing_ok=True)

    @guarded
    def DeleteSnapshot(self, request: Any, context: Any) -> Any:
        need(request.snapshot_id, "snapshot_id")
        sn = self.s.snapshots.get(request.snapshot_id)
        if sn is not None:
            if sn.group:
                raise Abort(Code.INVALID_ARGUMENT,
                            f"snapshot {sn.id} is part of group snapshot {sn.group}")
            self.drop_snapshot(sn)
        return csi_pb2.DeleteSnapshotResponse()

    @guarded
    def ListSnapshots(self, request: Any, context: Any) -> Any:
        snaps = [s for s in self.s.snapshots.values()
                 if (not request.snapshot_id or s.id == request.snapshot_id)
                 and (not request.source_volume_id or s.source == request.source_volume_id)]
        ids, token = page([s.id for s in snaps], "s1:", request.max_entries,
                          request.starting_token)
        E = csi_pb2.ListSnapshotsResponse.Entry
        return csi_pb2.ListSnapshotsResponse(next_token=token, entries=[
            E(snapshot=self._snap_msg(self.s.snapshots[i])) for i in ids])

    @guarded
    def GetSnapshot(self, request: Any, context: Any) -> Any:
        need(request.snapshot_id, "snapshot_id")
        sn = self.s.snapshots.get(request.snapshot_id)
        if sn is None:
            raise Abort(Code.NOT_FOUND, f"snapshot {request.snapshot_id} not found")
        return csi_pb2.GetSnapshotResponse(snapshot=self._snap_msg(sn))

    @guarded
    def ControllerExpandVolume(self, request: Any, context: Any) -> Any:
        need(request.volume_id, "volume_id")
        need(request.HasField("capacity_range"), "capacity_range")
        v = self._vol(request.volume_id)
        new = request.capacity_range.required_bytes
        if new > v.size:
            with open(v.path, "ab") as fh:
                fh.truncate(new)
            v.size = new
        return csi_pb2.ControllerExpandVolumeResponse(capacity_bytes=v.size,
                                                      node_expansion_required=True)


class Node(csi_pb2_grpc.NodeServicer):
    def __init__(self, s: State) -> None:
        self.s = s

    def NodeGetCapabilities(self, request: Any, context: Any) -> Any:
        t = csi_pb2.NodeServiceCapability
        return csi_pb2.NodeGetCapabilitiesResponse(capabilities=[
            t(rpc=t.RPC(type=t.RPC.Type.Value(n))) for n in NODE_CAPS])

    def NodeGetInfo(self, request: Any, context: Any) -> Any:
        return csi_pb2.NodeGetInfoResponse(node_id="fake-node")

    def _vol(self, vid: str) -> Volume:
        v = self.s.volumes.get(vid)
        if v is None:
            raise Abort(Code.NOT_FOUND, f"volume {vid} not found")
        return v

    @guarded
    def NodeStageVolume(self, request: Any, context: Any) -> Any:
        need(request.volume_id, "volume_id")
        need(request.staging_target_path, "staging_target_path")
        need(request.HasField("volume_capability"), "volume_capability")
        check_cap(request.volume_capability)
        v = self._vol(request.volume_id)
        path = request.staging_target_path
        cur = self.s.staged.get(path)
        if cur is not None:
            if cur.volume_id == v.id and cur.cap == request.volume_capability:
                return csi_pb2.NodeStageVolumeResponse()
            raise Abort(Code.ALREADY_EXISTS, f"{path} is staged differently")
        stage = Stage(v.id, request.volume_capability)
        if access_type(request.volume_capability) == "block":
            stage.loop = run("losetup", "-f", "--show", str(v.path))
        else:
            if not v.formatted:
                run("mkfs.ext4", "-F", "-q", str(v.path))
                v.formatted = True
            run("mount", "-o", "loop", str(v.path), path)
        self.s.staged[path] = stage
        return csi_pb2.NodeStageVolumeResponse()

    @guarded
    def NodeUnstageVolume(self, request: Any, context: Any) -> Any:
        need(request.volume_id, "volume_id")
        need(request.staging_target_path, "staging_target_path")
        stage = self.s.staged.pop(request.staging_target_path, None)
        if stage is None or self.s.broken == "leak-mount":
            return csi_pb2.NodeUnstageVolumeResponse()
        if stage.loop:
            run("losetup", "-d", stage.loop)
        elif is_mounted(request.staging_target_path):
            run("umount", request.staging_target_path)
        return csi_pb2.NodeUnstageVolumeResponse()

    @guarded
    def NodePublishVolume(self, request: Any, context: Any) -> Any:
        need(request.volume_id, "volume_id")
        need(request.target_path, "target_path")
        if self.s.broken == "field-order" and not request.staging_target_path:
            raise Abort(Code.FAILED_PRECONDITION, "staging_target_path not set")
        need(request.HasField("volume_capability"), "volume_capability")
        check_cap(request.volume_capability)
        if not request.staging_target_path:
            raise Abort(Code.FAILED_PRECONDITION, "staging_target_path not set")
        v = self._vol(request.volume_id)
        target = request.target_path
        stage = self.s.staged.get(request.staging_target_path)
        if stage is None or stage.volume_id != v.id:
            raise Abort(Code.FAILED_PRECONDITION, "volume is not staged there")
        cur = self.s.published.get(target)
        if cur is not None:
            if (cur.volume_id, cur.readonly, cur.cap) == (
                    v.id, request.readonly, request.volume_capability):
                return csi_pb2.NodePublishVolumeResponse()
            raise Abort(Code.ALREADY_EXISTS, f"{target} is published differently")
        mode = request.volume_capability.access_mode.mode
        if mode == csi_pb2.VolumeCapability.AccessMode.SINGLE_NODE_SINGLE_WRITER and any(
                p.volume_id == v.id for p in self.s.published.values()):
            raise Abort(Code.FAILED_PRECONDITION, "single writer volume is already published")
        pub = Publication(v.id, request.staging_target_path, request.readonly,
                          request.volume_capability)
        if stage.loop:
            Path(target).touch()
            dev = stage.loop
            if request.readonly:
                pub.ro_loop = dev = run("losetup", "-r", "-f", "--show", str(v.path))
            run("mount", "--bind", dev, target)
        else:
            os.makedirs(target, exist_ok=True)
            run("mount", "--bind", request.staging_target_path, target)
            if request.readonly:
                run("mount", "-o", "remount,bind,ro", target)
        self.s.published[target] = pub
        return csi_pb2.NodePublishVolumeResponse()

    @guarded
    def NodeUnpublishVolume(self, request: Any, context: Any) -> Any:
        need(request.volume_id, "volume_id")
        need(request.target_path, "target_path")
        pub = self.s.published.pop(request.target_path, None)
        if pub is None:
            return csi_pb2.NodeUnpublishVolumeResponse()
        if is_mounted(request.target_path):
            run("umount", request.target_path)
        if pub.ro_loop:
            run("losetup", "-d", pub.ro_loop)
        p = Path(request.target_path)
        if p.is_dir():
            p.rmdir()
        else:
            p.unlink(missing_ok=True)
        return csi_pb2.NodeUnpublishVolumeResponse()

    def _where(self, vid: str, path: str) -> Stage:
        v = self._vol(vid)
        pub = self.s.published.get(path)
        if pub is not None and pub.volume_id == v.id:
            return self.s.staged[pub.staging]
        stage = self.s.staged.get(path)
        if stage is not None and stage.volume_id == v.id:
            return stage
        raise Abort(Code.NOT_FOUND, f"volume {vid} is not at {path}")

    @guarded
    def NodeGetVolumeStats(self, request: Any, context: Any) -> Any:
        need(request.volume_id, "volume_id")
        need(request.volume_path, "volume_path")
        stage = self._where(request.volume_id, request.volume_path)
        U = csi_pb2.VolumeUsage
        cond = csi_pb2.VolumeCondition(abnormal=False, message="ok")
        if stage.loop:
            size = int(run("blockdev", "--getsize64", stage.loop))
            return csi_pb2.NodeGetVolumeStatsResponse(
                usage=[U(total=size, unit=U.BYTES)], volume_condition=cond)
        st = os.statvfs(request.volume_path)
        return csi_pb2.NodeGetVolumeStatsResponse(volume_condition=cond, usage=[
            U(total=st.f_blocks * st.f_frsize, available=st.f_bavail * st.f_frsize,
              used=(st.f_blocks - st.f_bfree) * st.f_frsize, unit=U.BYTES),
            U(total=st.f_files, available=st.f_favail, used=st.f_files - st.f_ffree,
              unit=U.INODES)])

    @guarded
    def NodeExpandVolume(self, request: Any, context: Any) -> Any:
        need(request.volume_id, "volume_id")
        need(request.volume_path, "volume_path")
        stage = self._where(request.volume_id, request.volume_path)
        v = self._vol(request.volume_id)
        if stage.loop:
            run("losetup", "-c", stage.loop)
        else:
            staging = next(p for p, s in self.s.staged.items() if s is stage)
            dev = mount_source(staging)
            run("losetup", "-c", dev)
            run("resize2fs", dev)
        return csi_pb2.NodeExpandVolumeResponse(capacity_bytes=v.size)


class GroupController(csi_pb2_grpc.GroupControllerServicer):
    def __init__(self, s: State, ctrl: Controller) -> None:
        self.s = s
        self.ctrl = ctrl

    def GroupControllerGetCapabilities(self, request: Any, context: Any) -> Any:
        t = csi_pb2.GroupControllerServiceCapability
        return csi_pb2.GroupControllerGetCapabilitiesResponse(capabilities=[
            t(rpc=t.RPC(type=t.RPC.CREATE_DELETE_GET_VOLUME_GROUP_SNAPSHOT))])

    def _msg(self, g: Group) -> csi_pb2.VolumeGroupSnapshot:
        msg = csi_pb2.VolumeGroupSnapshot(
            group_snapshot_id=g.id, ready_to_use=True,
            snapshots=[self.ctrl._snap_msg(self.s.snapshots[i]) for i in g.members])
        msg.creation_time.FromNanoseconds(int(g.created * 1e9))
        return msg

    def _group(self, gid: str, snapshot_ids: list[str]) -> Group | None:
        g = self.s.groups.get(gid)
        if g is not None and sorted(snapshot_ids) != sorted(g.members):
            raise Abort(Code.INVALID_ARGUMENT,
                        f"snapshot_ids {list(snapshot_ids)} are not the members of {gid}")
        return g

    @guarded
    def CreateVolumeGroupSnapshot(self, request: Any, context: Any) -> Any:
        need(request.name, "name")
        need(len(request.source_volume_ids), "source_volume_ids")
        sources = list(request.source_volume_ids)
        existing = self.s.group_names.get(request.name)
        if existing is not None and self.s.broken != "group-not-idempotent":
            g = self.s.groups[existing]
            if sorted(g.sources) != sorted(sources):
                raise Abort(Code.ALREADY_EXISTS, f"group {request.name} has other volumes")
            return csi_pb2.CreateVolumeGroupSnapshotResponse(group_snapshot=self._msg(g))
        if len(set(sources)) != len(sources):
            raise Abort(Code.INVALID_ARGUMENT, "a volume is listed twice")
        vols = [self.ctrl._vol(v) for v in sources]  # all checked before any snapshot is cut
        gid = "group-" + uuid.uuid4().hex[:16]
        members = [self.ctrl.take_snapshot(v, f"{gid}/{v.id}", gid).id for v in vols]
        g = Group(gid, request.name, sources, members, time.time())
        self.s.groups[gid] = g
        self.s.group_names[request.name] = gid
        return csi_pb2.CreateVolumeGroupSnapshotResponse(group_snapshot=self._msg(g))

    @guarded
    def DeleteVolumeGroupSnapshot(self, request: Any, context: Any) -> Any:
        need(request.group_snapshot_id, "group_snapshot_id")
        g = self._group(request.group_snapshot_id, list(request.snapshot_ids))
        if g is not None:
            for sid in g.members:
                self.ctrl.drop_snapshot(self.s.snapshots[sid])
            del self.s.groups[g.id]
            if self.s.group_names.get(g.name) == g.id:
                del self.s.group_names[g.name]
        return csi_pb2.DeleteVolumeGroupSnapshotResponse()

    @guarded
    def GetVolumeGroupSnapshot(self, request: Any, context: Any) -> Any:
        need(request.group_snapshot_id, "group_snapshot_id")
        g = self._group(request.group_snapshot_id, list(request.snapshot_ids))
        if g is None:
            raise Abort(Code.NOT_FOUND, f"group snapshot {request.group_snapshot_id} not found")
        return csi_pb2.GetVolumeGroupSnapshotResponse(group_snapshot=self._msg(g))


def data_extents(path: Path, size: int) -> list[tuple[int, int]]:
    """The file's data (not hole) ranges, from SEEK_DATA/SEEK_HOLE."""
    out: list[tuple[int, int]] = []
    fd = os.open(path, os.O_RDONLY)
    try:
        pos = 0
        while pos < size:
            try:
                start = os.lseek(fd, pos, os.SEEK_DATA)
            except OSError as err:
                if err.errno == errno.ENXIO:  # no data after pos
                    break
                raise
            pos = os.lseek(fd, start, os.SEEK_HOLE)
            out.append((start, min(pos, size)))
    finally:
        os.close(fd)
    return [e for e in out if e[0] < e[1]]


def blocks_of(extents: list[tuple[int, int]]) -> set[int]:
    return {b for s, e in extents for b in range(s // CBT_BLOCK, (e - 1) // CBT_BLOCK + 1)}


def changed_blocks(base: Snapshot, target: Snapshot) -> list[int]:
    candidates = blocks_of(data_extents(base.path, base.size)) | blocks_of(
        data_extents(target.path, target.size))
    changed = []
    with open(base.path, "rb") as a, open(target.path, "rb") as b:
        for blk in sorted(candidates):
            off = blk * CBT_BLOCK
            if os.pread(a.fileno(), CBT_BLOCK, off) != os.pread(b.fileno(), CBT_BLOCK, off):
                changed.append(blk)
    return changed


def runs(blocks: list[int], size: int) -> list[tuple[int, int]]:
    """Contiguous blocks merged into (offset, length) ranges, cut at the volume's end."""
    out: list[list[int]] = []
    for blk in sorted(blocks):
        if out and out[-1][1] == blk:
            out[-1][1] = blk + 1
        else:
            out.append([blk, blk + 1])
    return [(s * CBT_BLOCK, min(e * CBT_BLOCK, size) - s * CBT_BLOCK) for s, e in out]


class SnapshotMetadata(csi_pb2_grpc.SnapshotMetadataServicer):
    def __init__(self, s: State) -> None:
        self.s = s

    def _snap(self, sid: str) -> Snapshot:
        sn = self.s.snapshots.get(sid)
        if sn is None:
            raise Abort(Code.NOT_FOUND, f"snapshot {sid} not found")
        return sn

    def _stream(self, response: Any, kind: int, size: int, ranges: list[tuple[int, int]],
                start: int, max_results: int) -> list[Any]:
        if max_results < 0:
            raise Abort(Code.INVALID_ARGUMENT, "max_results must not be negative")
        if start < 0 or start > size:
            raise Abort(Code.OUT_OF_RANGE, f"starting_offset {start} outside [0, {size}]")
        if self.s.broken == "cbt-misses-range":
            ranges = ranges[:-1]
        if self.s.broken != "cbt-ignores-offset":
            ranges = [r for r in ranges if r[0] + r[1] > start]
        per = max_results or CBT_RESULTS
        if self.s.broken == "cbt-max-results":
            per = CBT_RESULTS
        BM = csi_pb2.BlockMetadata
        return [response(block_metadata_type=kind, volume_capacity_bytes=size,
                         block_metadata=[BM(byte_offset=o, size_bytes=n)
                                         for o, n in ranges[i:i + per]])
                for i in range(0, len(ranges), per)]

    def _allocated(self, sn: Snapshot) -> tuple[int, list[tuple[int, int]]]:
        blocks = sorted(blocks_of(data_extents(sn.path, sn.size)))
        if sn.size % CBT_BLOCK == 0:
            return csi_pb2.FIXED_LENGTH, [(b * CBT_BLOCK, CBT_BLOCK) for b in blocks]
        return csi_pb2.VARIABLE_LENGTH, runs(blocks, sn.size)

    @guarded
    def GetMetadataAllocated(self, request: Any, context: Any) -> Any:
        need(request.snapshot_id, "snapshot_id")
        sn = self._snap(request.snapshot_id)
        kind, ranges = self._allocated(sn)
        return iter(self._stream(csi_pb2.GetMetadataAllocatedResponse, kind, sn.size, ranges,
                                 request.starting_offset, request.max_results))

    @guarded
    def GetMetadataDelta(self, request: Any, context: Any) -> Any:
        need(request.base_snapshot_id, "base_snapshot_id")
        need(request.target_snapshot_id, "target_snapshot_id")
        base = self._snap(request.base_snapshot_id)
        target = self._snap(request.target_snapshot_id)
        if base.source != target.source:
            raise Abort(Code.INVALID_ARGUMENT, "the snapshots are of different volumes")
        if target.created < base.created:
            raise Abort(Code.INVALID_ARGUMENT, "the target snapshot is older than the base")
        if self.s.broken == "cbt-delta-allocated":
            ranges = runs(sorted(blocks_of(data_extents(target.path, target.size))),
                          target.size)
        else:
            ranges = runs(changed_blocks(base, target), target.size)
        return iter(self._stream(csi_pb2.GetMetadataDeltaResponse, csi_pb2.VARIABLE_LENGTH,
                                 target.size, ranges, request.starting_offset,
                                 request.max_results))


def cleanup(s: State) -> None:
    """Undo every publication and stage this process made (on shutdown)."""
    for target, pub in list(s.published.items()):
        with contextlib.suppress(Abort):
            if is_mounted(target):
                run("umount", "-l", target)
            if pub.ro_loop:
                run("losetup", "-d", pub.ro_loop)
    for path, stage in list(s.staged.items()):
        with contextlib.suppress(Abort):
            if stage.loop:
                run("losetup", "-d", stage.loop)
            elif is_mounted(path):
                run("umount", "-l", path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--endpoint", required=True)
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--break", dest="broken", choices=BREAKS, default="")
    ns = ap.parse_args()
    workdir = Path(ns.workdir)
    for sub in ("volumes", "snapshots"):
        (workdir / sub).mkdir(parents=True, exist_ok=True)
    state = State(workdir, ns.broken)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    csi_pb2_grpc.add_IdentityServicer_to_server(Identity(state), server)
    controller = Controller(state)
    csi_pb2_grpc.add_ControllerServicer_to_server(controller, server)
    csi_pb2_grpc.add_GroupControllerServicer_to_server(GroupController(state, controller), server)
    csi_pb2_grpc.add_SnapshotMetadataServicer_to_server(SnapshotMetadata(state), server)
    csi_pb2_grpc.add_NodeServicer_to_server(Node(state), server)
    sock = ns.endpoint.removeprefix("unix://")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(sock)
    server.add_insecure_port("unix://" + sock)
    server.start()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    print(f"fakeplugin listening on unix://{sock} break={ns.broken or 'none'}", flush=True)
    stop.wait()
    server.stop(grace=2).wait()
    with state.lock:
        cleanup(state)
    shutil.rmtree(workdir / "volumes", ignore_errors=True)
    shutil.rmtree(workdir / "snapshots", ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
