"""Placement over several device classes (volumes/placement.py), one table run
through both front ends: the CSI plugin's CreateVolume and CreateSnapshot,
csi-local-dhv's create (its source named by ID, and by name) and snapshot
create.

Each row is a node state and a create; what must happen is the same for
both front ends (a volume made in a class, an existing one met again, or a
refusal of a kind), and only the words and the code differ (WORDS). A
refusal changes no LV. The rows marked "changed" are where a front end did
otherwise before the rule was shared (CHANGELOG.md, Unreleased).

The classes: fast (VG nvme, pool thin; the default) and big (VG hdd, pool
pool). VG hdd also holds pool `old`, a class since removed from the file.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import pytest

from csi_local._gen import csi_pb2 as pb
from csi_local.dhv.config import PluginConfig
from csi_local.dhv.request import DhvError, lv_name_for, snapshot_lv_name
from csi_local.errors import AmbiguousName, StorageError, VolumeGroupMissing
from csi_local.volumes import naming, placement
from csi_local.volumes.host_volume_names import TAG_FRESH, snapshot_tags, volume_tags
from csi_local.volumes.naming import Source, SourceKind
from tests.unit.dhvnode import DhvNode
from tests.unit.fakehost import FakeHost, GiB, MiB
from tests.unit.servicers import Node, call, make_class_node, mount_cap

CLASSES = """\
default = "fast"

[classes.fast]
volume_group = "nvme"
thin_pool = "thin"

[classes.big]
volume_group = "hdd"
thin_pool = "pool"
"""
POOLS = {"fast": ("nvme", "thin"), "big": ("hdd", "pool")}
REMOVED = ("hdd", "old")  # a thin pool of no class
SIZE = 512 * MiB

# The create's volume and the clone's source, as each front end names them.
CSI_NEW, CSI_SRC = naming.volume_id_for("new"), naming.volume_id_for("src")
DHV_NEW, DHV_SRC, DHV_SRC_NAME = "vol-1", "golden-1", "golden"
SNAP = "snap"  # the snapshot's name, in both (of the source volume)
CSI_SNAP, DHV_SNAP = naming.snapshot_id_for(SNAP), snapshot_lv_name(SNAP)


class Front(Protocol):
    @property
    def host(self) -> FakeHost: ...

    def lv_name(self, role: str) -> str: ...
    def put(self, role: str, where: tuple[str, str]) -> None: ...
    def create(self, cls: str | None, clone: bool) -> tuple[str, str]: ...
    def snapshot(self, cls: str | None) -> tuple[str, str]: ...


@dataclass
class Csi:
    n: Node

    @property
    def host(self) -> FakeHost:
        return self.n.host

    def lv_name(self, role: str) -> str:
        return {"volume": CSI_NEW, "source": CSI_SRC, "snapshot": CSI_SNAP}[role]

    def put(self, role: str, where: tuple[str, str]) -> None:
        """An LV as CreateVolume or CreateSnapshot leaves it."""
        vg, pool = where
        if role == "snapshot":
            self.host.add_lv(CSI_SNAP, GiB, vg=vg, pool=pool, active=False, skip=True, tags=[
                f"{naming.TAG_KIND}={naming.KIND_SNAPSHOT}",
                Source(SourceKind.VOLUME, CSI_SRC).tag()])
            return
        self.host.add_lv(self.lv_name(role), GiB, vg=vg, pool=pool, fs="ext4", tags=[
            f"{naming.TAG_KIND}={naming.KIND_VOLUME}", f"{naming.TAG_SIZE}={GiB}"])

    def create(self, cls: str | None, clone: bool) -> tuple[str, str]:
        source = pb.VolumeContentSource(volume=pb.VolumeContentSource.VolumeSource(
            volume_id=CSI_SRC)) if clone else None
        code, answer = call(self.n.controller.CreateVolume, pb.CreateVolumeRequest(
            name="new", volume_capabilities=[mount_cap()],
            parameters={} if cls is None else {"deviceClass": cls},
            volume_content_source=source))
        return code, "" if code == "OK" else str(answer)

    def snapshot(self, cls: str | None) -> tuple[str, str]:
        code, answer = call(self.n.controller.CreateSnapshot, pb.CreateSnapshotRequest(
            name=SNAP, source_volume_id=CSI_SRC,
            parameters={} if cls is None else {"deviceClass": cls}))
        return code, "" if code == "OK" else str(answer)


@dataclass
class Dhv:
    n: DhvNode
    by: str  # how a clone names its source: "id" or "name"

    @property
    def host(self) -> FakeHost:
        return self.n.host

    def lv_name(self, role: str) -> str:
        return DHV_SNAP if role == "snapshot" else lv_name_for(
            DHV_NEW if role == "volume" else DHV_SRC)

    def put(self, role: str, where: tuple[str, str]) -> None:
        """An LV as a finished create (formatted, so no fresh tag) or snapshot
        create leaves it."""
        vg, pool = where
        if role == "snapshot":
            self.host.add_lv(DHV_SNAP, GiB, vg=vg, pool=pool, active=False, skip=True,
                             tags=snapshot_tags(SNAP, DHV_SRC, "ext4", "default"))
            return
        vid, name = (DHV_NEW, DHV_NEW) if role == "volume" else (DHV_SRC, DHV_SRC_NAME)
        tags = [t for t in volume_tags(vid, name, "default", "ext4") if t != TAG_FRESH]
        self.host.add_lv(self.lv_name(role), GiB, vg=vg, pool=pool, fs="ext4", tags=tags)

    def create(self, cls: str | None, clone: bool) -> tuple[str, str]:
        params = {} if cls is None else {"device_class": cls}
        if clone:
            params["source_volume"] = DHV_SRC if self.by == "id" else DHV_SRC_NAME
        try:
            self.n.create(DHV_NEW, params=params)
        except DhvError as err:
            return "refused", str(err)
        except StorageError as err:
            return "refused", err.message
        return "OK", ""

    def snapshot(self, cls: str | None) -> tuple[str, str]:
        try:
            self.n.plugin().snapshot_create(DHV_SRC, SNAP, cls)
        except DhvError as err:
            return "refused", str(err)
        except StorageError as err:
            return "refused", err.message
        return "OK", ""


def csi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Front:
    n = make_class_node(tmp_path, monkeypatch, CLASSES)
    n.host.add_pool(*REMOVED, GiB)
    return Csi(n)


def dhv(by: str) -> Callable[[Path, pytest.MonkeyPatch], Front]:
    def build(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Front:
        host = FakeHost("nvme", "thin", pool_size=4 * GiB)
        host.add_vg("hdd", pool="pool", pool_size=4 * GiB)
        host.add_pool(*REMOVED, GiB)
        classes = tmp_path / "classes.toml"
        classes.write_text(CLASSES)
        config = PluginConfig(classes_file=str(classes), lock_dir=str(tmp_path / "locks"))
        node = DhvNode(host, config, tmp_path)
        node.cap_min = SIZE
        return Dhv(node, by)
    return build


FRONTS = {"csi": csi, "dhv-source-by-id": dhv("id"), "dhv-source-by-name": dhv("name")}

# Each refusal's words, by front end: (code, a piece of the message); the
# host volume plugin's code is always "refused" (a JSON error for Nomad).
WORDS: dict[str, dict[str, tuple[str, str]]] = {
    "missing-vg": {"csi": ("UNAVAILABLE", "volume group hdd not found"),
                   "dhv": ("refused", "volume group hdd not found: volume vol-1")},
    "several": {"csi": ("FAILED_PRECONDITION", "volume 'new' has LVs in several volume groups"),
                "dhv": ("refused", "volume vol-1 has an LV in several volume groups")},
    "no-class": {"csi": ("ALREADY_EXISTS", f"maps to LV hdd/{CSI_NEW}, in thin pool hdd/old, "
                                           "which is no device class of this node"),
                 "dhv": ("refused", "in thin pool hdd/old, which is no device class")},
    "class": {"csi": ("ALREADY_EXISTS", "exists in device class 'big', not in 'fast'"),
              "dhv": ("refused", "exists in device class 'big', not 'fast'")},
    "source-no-class": {"csi": ("INVALID_ARGUMENT", "in thin pool hdd/old, which is no device "
                                                    "class of this node"),
                        "dhv": ("refused", "in thin pool hdd/old, which is no device class "
                                           "of this node")},
    "source-several": {"csi": ("FAILED_PRECONDITION", f"volume {CSI_SRC} has LVs in several "
                                                      "volume groups"),
                       "dhv": ("refused", "has an LV in several volume groups"),
                       # by name, the name's resolution refuses first (two volumes of it)
                       "dhv-source-by-name": ("refused", "source_volume 'golden' names 2 host "
                                                         "volumes")},
    # snapshots
    "snapshot-missing-vg": {"csi": ("UNAVAILABLE", f"volume group hdd not found: {CSI_SNAP}"),
                            "dhv": ("refused", "volume group hdd not found: the volume or a "
                                               "snapshot of that name may be there")},
    "snapshot-several": {"csi": ("FAILED_PRECONDITION", "snapshot 'snap' has LVs in several "
                                                        "volume groups"),
                         "dhv": ("refused", "snapshot 'snap' has an LV in several volume "
                                            "groups")},
    "snapshot-no-class": {"csi": ("ALREADY_EXISTS", "in thin pool hdd/old, which is no device "
                                                    "class of this node"),
                          "dhv": ("refused", "in thin pool hdd/old, which is no device class "
                                             "of this node")},
    "snapshot-source-no-class": {"csi": ("INVALID_ARGUMENT", "in thin pool hdd/old, which is "
                                                             "no device class of this node"),
                                 "dhv": ("refused", "in thin pool hdd/old, which is no device "
                                                    "class of this node")},
    "snapshot-source-several": {"csi": ("FAILED_PRECONDITION", f"volume {CSI_SRC} has LVs in "
                                                               "several volume groups"),
                                "dhv": ("refused", "host volume 'golden-1' has an LV in "
                                                   "several volume groups")},
}


@dataclass(frozen=True)
class Row:
    id: str
    cls: str | None  # the class the create names
    want: str  # "made in CLASS", "met", or a refusal's kind (WORDS)
    put: tuple[tuple[str, tuple[str, str]], ...] = ()  # (role, (VG, pool)) of LVs
    gone: tuple[str, ...] = ()  # VGs missing
    clone: bool = False  # of the source volume
    snapshot: bool = False  # a snapshot of the source volume, not a create
    changed: tuple[str, ...] = field(default=(), compare=False)  # front ends that did otherwise


FAST, BIG = POOLS["fast"], POOLS["big"]

ROWS = [
    Row("new-volume", "fast", "made in fast"),
    Row("retry-in-its-class-in-another-vg", "big", "met", put=(("volume", BIG),)),
    Row("retry-naming-another-class", "fast", "class", put=(("volume", BIG),)),
    Row("clone-follows-its-source", None, "made in big", put=(("source", BIG),), clone=True),
    # A VG the node has had is missing: the name may be there.
    Row("new-volume-while-another-class-vg-missing", "fast", "missing-vg", gone=("hdd",),
        changed=("csi",)),
    Row("clone-while-another-class-vg-missing", None, "missing-vg",
        put=(("source", FAST),), gone=("hdd",), clone=True, changed=("csi",)),
    Row("retry-found-while-another-class-vg-missing", "fast", "met",
        put=(("volume", FAST),), gone=("hdd",)),
    # One name, two LVs: neither is the volume.
    Row("name-in-two-vgs", "fast", "several", put=(("volume", FAST), ("volume", BIG)),
        changed=("csi",)),
    # An LV of the name in a class since removed: refused, never a second one made.
    Row("name-in-a-removed-class", "fast", "no-class", put=(("volume", REMOVED),),
        changed=("csi",)),
    # A source in a removed class: refused as such, not "not found".
    Row("source-in-a-removed-class", None, "source-no-class", put=(("source", REMOVED),),
        clone=True, changed=("csi",)),
    Row("source-in-two-vgs", None, "source-several", put=(("source", FAST), ("source", BIG)),
        clone=True, changed=("csi", "dhv-source-by-id")),
    # Snapshots (of the source volume), by the same rule.
    Row("snapshot-of-a-big-volume", None, "made in big", put=(("source", BIG),),
        snapshot=True),
    Row("snapshot-retry-in-another-vg", None, "met",
        put=(("source", BIG), ("snapshot", BIG)), snapshot=True),
    Row("snapshot-while-another-class-vg-missing", None, "snapshot-missing-vg",
        put=(("source", FAST),), gone=("hdd",), snapshot=True, changed=("csi",)),
    Row("snapshot-retry-while-another-class-vg-missing", None, "met",
        put=(("source", FAST), ("snapshot", FAST)), gone=("hdd",), snapshot=True),
    Row("snapshot-name-in-two-vgs", None, "snapshot-several",
        put=(("source", FAST), ("snapshot", FAST), ("snapshot", BIG)), snapshot=True,
        changed=("csi", "dhv")),
    Row("snapshot-name-in-a-removed-class", None, "snapshot-no-class",
        put=(("source", FAST), ("snapshot", REMOVED)), snapshot=True, changed=("csi",)),
    Row("snapshot-source-in-a-removed-class", None, "snapshot-source-no-class",
        put=(("source", REMOVED),), snapshot=True, changed=("csi", "dhv")),
    Row("snapshot-source-in-two-vgs", None, "snapshot-source-several",
        put=(("source", FAST), ("source", BIG)), snapshot=True, changed=("csi", "dhv")),
]


def lvs(front: Front) -> dict[tuple[str, str], tuple[int, frozenset[str], str]]:
    return {key: (lv.size, frozenset(lv.tags), lv.pool)
            for key, lv in front.host.all_lvs().items()}


def cases() -> list[object]:
    """Each row on each front end; a snapshot row once on csi-local-dhv (its
    source is named by ID)."""
    return [pytest.param(row, front, id=f"{row.id}-{front}") for row in ROWS
            for front in FRONTS if not (row.snapshot and front == "dhv-source-by-name")]


@pytest.mark.parametrize(("row", "front_name"), cases())
def test_placement(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, row: Row,
                   front_name: str) -> None:
    front = FRONTS[front_name](tmp_path, monkeypatch)
    for role, where in row.put:
        front.put(role, where)
    for vg in row.gone:
        front.host.set_vg_present(vg, False)
    before = lvs(front)
    front.host.calls.clear()
    code, message = (front.snapshot(row.cls) if row.snapshot
                     else front.create(row.cls, row.clone))
    name = front.lv_name("snapshot" if row.snapshot else "volume")
    if row.want == "met":
        assert code == "OK", message
        assert front.host.commands("lvcreate") == []
        assert {k for k in lvs(front) if k[1] == name} == {k for k in before if k[1] == name}
    elif row.want.startswith("made in "):
        assert code == "OK", message
        vg, pool = POOLS[row.want.removeprefix("made in ")]
        assert [(k, lv.pool) for k, lv in front.host.all_lvs().items() if k[1] == name] == [
            ((vg, name), pool)]
    else:
        words = WORDS[row.want]
        want_code, says = words.get(front_name, words[front_name.split("-")[0]])
        assert (code, says in message) == (want_code, True), message
        assert lvs(front) == before  # a refusal makes, changes and removes nothing
        assert {c[0] for c in front.host.calls} <= {"lvs"}, front.host.calls


# the rule itself, on what one read saw -----------------------------------------------------


def _lv(vg: str, pool: str, name: str = "x") -> object:
    return type("Lv", (), {"vg": vg, "pool": pool, "name": name})()


@pytest.mark.parametrize("lvs,missing,want", [
    pytest.param([], [], "new", id="nowhere"),
    pytest.param([("fast", _lv("nvme", "thin"))], [], "nvme", id="one"),
    pytest.param([(None, _lv("hdd", "old"))], [], "hdd", id="one-in-no-class"),
    pytest.param([("fast", _lv("nvme", "thin"))], ["hdd"], "nvme", id="one-other-vg-missing"),
    pytest.param([], ["hdd"], "VolumeGroupMissing", id="nowhere-a-vg-missing"),
    pytest.param([("fast", _lv("nvme", "thin")), ("big", _lv("hdd", "pool"))], [],
                 "AmbiguousName nvme/x, hdd/x", id="two-vgs"),
    pytest.param([("fast", _lv("nvme", "thin")), (None, _lv("hdd", "old"))], ["vg9"],
                 "AmbiguousName nvme/x, hdd/x", id="two-vgs-one-in-no-class"),
    pytest.param([("fast", _lv("nvme", "thin", "y"))], ["hdd"], "VolumeGroupMissing",
                 id="another-name-only"),
])
def test_existing(lvs: list[tuple[object, object]], missing: list[str], want: str) -> None:
    seen = placement.Seen(lvs, missing)  # type: ignore[arg-type]  # stand-ins: vg, pool, name
    try:
        found = placement.existing(seen, "x")
    except AmbiguousName as err:
        got = f"AmbiguousName {', '.join(err.lvs)}"
    except VolumeGroupMissing:
        got = "VolumeGroupMissing"
    else:
        got = "new" if found is None else found[1].vg
    assert got == want
