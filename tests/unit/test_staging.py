"""The node side's volume layer (volumes/staging.py), called directly.

tests/unit/test_node.py runs every branch through the servicer and checks
each code; here, the layer's own contract: what it refuses, it refuses with
a storage error that names no code (csi/rpc.py gives the code), and a
repeated stage is checked against the record alone."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from csi_local._gen import csi_pb2 as pb
from csi_local.errors import (
    AccessTypeMismatch,
    LvNotFound,
    NotAtPath,
    NotStaged,
    StorageError,
    UsedDifferently,
    VolumeInUse,
    WriterTaken,
)
from csi_local.volumes import naming
from csi_local.volumes.node_records import AccessType, Staging
from csi_local.volumes.staging import PublishRequest, Stager, StageRequest, check_restage
from tests.unit.servicers import GiB, Node, chain, make_node, nothing, vol_id

V = vol_id("vol")
SNW = pb.VolumeCapability.AccessMode.SINGLE_NODE_WRITER
SSW = pb.VolumeCapability.AccessMode.SINGLE_NODE_SINGLE_WRITER
MOUNT, BLOCK = AccessType.MOUNT, AccessType.BLOCK


def req(path: str = "/s", access: AccessType = MOUNT, fs: str = "",
        flags: tuple[str, ...] = ()) -> StageRequest:
    return StageRequest(V, path, access, fs, flags, SNW, None)


@pytest.mark.parametrize("staged,again,says", [
    pytest.param(Staging("/s", MOUNT, "ext4"), req(), None, id="same-class-default"),
    pytest.param(Staging("/s", MOUNT, "ext4"), req(fs="ext4"), None, id="same-fs-named"),
    pytest.param(Staging("/s", MOUNT, "xfs"), req(fs="ext4"), "with another capability",
                 id="other-fs-named"),
    pytest.param(Staging("/s", MOUNT, "xfs"), req(), None, id="fs-left-to-the-class"),
    pytest.param(Staging("/s", MOUNT, "ext4"), req("/t"), "is already staged at /s",
                 id="other-path"),
    pytest.param(Staging("/s", BLOCK), req(), "with another capability", id="other-access"),
    pytest.param(Staging("/s", MOUNT, "ext4", ("noatime",)), req(), "with another capability",
                 id="other-flags"),
    pytest.param(Staging("/s", MOUNT, "ext4", ("noatime",), flags_known=False), req(), None,
                 id="flags-unknown"),
])
def test_a_repeated_stage(staged: Staging, again: StageRequest, says: str | None) -> None:
    if says is None:
        check_restage(staged, again)
        return
    with pytest.raises(UsedDifferently, match=says):
        check_restage(staged, again)


# the layer's refusals, each a storage error -----------------------------------------------


def stager(n: Node) -> Stager:
    return n.node.volumes


def at(n: Node, name: str) -> str:
    return os.path.realpath(n.path(name))


def made(n: Node) -> None:
    n.host.add_lv(V, GiB, tags=[f"{naming.TAG_KIND}={naming.KIND_VOLUME}"])


def staged(n: Node) -> None:
    made(n)
    stager(n).stage(StageRequest(V, at(n, "stage"), MOUNT, "", (), SNW, None))


Step = Callable[[Node], object]


def pub(target: str = "target", access: AccessType = MOUNT, mode: int = SNW,
        readonly: bool = False) -> Step:
    return lambda n: stager(n).publish(PublishRequest(
        V, at(n, target), at(n, "stage"), access, (), mode, readonly))


ROWS: list[tuple[str, Step, Step, type[StorageError], str]] = [
    ("stage-missing-volume", nothing,
     lambda n: stager(n).stage(StageRequest(V, at(n, "stage"), MOUNT, "", (), SNW, None)),
     LvNotFound, "not found"),
    ("stage-elsewhere", staged,
     lambda n: stager(n).stage(StageRequest(V, at(n, "stage2"), MOUNT, "", (), SNW, None)),
     UsedDifferently, "is already staged at"),
    ("unstage-while-published", chain(staged, pub()),
     lambda n: stager(n).unstage(V, at(n, "stage")), VolumeInUse, "still published at"),
    ("unstage-elsewhere", staged, lambda n: stager(n).unstage(V, at(n, "stage2")),
     NotAtPath, "is staged at"),
    ("publish-before-stage", made, pub(), NotStaged, "is not staged at"),
    ("publish-other-access", staged, pub(access=BLOCK), AccessTypeMismatch,
     "is staged as mount, not block"),
    ("publish-differently-again", chain(staged, pub()), pub(readonly=True),
     UsedDifferently, "differently"),
    ("publish-second-writer", chain(staged, pub(mode=SSW)), pub("target2"),
     WriterTaken, "already has a writer at"),
    ("stats-elsewhere", staged, lambda n: stager(n).stats(V, at(n, "stage2"), "stage2"),
     NotAtPath, "not staged or published at 'stage2'"),
    ("stats-no-path", staged, lambda n: stager(n).stats(V, None, "rel"),
     NotAtPath, "at 'rel'"),
    ("expand-no-path", staged, lambda n: stager(n).expand(V, None, "rel", None, None),
     NotAtPath, "at 'rel'"),
]


@pytest.mark.parametrize("setup,call,error,says",
                         [pytest.param(*row[1:], id=row[0]) for row in ROWS])
def test_refused_with_a_storage_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                      setup: Step, call: Step, error: type[StorageError],
                                      says: str) -> None:
    n = make_node(tmp_path, monkeypatch)
    setup(n)
    before = n.state.all()
    with pytest.raises(StorageError) as err:
        call(n)
    assert type(err.value) is error, err.value  # never an RpcError: no code below the edge
    assert says in err.value.message
    assert n.state.all() == before  # a refusal records nothing
