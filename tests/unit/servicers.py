"""The CSI servicers over a FakeHost: a Backend built as the plugin builds its
own, with every node-touching part faked, and a `call` that answers as the
wire would (the status code the server's interceptor would send, or the
reply). Used by the table-driven servicer tests.

The plugin reads LVM two ways: the VGs' committed metadata off their PVs
and device-mapper's status, without a process, whenever they answer; else
an LVM command (`lvs`). A node reads as READ_PATH says: "committed" (the
fake's PVs are listed and read) or "lvs" (no PV is listed: every read is
the fallback's). The `reads` fixture (conftest.py) runs a test on both."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import grpc
import pytest

from csi_local._gen import csi_pb2 as pb
from csi_local.config import Config
from csi_local.csi.controller_servicer import ControllerServicer
from csi_local.csi.dependencies import Backend
from csi_local.csi.node_servicer import NodeServicer
from csi_local.csi.pagination import Paginator
from csi_local.csi.rpc import RpcError, status_of
from csi_local.errors import StorageError
from csi_local.host import crypt
from csi_local.host import filesystem_rules as fsrules
from csi_local.host.filesystems import Filesystems
from csi_local.host.locks import Locks
from csi_local.nodestate.state_file import StateStore
from csi_local.storage.committed_vg import CommittedMetadata
from csi_local.volumes import naming
from csi_local.volumes.device_classes import parse_classes
from csi_local.volumes.pool import PoolPolicy, Pools
from tests.unit.fakehost import FakeHost, GiB, MiB

VG, POOL = "vg0", "pool0"
# Three device classes on two VGs; vg-hdd holds the pools of two of them.
THREE_CLASSES = """\
default = "fast"

[classes.fast]
volume_group = "vg-nvme"
thin_pool = "pool"

[classes.big]
volume_group = "vg-hdd"
thin_pool = "pool"
overprovision_ratio = 2.0

[classes.cold]
volume_group = "vg-hdd"
thin_pool = "cold"
"""
Mode = pb.VolumeCapability.AccessMode
READS = ("committed", "lvs")
READ_PATH = "committed"  # how a new node reads LVM (see above)
__all__ = ["READS", "THREE_CLASSES", "GiB", "MiB", "Node", "Setup", "block_cap", "call", "chain",
           "make_class_node", "make_node", "mount_cap", "nothing", "vol_id"]


@dataclass
class Node:
    """One node: its fake host, its backend and both servicers."""

    host: FakeHost
    backend: Backend
    controller: ControllerServicer
    node: NodeServicer
    root: Path  # where staging and target directories go

    @property
    def state(self) -> StateStore:
        return self.backend.state

    def path(self, *parts: str) -> str:
        """A path under the node's directory (not created)."""
        return str(self.root.joinpath(*parts))


def make_node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *, ratio: float = 1.0,
              pool_size: int = 10 * GiB, node_expansion_only: bool = False,
              policy: PoolPolicy | None = None, modify_validate_only: bool = False,
              **host_args: Any) -> Node:
    """A node whose VG `vg0` has a 10 GiB thin pool `pool0` (4 MiB extents)."""
    # mkfs.* presence is a property of the real machine; the fake has them all.
    monkeypatch.setattr(fsrules, "mkfs_available", lambda fs: True)
    host = FakeHost(vg=VG, pool=POOL, pool_size=pool_size, **host_args)
    monkeypatch.setattr(crypt, "persistent_flags", host.luks_flags)  # the fake's headers
    config = Config(endpoint=f"unix://{tmp_path}/csi.sock", node_id="node-1",
                    volume_group=VG, thin_pool=POOL, state_dir=str(tmp_path / "state"),
                    lock_dir=str(tmp_path / "locks"), overprovision_ratio=ratio,
                    node_expansion_only=node_expansion_only,
                    modify_validate_only=modify_validate_only)
    return _node(tmp_path, host, config, policy)


def _node(tmp_path: Path, host: FakeHost, config: Config, policy: PoolPolicy | None) -> Node:
    """The node of `config` on `host`, its pools reading as READ_PATH says, and
    started as the plugin starts (its one `pvs`, the VGs' metadata parsed)."""
    host.pv_metadata = READ_PATH == "committed"
    locks = Locks(config.lock_dir, timeout=0.2)
    pools = Pools(config.classes, host, locks, policy,
                  committed=CommittedMetadata(host, host))
    pools.warm()
    host.calls.clear()
    backend = Backend(config=config, pools=pools, fs=Filesystems(host, host), host=host,
                      state=StateStore(config.state_dir), locks=locks,
                      paginator=Paginator(b"k" * 32), cgroups=host)
    root = tmp_path / "co"
    root.mkdir()
    return Node(host, backend, ControllerServicer(backend), NodeServicer(backend), root)


def make_class_node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, classes_toml: str, *,
                    pool_sizes: Mapping[str, int] | None = None,
                    extents: Mapping[str, int] | None = None, ratio: float = 1.0,
                    default_fs_type: str = "ext4", node_expansion_only: bool = False,
                    policy: PoolPolicy | None = None) -> Node:
    """A node with the device classes of `classes_toml`, built as the plugin builds
    one from --config: every class's VG and thin pool exist on the fake host
    (the first class's VG is the host's first VG, `host.lvs`).

    `pool_sizes`: bytes of each class's pool, by class name (10 GiB otherwise);
    `extents`: each VG's extent size, by VG name (4 MiB otherwise); `ratio` and
    `default_fs_type` are the flags, the defaults of classes that set none."""
    monkeypatch.setattr(fsrules, "mkfs_available", lambda fs: True)
    classes = parse_classes(classes_toml, source="classes.toml", overprovision_ratio=ratio,
                            default_fs_type=default_fs_type)
    sizes, extent_of = dict(pool_sizes or {}), dict(extents or {})
    first = classes.classes[0]
    host = FakeHost(vg=first.volume_group, pool=first.thin_pool,
                    pool_size=sizes.get(first.name, 10 * GiB),
                    extent=extent_of.get(first.volume_group, 4 * MiB))
    monkeypatch.setattr(crypt, "persistent_flags", host.luks_flags)  # the fake's headers
    for c in classes.classes[1:]:
        size = sizes.get(c.name, 10 * GiB)
        if c.volume_group not in host.vgs:
            host.add_vg(c.volume_group, pool=c.thin_pool, pool_size=size,
                        extent=extent_of.get(c.volume_group, 4 * MiB))
        else:
            host.add_pool(c.volume_group, c.thin_pool, size)
    for fvg in host.vgs.values():  # room for every pool, and 1 GiB more
        fvg.size = max(fvg.size, sum(p.size + p.metadata_size for p in fvg.pools) + GiB)
    config = Config(endpoint=f"unix://{tmp_path}/csi.sock", node_id="node-1",
                    device_classes=classes, state_dir=str(tmp_path / "state"),
                    lock_dir=str(tmp_path / "locks"), overprovision_ratio=ratio,
                    default_fs_type=default_fs_type, node_expansion_only=node_expansion_only)
    return _node(tmp_path, host, config, policy)


# The servicers never use their context (errors are raised, the interceptor sends
# them): a direct call passes none.
NO_CONTEXT = cast(grpc.ServicerContext, None)


def call(fn: Callable[[Any, Any], Any], request: Any) -> tuple[str, Any]:
    """("OK", reply), or (code, message) as the server's interceptor would send them."""
    method = getattr(fn, "__name__", "")
    try:
        return "OK", fn(request, None)
    except (RpcError, StorageError) as err:
        return status_of(method, err)


def mount_cap(fs: str = "ext4", mode: Mode.Mode.ValueType = Mode.SINGLE_NODE_WRITER,
              flags: tuple[str, ...] = ()) -> pb.VolumeCapability:
    return pb.VolumeCapability(mount=pb.VolumeCapability.MountVolume(fs_type=fs,
                                                                    mount_flags=flags),
                               access_mode=Mode(mode=mode))


def block_cap(mode: Mode.Mode.ValueType = Mode.SINGLE_NODE_WRITER) -> pb.VolumeCapability:
    return pb.VolumeCapability(block=pb.VolumeCapability.BlockVolume(),
                               access_mode=Mode(mode=mode))


def vol_id(name: str) -> str:
    """The volume ID CreateVolume gives the name `name`."""
    return naming.volume_id_for(name)


# A table row's fake state: steps run on the node before the request.
Setup = Callable[[Node], object]


def chain(*steps: Setup) -> Setup:
    """The steps, in order."""
    def run(n: Node) -> None:
        for step in steps:
            step(n)
    return run


def nothing(n: Node) -> None:
    """No setup."""
