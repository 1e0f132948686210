"""The volume steps both plugins take (csi_local.volumes.lifecycle), step by
step over the in-memory host, with each plugin's tag names: flush, snapshot,
clone (and its failure paths: nothing half-made is left), the freshness
rule that decides what may be formatted, the first mount and the pending
grow. The plugins' own tests show the same steps through their RPCs and
verbs; these pin the rules themselves."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from csi_local.errors import CommandError, FormatRefused, NoRoom
from csi_local.host.filesystems import Filesystems
from csi_local.host.locks import Locks
from csi_local.storage.lvm import LogicalVolume, Lvm
from csi_local.volumes.lifecycle import CSI_TAGS, DHV_TAGS, StepTags, VolumeSteps
from csi_local.volumes.pool import Pool, PoolPolicy
from tests.unit.fakehost import FakeHost, GiB

SRC, NEW = "src", "new"
TAGS = [pytest.param(CSI_TAGS, id="csi"), pytest.param(DHV_TAGS, id="dhv")]


@dataclass
class Marks:
    """FormatMarks in memory (the CSI node's state file in production)."""

    marked: set[str] = field(default_factory=set)

    def formatting(self, lv_uuid: str) -> bool:
        return lv_uuid in self.marked

    def mark_formatting(self, lv_uuid: str) -> None:
        self.marked.add(lv_uuid)

    def clear_formatting(self, lv_uuid: str) -> None:
        self.marked.discard(lv_uuid)


@dataclass
class Rig:
    host: FakeHost
    pool: Pool
    steps: VolumeSteps
    marks: Marks
    root: Path

    @property
    def lvm(self) -> Lvm:
        return self.pool.lvm

    def lv(self, name: str) -> LogicalVolume:
        return self.lvm.get(name)

    def dir(self, name: str) -> str:
        path = self.root / name
        path.mkdir(exist_ok=True)
        return str(path)

    def mount(self, name: str, fs: str = "ext4") -> str:
        """LV `name` mounted (as a plugin left it) at a directory of its name."""
        opts = ["-o", "nouuid"] if fs == "xfs" else []
        self.host.run(["mount", "-t", fs, *opts, self.host.lv_path(name), self.dir(name)])
        return str(self.root / name)

    def tools(self) -> list[str]:
        return [c[0] for c in self.host.calls]


def rig(tmp_path: Path, tags: StepTags = CSI_TAGS, *, marks: bool = True,
        policy: PoolPolicy | None = None) -> Rig:
    host = FakeHost()
    pool = Pool(Lvm(host, "vg0", "pool0"), Locks(str(tmp_path / "locks"), timeout=0.2), 1.0,
                policy)
    store = Marks()
    steps = VolumeSteps(Filesystems(host, host), host, tags, store if marks else None)
    root = tmp_path / "mnt"
    root.mkdir()
    return Rig(host, pool, steps, store, root)


def source(r: Rig, fs: str = "ext4", *, tags: tuple[str, ...] = (), mounted: bool = False,
           size: int = GiB) -> LogicalVolume:
    r.host.add_lv(SRC, size, tags=tags, fs=fs)
    r.host.lv(SRC).content.written = True
    if mounted:
        r.mount(SRC, fs)
    lv = r.lv(SRC)
    r.host.calls.clear()
    return lv


# flush ------------------------------------------------------------------------------


def _mounted_twice(r: Rig) -> None:
    r.mount(SRC)
    r.host.run(["mount", "--bind", str(r.root / SRC), r.dir("other")])


def _node_bound(r: Rig) -> None:
    """A raw block volume: its device node bound onto a file, no file system."""
    target = Path(r.dir("blk")) / "dev"
    target.touch()
    r.host.run(["mount", "--bind", r.host.lv_path(SRC), str(target)])


@pytest.mark.parametrize(("setup", "synced"), [
    pytest.param(lambda r: None, False, id="not-mounted"),
    pytest.param(lambda r: r.mount(SRC), True, id="mounted"),
    pytest.param(_mounted_twice, True, id="mounted-twice-synced-once"),
    pytest.param(_node_bound, False, id="raw-block-node-bind-only"),
])
def test_flush(tmp_path: Path, setup: Callable[[Rig], object], synced: bool) -> None:
    """syncfs once for a mounted source's file system; nothing for a source
    without one (an inactive LV, a raw block volume's node bind)."""
    r = rig(tmp_path)
    r.host.add_lv(SRC, GiB, fs="ext4")
    setup(r)
    r.host.calls.clear()
    r.steps.flush(r.lv(SRC))
    syncs = r.host.commands("sync")
    assert syncs == ([("sync", "--file-system", str(r.root / SRC))] if synced else [])


def test_flush_of_an_inactive_lv_reads_nothing(tmp_path: Path) -> None:
    r = rig(tmp_path)
    r.host.add_lv(SRC, GiB, fs="ext4", active=False)
    lv = r.lv(SRC)
    r.host.calls.clear()
    r.host.mounts = lambda: pytest.fail("the mount table was read")  # type: ignore[method-assign]
    r.steps.flush(lv)
    assert r.host.calls == []


# snapshot ---------------------------------------------------------------------------


@pytest.mark.parametrize("tags", TAGS)
@pytest.mark.parametrize("grow_pending", [False, True])
def test_snapshot(tmp_path: Path, tags: StepTags, grow_pending: bool) -> None:
    """Read-only, flushed first, and carrying a grow-fs tag its clones need."""
    r = rig(tmp_path, tags)
    src = source(r, tags=(tags.grow_fs,) if grow_pending else (), mounted=True)
    with r.pool.reserved() as report:
        snap = r.steps.snapshot(r.pool, report, src, NEW, ["kind=snapshot"])
    made = r.host.lv(NEW)
    assert made.origin == SRC and not made.active and made.skip
    assert made.tags == {"kind=snapshot"} | ({tags.grow_fs} if grow_pending else set())
    assert snap.name == NEW
    tools = r.tools()
    assert tools.index("sync") < tools.index("lvcreate")


def test_snapshot_refused_above_the_mark_makes_and_flushes_nothing(tmp_path: Path) -> None:
    r = rig(tmp_path, policy=PoolPolicy(data_limit=50))
    src = source(r, mounted=True)
    r.host.lv("pool0").data_percent = 60.0
    with pytest.raises(NoRoom), r.pool.reserved() as report:
        r.steps.snapshot(r.pool, report, src, NEW, [])
    assert NEW not in r.host.lvs and "sync" not in r.tools()


# clone ------------------------------------------------------------------------------


@pytest.mark.parametrize("tags", TAGS)
@pytest.mark.parametrize("fs", ["ext4", "xfs", "btrfs"])
@pytest.mark.parametrize(("size", "carried", "grows"), [
    pytest.param(GiB, False, False, id="same-size"),
    pytest.param(2 * GiB, False, True, id="extended"),
    pytest.param(GiB, True, True, id="source-fs-not-grown-yet"),
])
def test_clone(tmp_path: Path, tags: StepTags, fs: str, size: int, carried: bool,
               grows: bool) -> None:
    """A writable thin snapshot at the asked size; every clone, whatever its
    file system, is tagged new-fsid (one rule for both plugins), and grow-fs
    when it outgrows its source or its source's file system is not grown."""
    r = rig(tmp_path, tags)
    src = source(r, fs, tags=(tags.grow_fs,) if carried else (), mounted=True)
    with r.pool.reserved() as report:
        lv = r.steps.clone(r.pool, report, src, NEW, ["kind=volume"], size)
    made = r.host.lv(NEW)
    assert (made.origin, made.active, made.size, lv.size) == (SRC, True, size, size)
    assert made.tags == {"kind=volume", tags.new_fsid} | ({tags.grow_fs} if grows else set())
    assert made.content.fs == fs  # the source's file system, never formatted
    tools = r.tools()
    assert tools.index("sync") < tools.index("lvcreate")
    assert tools.count("lvextend") == (1 if size > src.size else 0)


def test_clone_extend_fails_removes_the_snapshot(tmp_path: Path) -> None:
    r = rig(tmp_path)
    src = source(r)
    r.host.fail_next(("lvextend",), 5, "  boom\n")
    with pytest.raises(CommandError, match="lvextend exited 5"), \
            r.pool.reserved() as report:
        r.steps.clone(r.pool, report, src, NEW, [], 2 * GiB)
    assert NEW not in r.host.lvs  # no stray LV
    assert r.tools()[-3:] == ["lvcreate", "lvextend", "lvremove"]


def test_clone_without_room_makes_and_flushes_nothing(tmp_path: Path) -> None:
    r = rig(tmp_path)
    src = source(r, mounted=True)
    with pytest.raises(NoRoom), r.pool.reserved() as report:
        r.steps.clone(r.pool, report, src, NEW, [], 20 * GiB)  # the pool has 10 GiB
    assert NEW not in r.host.lvs and r.tools() == ["lvs"]


# freshness and formatting -------------------------------------------------------------


def _unknown(r: Rig) -> None:
    r.host.thin_status_error = True  # a failed pool: no count


@dataclass(frozen=True)
class Fresh:
    """One case of the formatting rule: a new LV, what it holds and what marks it."""

    id: str
    fresh_tag: bool = False
    marked: bool = False
    written: bool = False  # maps blocks, though blkid finds nothing
    fs: str | None = None  # what is on it already
    mapping_unknown: bool = False
    # expected
    formats: bool = False
    refused: bool = False
    probes: bool = True


FRESH = [
    Fresh("maps-nothing-formatted-without-a-probe", formats=True, probes=False),
    Fresh("maps-nothing-with-fresh-tag", fresh_tag=True, formats=True, probes=False),
    Fresh("written-blank-never-formatted", written=True, refused=True),
    Fresh("written-blank-fresh-tag-formatted", written=True, fresh_tag=True, formats=True),
    Fresh("written-blank-mark-formatted", written=True, marked=True, formats=True),
    Fresh("holds-ext4-kept", fs="ext4"),
    Fresh("holds-ext4-fresh-tag-kept", fs="ext4", fresh_tag=True),
    # The kernel's count cannot be read: nothing proves the volume empty, and
    # neither a tag nor a mark is trusted (the host volume plugin formatted on
    # its tag alone; the CSI node on its mark alone).
    Fresh("count-unknown-blank-refused", mapping_unknown=True, refused=True),
    Fresh("count-unknown-fresh-tag-refused", mapping_unknown=True, fresh_tag=True,
          refused=True),
    Fresh("count-unknown-mark-refused", mapping_unknown=True, marked=True, refused=True),
    Fresh("count-unknown-holds-ext4-kept", mapping_unknown=True, fs="ext4"),
]


@pytest.mark.parametrize("tags", TAGS)
@pytest.mark.parametrize("case", FRESH, ids=lambda c: c.id)
def test_format_once(tmp_path: Path, tags: StepTags, case: Fresh) -> None:
    r = rig(tmp_path, tags)
    r.host.add_lv(NEW, GiB, tags=[tags.fresh] if case.fresh_tag else [], fs=case.fs)
    r.host.lv(NEW).content.written = case.written
    lv = r.lv(NEW)
    if case.marked:
        r.marks.mark_formatting(lv.uuid)
    if case.mapping_unknown:
        _unknown(r)
    r.host.calls.clear()
    if case.refused:
        with pytest.raises(FormatRefused):
            r.steps.format_once(r.lvm, lv, "ext4")
        assert r.host.lv(NEW).content.fs is None
        # Refused before any write: its fresh tag and mark stay for a retry.
        assert (tags.fresh in r.host.lv(NEW).tags) == case.fresh_tag
        assert r.marks.formatting(lv.uuid) == case.marked
    else:
        assert r.steps.format_once(r.lvm, lv, "ext4") == "ext4"
        assert r.host.lv(NEW).content.fs == "ext4"
        assert tags.fresh not in r.host.lv(NEW).tags and not r.marks.marked
    tools = r.tools()
    assert tools.count("mkfs.ext4") == (1 if case.formats else 0)
    assert ("blkid" in tools) == case.probes


def test_a_mark_is_set_before_mkfs_and_kept_when_it_fails(tmp_path: Path) -> None:
    """A run killed (or failing) inside mkfs leaves the mark: the retry may
    format what the failed mkfs wrote."""
    r = rig(tmp_path)
    r.host.add_lv(NEW, GiB)
    lv = r.lv(NEW)
    r.host.fail_next(("mkfs.ext4",))
    with pytest.raises(CommandError):
        r.steps.format_once(r.lvm, lv, "ext4")
    assert r.marks.formatting(lv.uuid)


def test_host_volume_steps_need_no_marks(tmp_path: Path) -> None:
    """The host volume plugin has no state file: its fresh tag is its mark."""
    r = rig(tmp_path, DHV_TAGS, marks=False)
    r.host.add_lv(NEW, GiB, tags=[DHV_TAGS.fresh])
    r.host.lv(NEW).content.written = True
    assert r.steps.format_once(r.lvm, r.lv(NEW), "xfs") == "xfs"
    assert DHV_TAGS.fresh not in r.host.lv(NEW).tags


# first mount and grow -------------------------------------------------------------------


@pytest.mark.parametrize("tags", TAGS)
@pytest.mark.parametrize(("fs", "tool"), [("ext4", ""), ("xfs", ""), ("btrfs", "btrfstune")])
def test_first_mount_of_a_clone_beside_its_mounted_source(tmp_path: Path, tags: StepTags,
                                                           fs: str, tool: str) -> None:
    """Every clone's tag goes at its first mount; what a new identity takes is
    the file system's (btrfstune for btrfs, nouuid for xfs, nothing for ext4),
    and the clone then mounts beside its source."""
    r = rig(tmp_path, tags)
    src = source(r, fs, mounted=True)
    with r.pool.reserved() as report:
        lv = r.steps.clone(r.pool, report, src, NEW, [], GiB)
    lv = r.lv(NEW)
    r.host.calls.clear()
    assert r.steps.first_mount(r.lvm, lv, r.dir(NEW), fs, []) == fs
    assert tags.new_fsid not in r.host.lv(NEW).tags
    assert [c[0] for c in r.host.calls if c[0] == "btrfstune"] == ([tool] if tool else [])
    assert "mkfs." + fs not in r.tools()
    assert r.host.top_mount(str(r.root / NEW)) is not None


def test_first_mount_new_fsid_fails_keeps_its_tag_and_mounts_nothing(tmp_path: Path) -> None:
    r = rig(tmp_path, DHV_TAGS)
    src = source(r, "btrfs", mounted=True)
    with r.pool.reserved() as report:
        r.steps.clone(r.pool, report, src, NEW, [], GiB)
    r.host.fail_next(("btrfstune",))
    with pytest.raises(CommandError):
        r.steps.first_mount(r.lvm, r.lv(NEW), r.dir(NEW), "btrfs", [])
    assert DHV_TAGS.new_fsid in r.host.lv(NEW).tags
    assert r.host.top_mount(str(r.root / NEW)) is None


@pytest.mark.parametrize("tags", TAGS)
@pytest.mark.parametrize("due", [True, False])
def test_grow_pending(tmp_path: Path, tags: StepTags, due: bool) -> None:
    r = rig(tmp_path, tags)
    r.host.add_lv(NEW, GiB, tags=[tags.grow_fs] if due else [])
    r.host.set_content(NEW, "ext4", fs_size=GiB // 2)
    path = r.mount(NEW)
    lv = r.lv(NEW)
    r.host.calls.clear()
    assert r.steps.grow_pending(r.lvm, lv, path, "ext4") is due
    assert r.host.lv(NEW).content.fs_size == (GiB if due else GiB // 2)
    assert tags.grow_fs not in r.host.lv(NEW).tags
    assert r.tools() == (["resize2fs", "lvchange"] if due else [])
