"""NodeServicer, RPC by RPC, on a FakeHost: every error branch and the main replies.

Each table row names one branch of csi_local/volumes/staging.py, reached through
csi_local/csi/node_servicer.py (or of the validation, file-system and pool layers
whose errors pass through them) and the code the CSI spec's error table gives
it, as the server's interceptor would send it. Every row states exactly which
tools ran, and what it may change among the LVs, the mount table (with loop
devices) and the state records; everything else must be left as it was.
Success rows check the reply and the effect: the mounts, the records, the tags
and the commands.

Paths in rows are names under the node's directory ("stage" is
<root>/stage); "/..." is used as given, and "rel:x" is the relative path "x".
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

import pytest

from csi_local._gen import csi_pb2 as pb
from csi_local.csi.rpc import status_of
from csi_local.host import filesystem_rules as fsrules
from csi_local.host.filesystems import Usage
from csi_local.nodestate import state_file as state
from csi_local.nodestate.state_file import StateStore
from csi_local.volumes import naming
from csi_local.volumes.lock_keys import pool_key, volume_key
from csi_local.volumes.node_records import AccessType, Publish, Staging
from tests.unit import table
from tests.unit.servicers import (
    GiB,
    MiB,
    Node,
    Setup,
    block_cap,
    call,
    chain,
    make_node,
    mount_cap,
    nothing,
    vol_id,
)
from tests.unit.table import Case

# Every test twice: reading the committed metadata, and every read an `lvs`.
pytestmark = pytest.mark.usefixtures("reads")

Mode = pb.VolumeCapability.AccessMode
SNW = Mode.SINGLE_NODE_WRITER
SSW = Mode.SINGLE_NODE_SINGLE_WRITER
SNMW = Mode.SINGLE_NODE_MULTI_WRITER
RO = Mode.SINGLE_NODE_READER_ONLY
SSW_CAP = mount_cap(mode=SSW)
SNMW_CAP = mount_cap(mode=SNMW)
MOUNT = AccessType.MOUNT
BLOCK = AccessType.BLOCK

SE_CONTEXT = 'context="system_u:object_r:container_file_t:s0:c10,c20"'
V = vol_id("vol")  # the volume of most rows
V2 = vol_id("vol2")
S = naming.snapshot_id_for("snap")
FOREIGN = "data"  # an LV of the VG that is not a CSI volume
KIND_V = f"{naming.TAG_KIND}={naming.KIND_VOLUME}"
KIND_S = f"{naming.TAG_KIND}={naming.KIND_SNAPSHOT}"
FRESH, NEW_FSID, GROW_FS = naming.TAG_FRESH, naming.TAG_NEW_FSID, naming.TAG_GROW_FS
STAGE, STAGE2, TARGET, TARGET2 = "stage", "stage2", "target", "target2"
EXT4 = mount_cap()
BLK = block_cap()
USAGE = Usage(total_bytes=GiB, used_bytes=100 * MiB, available_bytes=900 * MiB,
              total_inodes=65536, used_inodes=11, available_inodes=65525)

Request = Callable[[Node], Any]
Check = Callable[[Node, Any], None]


def at(n: Node, path: str) -> str:
    """A row's path as a request carries it."""
    if path == "" or path.startswith("/"):
        return path
    if path.startswith("rel:"):
        return path.removeprefix("rel:")
    return os.path.join(n.root, path)


def block_file(path: str = STAGE, vid: str = V) -> str:
    """Where a block volume is bound in its staging directory (a row path)."""
    return f"{path}/{vid}"


# the node, with file-system usage answered in memory -----------------------------------


class FakeUsage:
    """Filesystems.usage without statvfs: fixed numbers, and the paths asked."""

    def __init__(self) -> None:
        self.paths: list[str] = []

    def __call__(self, path: str) -> Usage:
        self.paths.append(path)
        return USAGE


class StateWrites:
    """The state file's atomic write, counted instead of done: its fsyncs and renames
    cost milliseconds each on a real disk and prove nothing here (test_state_file.py
    covers them); the node reads its records from the store's memory."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, path: str, text: str, mode: int = 0o600) -> None:
        self.count += 1


def state_writes() -> int:
    return cast(StateWrites, vars(state)["write_atomic"]).count


def node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Node:
    monkeypatch.setattr("csi_local.nodestate.state_file.write_atomic", StateWrites())
    n = make_node(tmp_path, monkeypatch)
    monkeypatch.setattr(n.backend.fs, "usage", FakeUsage())
    return n


def statted(n: Node) -> list[str]:
    return cast(FakeUsage, n.backend.fs.usage).paths


def expect_ok(fn: Callable[[Any, Any], Any], request: Any) -> Any:
    code, answer = call(fn, request)
    assert code == "OK", (code, answer)
    return answer


# requests --------------------------------------------------------------------------------


def stage(vid: str = V, path: str = STAGE,
          cap: pb.VolumeCapability | None = EXT4) -> Request:
    return lambda n: pb.NodeStageVolumeRequest(
        volume_id=vid, staging_target_path=at(n, path), volume_capability=cap)


def unstage(vid: str = V, path: str = STAGE) -> Request:
    return lambda n: pb.NodeUnstageVolumeRequest(volume_id=vid, staging_target_path=at(n, path))


def publish(vid: str = V, target: str = TARGET, path: str = STAGE,
            cap: pb.VolumeCapability | None = EXT4, readonly: bool = False) -> Request:
    return lambda n: pb.NodePublishVolumeRequest(
        volume_id=vid, target_path=at(n, target), staging_target_path=at(n, path),
        volume_capability=cap, readonly=readonly)


def unpublish(vid: str = V, target: str = TARGET) -> Request:
    return lambda n: pb.NodeUnpublishVolumeRequest(volume_id=vid, target_path=at(n, target))


def stats(vid: str = V, path: str = STAGE) -> Request:
    return lambda n: pb.NodeGetVolumeStatsRequest(volume_id=vid, volume_path=at(n, path))


def expand(vid: str = V, path: str = STAGE,
           rng: tuple[int, int] | None = (2 * GiB, 0)) -> Request:
    return lambda n: pb.NodeExpandVolumeRequest(
        volume_id=vid, volume_path=at(n, path),
        capacity_range=pb.CapacityRange(required_bytes=rng[0], limit_bytes=rng[1])
        if rng is not None else None)


def no_type_cap() -> pb.VolumeCapability:
    return pb.VolumeCapability(access_mode=Mode(mode=SNW))


def no_mode_cap() -> pb.VolumeCapability:
    return pb.VolumeCapability(mount=pb.VolumeCapability.MountVolume(fs_type="ext4"))


# setups ----------------------------------------------------------------------------------




def fresh(vid: str = V, size: int = GiB, fs: str | None = None) -> Setup:
    """A volume as CreateVolume leaves it: its thin device maps no block."""
    def run(n: Node) -> None:
        n.host.add_lv(vid, size, tags=[KIND_V, f"{naming.TAG_SIZE}={size}"], fs=fs)
    return run


def legacy_fresh(vid: str = V, size: int = GiB) -> Setup:
    """A volume made by an older version: tagged `fresh`, never staged."""
    def run(n: Node) -> None:
        n.host.add_lv(vid, size, tags=[KIND_V, f"{naming.TAG_SIZE}={size}", FRESH])
    return run


def written(vid: str = V) -> Setup:
    """Something wrote to the volume's device: it maps blocks (blkid may find nothing)."""
    def run(n: Node) -> None:
        n.host.lv(vid).content.written = True
    return run


def format_mark(vid: str = V) -> Setup:
    """The mark a stage leaves when it is killed inside its mkfs."""
    return lambda n: n.state.mark_formatting(n.host.lv(vid).uuid)


def mapping_unknown(n: Node) -> None:
    """The kernel's mapped-block count cannot be read."""
    n.host.thin_status_error = True  # a failed pool: no count


def used(fs: str | None = "ext4", *, vid: str = V, size: int = GiB, tags: Sequence[str] = (),
         active: bool = True, fs_size: int | None = None) -> Setup:
    """A volume that has been staged and written before, holding `fs`."""
    def run(n: Node) -> None:
        n.host.add_lv(vid, size, tags=[KIND_V, f"{naming.TAG_SIZE}={size}", *tags],
                      active=active).content.written = True
        if fs is not None:
            n.host.set_content(vid, fs, fs_size=fs_size)
    return run


def content(vid: str = V, fs: str | None = None, *, ambivalent: bool = False,
            unreadable: bool = False) -> Setup:
    return lambda n: n.host.set_content(vid, fs, ambivalent=ambivalent, unreadable=unreadable)


def plain_lv(name: str, tags: Sequence[str] = ()) -> Setup:
    return lambda n: n.host.add_lv(name, GiB, tags=tags, fs="ext4")


def staged(vid: str = V, path: str = STAGE, cap: pb.VolumeCapability = EXT4) -> Setup:
    return lambda n: expect_ok(n.node.NodeStageVolume, stage(vid, path, cap)(n))


def published(vid: str = V, target: str = TARGET, path: str = STAGE,
              cap: pb.VolumeCapability = EXT4, readonly: bool = False) -> Setup:
    return lambda n: expect_ok(n.node.NodePublishVolume,
                               publish(vid, target, path, cap, readonly)(n))


def forget_staging(vid: str = V) -> Setup:
    """The state write of a stage never happened (killed just before it)."""
    return lambda n: n.state.set_staging(vid, None)


def forget_publish(vid: str = V, target: str = TARGET) -> Setup:
    """The state write of a publish never happened."""
    return lambda n: n.state.remove_publish(vid, at(n, target))


def rebuilt_staging(vid: str = V, flags: tuple[str, ...] = ("rw", "relatime")) -> Setup:
    """The staging record as a rebuild from mountinfo leaves it: the effective
    options, not the CO's flags."""
    def run(n: Node) -> None:
        s = n.state.get(vid).staging
        assert s is not None
        n.state.set_staging(vid, dataclasses.replace(s, mount_flags=flags, flags_known=False))
    return run


def rebuilt_publish(vid: str = V, target: str = TARGET, readonly: bool = False) -> Setup:
    """A publish record rebuilt from mountinfo: read-only known, access mode not (0)."""
    return lambda n: n.state.add_publish(vid, at(n, target), Publish(readonly=readonly))


def record_staging(vid: str = V, path: str = STAGE, access: AccessType = BLOCK) -> Setup:
    return lambda n: n.state.set_staging(vid, Staging(at(n, path), access))


def umounted(path: str) -> Setup:
    """Everything at `path` unmounted behind the plugin's back (an operator's umount)."""
    def run(n: Node) -> None:
        while n.host.is_mount_point(at(n, path)):
            n.host.run(["umount", at(n, path)])
    return run


def bound(source: str, target: str) -> Setup:
    """A bind made behind the plugin's back (or by a publish killed after its bind)."""
    def run(n: Node) -> None:
        os.makedirs(at(n, target), exist_ok=True)
        n.host.run(["mount", "--bind", at(n, source), at(n, target)])
    return run


def bound_node(vid: str, path: str) -> Setup:
    """A volume's device node bound onto a file behind the plugin's back."""
    def run(n: Node) -> None:
        touch(path)(n)
        n.host.run(["mount", "--bind", n.host.lv_path(vid), at(n, path)])
    return run


def deactivated(vid: str = V) -> Setup:
    return lambda n: n.host.run(["lvchange", "--activate", "n", f"vg0/{vid}"])


def lv_removed(vid: str = V) -> Setup:
    return lambda n: n.host.run(["lvremove", "--yes", f"vg0/{vid}"])


def foreign_mount(path: str) -> Setup:
    """Something else's mount (a tmpfs) at `path`."""
    def run(n: Node) -> None:
        os.makedirs(at(n, path), exist_ok=True)
        n.host.add_mount(at(n, path))
    return run


def foreign_file_mount(path: str) -> Setup:
    """Something else's mount on the file at `path` (made by touch())."""
    return lambda n: n.host.add_mount(at(n, path))


def mkdir(path: str) -> Setup:
    return lambda n: os.makedirs(at(n, path), exist_ok=True)


def rmdir(path: str) -> Setup:
    return lambda n: os.rmdir(at(n, path))


def touch(path: str) -> Setup:
    def run(n: Node) -> None:
        os.makedirs(os.path.dirname(at(n, path)), exist_ok=True)
        Path(at(n, path)).touch()
    return run


def symlink(path: str, to: str) -> Setup:
    def run(n: Node) -> None:
        os.makedirs(os.path.dirname(at(n, path)), exist_ok=True)
        os.symlink(at(n, to), at(n, path))
    return run


def vg_gone(n: Node) -> None:
    n.host.vg_present = False


def fail(*prefix: str, rc: int = 1, stderr: str = "boom\n") -> Setup:
    return lambda n: n.host.fail_next(prefix, rc, stderr)


def pool(**fields: float) -> Setup:
    def run(n: Node) -> None:
        for key, value in fields.items():
            setattr(n.host.lvs["pool0"], key, value)
    return run


def pool_removed(n: Node) -> None:
    del n.host.lvs["pool0"]


def fs_errors(vid: str = V) -> Setup:
    return lambda n: n.host.remount_fs_read_only(vid)


# checks: each asserts ----------------------------------------------------------------------


def all_of(*checks: Check) -> Check:
    def run(n: Node, answer: Any) -> None:
        for c in checks:
            c(n, answer)
    return run


def device(n: Node, vid: str = V) -> tuple[int, int]:
    found = n.host.device_numbers(n.host.lv_path(vid))
    assert found is not None, f"{vid} has no device"
    return found


def only_foreign(path: str) -> Check:
    """Exactly one mount at `path`: the tmpfs that foreign_mount() put there."""
    def run(n: Node, _: Any) -> None:
        found = n.host.mounts_at(at(n, path))
        assert [(m.fs_type, m.source) for m in found] == [("tmpfs", "tmpfs")], found
    return run


def mounted(path: str, fs: str | None = None, *, ro: bool | None = None, vid: str = V,
            kind: str | None = None) -> Check:
    """Exactly one mount at `path`, and it shows `vid`'s device."""
    def run(n: Node, _: Any) -> None:
        found = n.host.mounts_at(at(n, path))
        assert len(found) == 1, found
        top = found[0]
        assert n.host.shows_device(top, *device(n, vid)), top
        if fs is not None:
            assert top.fs_type == fs, top
        if ro is not None:
            assert top.read_only == ro, top
        if kind == "file":
            assert os.path.isfile(at(n, path)) and not os.path.islink(at(n, path))
    return run


def unmounted(*paths: str) -> Check:
    def run(n: Node, _: Any) -> None:
        for p in paths:
            assert not n.host.is_mount_point(at(n, p)), n.host.mounts_at(at(n, p))
    return run


def exists(path: str, kind: str | None) -> Check:
    """`path` is a "dir", a "file", a "link", or (None) absent."""
    def run(n: Node, _: Any) -> None:
        p = at(n, path)
        found = ("link" if os.path.islink(p) else "dir" if os.path.isdir(p)
                 else "file" if os.path.isfile(p) else None)
        assert found == kind, (p, found)
    return run


def staging(path: str = STAGE, access: AccessType = MOUNT, fs: str = "ext4",
            flags: tuple[str, ...] = (), mode: int = SNW, vid: str = V) -> Check:
    def run(n: Node, _: Any) -> None:
        want = Staging(at(n, path), access, fs if access is MOUNT else "", flags, mode)
        assert n.state.get(vid).staging == want
    return run


def unstaged(vid: str = V) -> Check:
    def run(n: Node, _: Any) -> None:
        assert n.state.get(vid).staging is None
    return run


def publishes(*rows: tuple[str, bool, int], vid: str = V) -> Check:
    """The volume's publish records: exactly (target, readonly, access mode) rows."""
    def run(n: Node, _: Any) -> None:
        want = {at(n, t): Publish(readonly=r, access_mode=m) for t, r, m in rows}
        assert n.state.get(vid).publishes == want
    return run


def tags(has: Sequence[str] = (), lacks: Sequence[str] = (), vid: str = V) -> Check:
    def run(n: Node, _: Any) -> None:
        lv = n.host.lvs[vid]
        assert set(has) <= lv.tags and not set(lacks) & lv.tags, lv.tags
    return run


def marked(present: bool, vid: str = V) -> Check:
    """Whether the volume's formatting mark is there (a retry may format again)."""
    def run(n: Node, _: Any) -> None:
        assert n.state.formatting(n.host.lvs[vid].uuid) is present
    return run


def resolve(n: Node, token: str) -> str:
    """"@dev": the volume's /dev/VG/LV path; "@name": a row path; else as is."""
    if token == "@dev":
        return n.host.lv_path(V)
    return at(n, token[1:]) if token.startswith("@") else token


def ran_cmd(*argv: str) -> Check:
    """This exact command ran (tokens as `resolve` reads them)."""
    def run(n: Node, _: Any) -> None:
        want = tuple(resolve(n, a) for a in argv)
        assert want in n.host.calls, (want, n.host.calls)
    return run


def ran_with(tool: str, *parts: str) -> Check:
    """Every call of `tool` holds `parts`, in order, as consecutive arguments."""
    def run(n: Node, _: Any) -> None:
        cmds = n.host.commands(tool)
        assert cmds, n.host.calls
        want = tuple(resolve(n, p) for p in parts)
        for c in cmds:
            assert any(c[i:i + len(want)] == want for i in range(len(c))), (want, c)
    return run


def times(tool: str, count: int) -> Check:
    def run(n: Node, _: Any) -> None:
        assert len(n.host.commands(tool)) == count, n.host.calls
    return run


def order(*tools: str) -> Check:
    """The first calls of `tools` came in this order."""
    def run(n: Node, _: Any) -> None:
        names = [c[0] for c in n.host.calls]
        firsts = [names.index(t) for t in tools]
        assert firsts == sorted(firsts), n.host.calls
    return run


def loops(*readonly: bool) -> Check:
    """The attached loop devices: one per entry, with its read-only flag, over V."""
    def run(n: Node, _: Any) -> None:
        found = sorted(n.host.loops.values(), key=lambda lo: lo.backing)
        assert [lo.readonly for lo in found] == list(readonly), n.host.loops
        node_path = f"/dev/dm-{device(n)[1]}" if readonly else ""
        assert all(lo.backing == node_path for lo in found), n.host.loops
    return run


def lv_size(size: int, fs_size: int | None = None, vid: str = V) -> Check:
    def run(n: Node, _: Any) -> None:
        lv = n.host.lvs[vid]
        assert lv.size == size, lv.size
        if fs_size is not None:
            assert lv.content.fs_size == fs_size, lv.content.fs_size
    return run


def fs_is(fs: str | None, vid: str = V) -> Check:
    def run(n: Node, _: Any) -> None:
        assert n.host.lvs[vid].content.fs == fs
    return run


def capacity(size: int) -> Check:
    def run(n: Node, answer: Any) -> None:
        assert answer.capacity_bytes == size, answer
    return run


def usage(*, fs: bool = False, block: int = 0, path: str = STAGE) -> Check:
    """The stats reply's usage: the file system's (statvfs of `path`), a block
    volume's bytes, or none."""
    def run(n: Node, answer: Any) -> None:
        got = [(u.unit, u.total, u.used, u.available) for u in answer.usage]
        want: list[tuple[int, int, int, int]] = []
        if fs:
            want = [(pb.VolumeUsage.BYTES, USAGE.total_bytes, USAGE.used_bytes,
                     USAGE.available_bytes),
                    (pb.VolumeUsage.INODES, USAGE.total_inodes, USAGE.used_inodes,
                     USAGE.available_inodes)]
            assert statted(n) == [at(n, path)]
        else:
            assert statted(n) == []
        if block:
            want = [(pb.VolumeUsage.BYTES, block, 0, 0)]
        assert got == want, answer
    return run


def condition(*says: str) -> Check:
    """Abnormal, naming each of `says`; healthy when none are given."""
    def run(n: Node, answer: Any) -> None:
        cond = answer.volume_condition
        if says:
            assert cond.abnormal, answer
            for piece in says:
                assert piece in cond.message, cond.message
        else:
            assert not cond.abnormal and cond.message == "volume is healthy", answer
    return run


def fine(n: Node, answer: Any) -> None:
    """Nothing to check beyond what the row runner checks."""


# the row runner -----------------------------------------------------------------------------


def row(id: str, request: Request, code: str, says: str = "", *, setup: Setup = nothing,
        check: Check = fine, **kw: Any) -> Any:
    """One row. Error rows change nothing unless `changes` says so; OK rows may
    change anything, and their `check` says what it must be."""
    return table.row(id, request, code, says, setup=setup, check=check, **kw)


def snapshot(n: Node) -> dict[str, object]:
    return {
        "lvs": {name: (lv.size, frozenset(lv.tags), lv.active, dataclasses.astuple(lv.content))
                for name, lv in n.host.lvs.items()},
        "mounts": (n.host.mounts(),
                   {k: (lo.backing, lo.readonly) for k, lo in n.host.loops.items()}),
        "state": n.state.all(),
    }


def kept(n: Node) -> dict[str, object]:
    """What a row leaves as it was: the state file's writes count with its records."""
    parts = snapshot(n)
    parts["state"] = (parts["state"], state_writes())
    return parts


def answered(n: Node, case: Case, method: str, code: str, answer: Any) -> None:
    if code == "OK":
        assert type(answer).__name__ == f"{method}Response"


TABLE = table.Table[Node](
    send=lambda n, method, request: call(getattr(n.node, method), request),
    host=lambda n: n.host, locks=lambda n: n.backend.locks, kept=kept,
    ok_changes="lvs mounts state", after=answered)


def run_row(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, method: str,
            case: Case) -> None:
    TABLE.run(node(tmp_path, monkeypatch), case, method)


BUSY = volume_key(V)


def invalid_ids(request: Callable[[str], Request]) -> list[Any]:
    """The rows of a malformed volume_id: refused before any lock, path or command."""
    return [
        row("volume-id-missing", request(""), "INVALID_ARGUMENT", "volume_id is required"),
        row("volume-id-with-slash", request("../x"), "INVALID_ARGUMENT", "is not a valid ID"),
        row("volume-id-dotdot", request(".."), "INVALID_ARGUMENT", "is not a valid ID"),
        row("volume-id-control-character", request("csi-v-\n"), "INVALID_ARGUMENT",
            "is not a valid ID"),
        row("volume-id-over-128-bytes", request("v" * 129), "INVALID_ARGUMENT",
            "is not a valid ID"),
    ]


def invalid_paths(field: str, request: Callable[[str], Request], setup: Setup) -> list[Any]:
    """The rows of a staging or target path the plugin never mounts on."""
    bad = "INVALID_ARGUMENT"
    return [
        row(f"{field}-missing", request(""), bad, f"{field} is required", setup=setup),
        row(f"{field}-relative", request("rel:x/y"), bad, "must be an absolute path",
            setup=setup),
        row(f"{field}-dotdot", request("x/../y"), bad, "must not contain '..'", setup=setup),
        row(f"{field}-nul", request("x\x00y"), bad, "is not a valid path", setup=setup),
        row(f"{field}-too-long", request("/" + "x" * 4096), bad, "is not a valid path",
            setup=setup),
        row(f"{field}-symlink", request("link"), bad, "is a symbolic link",
            setup=chain(setup, mkdir("real"), symlink("link", "real"))),
        row(f"{field}-in-etc", request("/etc/csi"), bad, "resolves to /etc/csi", setup=setup),
        row(f"{field}-in-proc", request("/proc/csi"), bad, "where volumes are never mounted",
            setup=setup),
        row(f"{field}-resolves-into-sys", request("sys/x"), bad, "resolves to /sys/x",
            setup=chain(setup, symlink("sys", "/sys"))),
        row(f"{field}-root", request("/"), bad, "resolves to /,", setup=setup),
    ]


def invalid_caps(request: Callable[[pb.VolumeCapability | None], Request],
                 setup: Setup) -> list[Any]:
    """The rows of a capability the plugin cannot serve."""
    bad = "INVALID_ARGUMENT"
    return [
        row("capability-missing", request(None), bad, "volume_capability is required",
            setup=setup),
        row("capability-without-access-type", request(no_type_cap()), bad,
            "needs an access type", setup=setup),
        row("capability-without-access-mode", request(no_mode_cap()), bad,
            "needs an access mode", setup=setup),
        row("multi-node-mode", request(mount_cap(mode=Mode.MULTI_NODE_MULTI_WRITER)), bad,
            "MULTI_NODE_MULTI_WRITER is not supported", setup=setup),
        row("multi-node-block", request(block_cap(Mode.MULTI_NODE_READER_ONLY)), bad,
            "MULTI_NODE_READER_ONLY is not supported", setup=setup),
        row("unsupported-fs", request(mount_cap("ntfs")), bad,
            "fs type 'ntfs' is not supported", setup=setup),
        row("forbidden-mount-flag", request(mount_cap(flags=("bind",))), bad,
            "mount flag refused", setup=setup),
        row("forbidden-mount-flag-in-a-list", request(mount_cap(flags=("noatime,remount",))),
            bad, "'remount' is not allowed", setup=setup),
        row("forbidden-mount-flag-prefix", request(mount_cap(flags=("X-mount.mkdir",))), bad,
            "is not allowed", setup=setup),
        row("malformed-mount-flag", request(mount_cap(flags=("rw,,noatime",))), bad,
            "invalid mount option", setup=setup),
        # Quotes only around a whole SELinux context, and closed.
        row("quoted-value-of-another-option", request(mount_cap(flags=('data="a,b"',))), bad,
            "invalid mount option", setup=setup),
        row("unclosed-context-quote", request(mount_cap(flags=('context="u:r:t:s0,c1',))),
            bad, "invalid mount option", setup=setup),
    ]


# NodeStageVolume ----------------------------------------------------------------------------

STAGE_ROWS = [
    # The request on its face: refused before any lock or command.
    *invalid_ids(lambda vid: stage(vid)),
    *invalid_paths("staging_target_path", lambda p: stage(path=p), used()),
    *invalid_caps(lambda cap: stage(cap=cap), used()),
    # Which volume: NOT_FOUND, and never a look-up for an ID that cannot be ours.
    row("volume-not-found", stage(), "NOT_FOUND", f"volume '{V}' not found", ran="lvs"),
    row("snapshot-id", stage(S), "NOT_FOUND", "not found"),
    row("foreign-lv-name", stage(FOREIGN), "NOT_FOUND", "not found", setup=plain_lv(FOREIGN)),
    row("lv-without-kind-tag", stage(), "NOT_FOUND", "not found", setup=plain_lv(V),
        ran="lvs"),
    row("lv-of-snapshot-kind", stage(), "NOT_FOUND", "not found",
        setup=plain_lv(V, [KIND_S]), ran="lvs"),
    row("vg-missing", stage(), "UNAVAILABLE", "volume group vg0 not found",
        setup=chain(used(), vg_gone), ran="lvs"),
    row("lock-busy", stage(), "ABORTED", "already in progress", setup=used(), busy=BUSY),
    # Staged already, incompatibly: ALREADY_EXISTS, nothing run but the look-up.
    row("staged-at-another-path", stage(path=STAGE2), "ALREADY_EXISTS",
        "is already staged at", setup=chain(used(), staged()), ran="(lvs)"),
    row("staged-as-mount-asked-block", stage(cap=BLK), "ALREADY_EXISTS",
        "with another capability", setup=chain(used(), staged()), ran="(lvs)"),
    row("staged-as-block-asked-mount", stage(), "ALREADY_EXISTS", "with another capability",
        setup=chain(used(), staged(cap=BLK)), ran="(lvs)"),
    row("staged-ext4-asked-xfs", stage(cap=mount_cap("xfs")), "ALREADY_EXISTS",
        "with another capability", setup=chain(used(), staged()), ran="(lvs)"),
    row("staged-asked-other-flags", stage(cap=mount_cap(flags=("noatime",))),
        "ALREADY_EXISTS", "with another capability", setup=chain(used(), staged()), ran="(lvs)"),
    row("staged-with-flags-asked-none", stage(), "ALREADY_EXISTS", "with another capability",
        setup=chain(used(), staged(cap=mount_cap(flags=("noatime",)))), ran="(lvs)"),
    # The one formatting rule: FAILED_PRECONDITION, and never a write.
    row("used-blank-never-formatted", stage(), "FAILED_PRECONDITION",
        "has no recognisable file system but has been used before",
        setup=used(fs=None), ran="(lvs) blkid"),
    row("used-other-fs", stage(cap=mount_cap("xfs")), "FAILED_PRECONDITION",
        "holds a ext4 file system, but xfs was requested", setup=used("ext4"), ran="(lvs) blkid"),
    row("fresh-with-other-fs", stage(), "FAILED_PRECONDITION",
        "holds a xfs file system, but ext4 was requested", setup=fresh(fs="xfs"),
        ran="(lvs) blkid"),
    row("used-stray-signatures-refused", stage(), "FAILED_PRECONDITION",
        "carries conflicting signatures and has been used before",
        setup=chain(used(fs=None), content(ambivalent=True)), ran="(lvs) blkid"),
    # Blocks mapped and a formatting mark: blkid's "nothing" is trusted only
    # for a device that reads. (One that maps nothing holds nothing to lose.)
    row("marked-unreadable-refused", stage(), "FAILED_PRECONDITION", "cannot read",
        setup=chain(fresh(), content(unreadable=True), written(), format_mark()),
        ran="(lvs) blkid", check=marked(True)),
    # Devices and commands that fail.
    row("activation-fails", stage(), "INTERNAL", "lvchange exited 5",
        setup=chain(used(active=False), fail("lvchange", rc=5)), ran="(lvs) lvchange"),
    row("device-never-appears", stage(), "FAILED_PRECONDITION", "did not appear",
        setup=chain(used(active=False), fail("lvchange", rc=0, stderr="")), ran="lvs lvchange"),
    # The mark stays: the retry may format again, whatever the failed mkfs wrote.
    row("mkfs-fails-nothing-recorded", stage(), "INTERNAL", "mkfs.ext4 exited 1",
        setup=chain(fresh(), fail("mkfs.ext4")), ran="(lvs) mkfs.ext4",
        check=all_of(marked(True), unstaged())),
    # Formatted, so no longer formattable; not mounted, so not recorded (a retry mounts it).
    row("mount-fails-nothing-recorded", stage(), "INTERNAL", "mount exited 32",
        setup=chain(fresh(), fail("mount", rc=32)), ran="(lvs) mkfs.ext4 mount",
        changes="lvs", check=all_of(marked(False), fs_is("ext4"), unstaged())),
    row("legacy-fresh-tag-removal-fails-not-mounted", stage(), "INTERNAL", "lvchange exited 5",
        setup=chain(legacy_fresh(), fail("lvchange", rc=5)), ran="(lvs) mkfs.ext4 lvchange",
        changes="lvs", check=all_of(tags(has=[FRESH]), fs_is("ext4"))),
    row("new-fsid-fails-not-mounted", stage(cap=mount_cap("btrfs")), "INTERNAL",
        "btrfstune exited 1", setup=chain(used("btrfs", tags=[NEW_FSID]), fail("btrfstune")),
        ran="(lvs) blkid btrfstune", check=tags(has=[NEW_FSID])),
    # The fs stays mounted, unrecorded, with its tag: a retry grows it (see below).
    row("grow-fs-fails-tag-kept", stage(), "INTERNAL", "resize2fs exited 1",
        setup=chain(used(tags=[GROW_FS], fs_size=GiB // 2), fail("resize2fs")),
        ran="(lvs) blkid mount resize2fs", changes="mounts",
        check=all_of(mounted(STAGE, "ext4"), unstaged(), tags(has=[GROW_FS]))),
    row("block-bind-fails-nothing-recorded", stage(cap=BLK), "INTERNAL", "mount exited 32",
        setup=chain(fresh(), fail("mount", rc=32)), ran="(lvs) mount", changes="",
        check=unstaged()),
    # Mount volumes. A new volume maps no block: formatted without a probe, and
    # without a single LVM change.
    row("fresh-ext4-formatted-once", stage(), "OK",
        setup=fresh(), ran="(lvs) mkfs.ext4 mount",
        check=all_of(times("mkfs.ext4", 1), order("mkfs.ext4", "mount"), marked(False),
                     fs_is("ext4"), mounted(STAGE, "ext4", ro=False),
                     ran_cmd("mount", "-t", "ext4", "@dev", "@stage"), staging())),
    row("fresh-xfs-mounted-nouuid", stage(cap=mount_cap("xfs")), "OK",
        setup=fresh(), ran="(lvs) mkfs.xfs mount",
        check=all_of(ran_cmd("mount", "-t", "xfs", "-o", "nouuid", "@dev", "@stage"),
                     mounted(STAGE, "xfs"), staging(fs="xfs"))),
    row("fresh-btrfs", stage(cap=mount_cap("btrfs")), "OK",
        setup=fresh(), ran="(lvs) mkfs.btrfs mount",
        check=all_of(mounted(STAGE, "btrfs"), staging(fs="btrfs"))),
    row("no-fs-type-is-the-default-ext4", stage(cap=mount_cap("")), "OK",
        setup=fresh(), ran="(lvs) mkfs.ext4 mount",
        check=all_of(mounted(STAGE, "ext4"), staging(fs="ext4"))),
    # Blocks mapped, nothing blkid knows, no mark: a raw workload's data, left alone.
    row("written-blank-never-formatted", stage(), "FAILED_PRECONDITION",
        "has no recognisable file system but has been used before",
        setup=chain(fresh(), written()), ran="(lvs) blkid", check=fs_is(None)),
    # The kernel's count unreadable: only a volume known to be fresh is formatted.
    row("mapping-unknown-blank-refused", stage(), "FAILED_PRECONDITION",
        "has been used before", setup=chain(fresh(), mapping_unknown), ran="(lvs) blkid",
        check=fs_is(None)),
    # Nor is a formatting mark trusted then (it once was): without the count,
    # nothing says the blocks it maps are only the unfinished mkfs's.
    row("mapping-unknown-mark-not-trusted", stage(), "FAILED_PRECONDITION",
        "has been used before", setup=chain(fresh(), written(), format_mark(), mapping_unknown),
        ran="(lvs) blkid", check=all_of(fs_is(None), marked(True))),
    # A stage killed inside its mkfs: the mark lets the retry wipe and format.
    row("killed-mkfs-mark-lets-the-retry-format", stage(), "OK",
        setup=chain(fresh(), content(ambivalent=True), format_mark()),
        ran="(lvs) blkid wipefs mkfs.ext4 mount",
        check=all_of(order("wipefs", "mkfs.ext4", "mount"), marked(False), fs_is("ext4"),
                     staging())),
    row("killed-mkfs-after-its-superblock-mounted", stage(), "OK",
        setup=chain(fresh(), content(fs="ext4"), format_mark()), ran="(lvs) blkid mount",
        check=all_of(marked(False), mounted(STAGE, "ext4"), staging())),
    row("legacy-fresh-formatted-tag-dropped", stage(), "OK",
        setup=legacy_fresh(), ran="(lvs) mkfs.ext4 lvchange mount",
        check=all_of(ran_cmd("lvchange", "--deltag", FRESH, f"vg0/{V}"),
                     order("mkfs.ext4", "lvchange", "mount"), tags(lacks=[FRESH]),
                     fs_is("ext4"), staging())),
    row("mount-flags-passed-and-recorded", stage(cap=mount_cap(flags=("noatime", "ro"))), "OK",
        setup=used(), ran="(lvs) blkid mount",
        check=all_of(ran_cmd("mount", "-t", "ext4", "-o", "noatime,ro", "@dev", "@stage"),
                     mounted(STAGE, "ext4", ro=True), staging(flags=("noatime", "ro")))),
    # Issue 30, defect 5: kubelet's SELinux context (seLinuxMount), quoted because its
    # MCS categories hold a comma, reaches mount(8) exactly as it came: mount(8)
    # drops it where SELinux is disabled and translates it where it is enabled.
    row("selinux-context-passed-to-mount8", stage(cap=mount_cap(flags=(SE_CONTEXT,))), "OK",
        setup=used(), ran="(lvs) blkid mount",
        check=all_of(ran_cmd("mount", "-t", "ext4", "-o", SE_CONTEXT, "@dev", "@stage"),
                     mounted(STAGE, "ext4", ro=False), staging(flags=(SE_CONTEXT,)))),
    row("selinux-context-in-a-list", stage(cap=mount_cap(flags=(f"noatime,{SE_CONTEXT},ro",))),
        "OK", setup=used(), ran="(lvs) blkid mount",
        check=all_of(ran_cmd("mount", "-t", "ext4", "-o", f"noatime,{SE_CONTEXT},ro", "@dev",
                             "@stage"),
                     mounted(STAGE, "ext4", ro=True))),
    row("reader-only-mode-recorded", stage(cap=mount_cap(mode=RO)), "OK",
        setup=used(), ran="(lvs) blkid mount", check=staging(mode=RO)),
    row("used-ext4-mounted-not-formatted", stage(), "OK", setup=used(), ran="(lvs) blkid mount",
        check=all_of(mounted(STAGE, "ext4"), staging())),
    row("fresh-with-fs-not-reformatted", stage(), "OK", setup=fresh(fs="ext4"),
        ran="(lvs) blkid mount", check=all_of(fs_is("ext4"), staging())),
    row("legacy-fresh-stray-signatures-wiped-then-formatted", stage(), "OK",
        setup=chain(legacy_fresh(), content(ambivalent=True)),
        ran="(lvs) blkid wipefs mkfs.ext4 lvchange mount",
        check=all_of(order("wipefs", "mkfs.ext4", "mount"), ran_cmd("wipefs", "--all", "@dev"),
                     mounted(STAGE, "ext4"), staging())),
    row("inactive-volume-activated", stage(), "OK", setup=used(active=False),
        ran="lvs lvchange blkid mount",
        check=all_of(ran_cmd("lvchange", "--activate", "y", "--ignoreactivationskip",
                             f"vg0/{V}"), mounted(STAGE, "ext4"), staging())),
    row("staging-dir-made", stage(path="deep/er/stage"), "OK", setup=used(),
        ran="(lvs) blkid mount", check=all_of(exists("deep/er/stage", "dir"),
                                            mounted("deep/er/stage"),
                                            staging("deep/er/stage"))),
    row("restage-is-idempotent", stage(), "OK", setup=chain(fresh(), staged()), ran="(lvs)",
        changes=""),
    row("restage-without-fs-type-keeps-the-staged-fs", stage(cap=mount_cap("")), "OK",
        setup=chain(fresh(), staged(cap=mount_cap("xfs"))), ran="(lvs)", changes=""),
    row("restage-other-mode-recorded", stage(cap=mount_cap(mode=SNMW)), "OK",
        setup=chain(used(), staged()), ran="(lvs)", changes="state", check=staging(mode=SNMW)),
    # A record rebuilt from mountinfo holds the effective options, not the CO's flags.
    row("restage-rebuilt-record-takes-the-flags", stage(), "OK",
        setup=chain(used(), staged(), rebuilt_staging()), ran="(lvs)", changes="state",
        check=staging()),
    row("restage-after-stage-killed-before-state-write", stage(), "OK",
        setup=chain(used(), staged(), forget_staging()), ran="(lvs)", changes="state",
        check=all_of(mounted(STAGE, "ext4"), staging())),
    row("restage-after-mount-lost", stage(), "OK", setup=chain(used(), staged(), umounted(STAGE)),
        ran="(lvs) blkid mount", changes="mounts", check=mounted(STAGE, "ext4")),
    # Clones and restores: their tags, acted on once and dropped.
    row("new-fsid-btrfs-btrfstune-before-mount", stage(cap=mount_cap("btrfs")), "OK",
        setup=used("btrfs", tags=[NEW_FSID]), ran="(lvs) blkid btrfstune lvchange mount",
        check=all_of(ran_cmd("btrfstune", "-f", "-m", "@dev"),
                     ran_cmd("lvchange", "--deltag", NEW_FSID, f"vg0/{V}"),
                     order("btrfstune", "lvchange", "mount"), tags(lacks=[NEW_FSID]),
                     mounted(STAGE, "btrfs"))),
    row("new-fsid-ext4-tag-dropped", stage(), "OK", setup=used("ext4", tags=[NEW_FSID]),
        ran="(lvs) blkid lvchange mount", check=tags(lacks=[NEW_FSID])),
    row("new-fsid-xfs-mounted-nouuid", stage(cap=mount_cap("xfs")), "OK",
        setup=used("xfs", tags=[NEW_FSID]), ran="(lvs) blkid lvchange mount",
        check=all_of(ran_with("mount", "-o", "nouuid"), tags(lacks=[NEW_FSID]))),
    row("grow-fs-ext4-resize2fs-after-mount", stage(), "OK",
        setup=used(tags=[GROW_FS], fs_size=GiB // 2), ran="(lvs) blkid mount resize2fs lvchange",
        check=all_of(ran_cmd("resize2fs", "@dev"), order("mount", "resize2fs", "lvchange"),
                     ran_cmd("lvchange", "--deltag", GROW_FS, f"vg0/{V}"),
                     tags(lacks=[GROW_FS]), lv_size(GiB, fs_size=GiB), staging())),
    row("grow-fs-xfs", stage(cap=mount_cap("xfs")), "OK",
        setup=used("xfs", tags=[GROW_FS], fs_size=GiB // 2),
        ran="(lvs) blkid mount xfs_growfs lvchange",
        check=all_of(ran_cmd("xfs_growfs", "@stage"), tags(lacks=[GROW_FS]),
                     lv_size(GiB, fs_size=GiB))),
    row("grow-fs-btrfs", stage(cap=mount_cap("btrfs")), "OK",
        setup=used("btrfs", tags=[GROW_FS], fs_size=GiB // 2),
        ran="(lvs) blkid mount btrfs lvchange",
        check=all_of(ran_cmd("btrfs", "filesystem", "resize", "max", "@stage"),
                     tags(lacks=[GROW_FS]), lv_size(GiB, fs_size=GiB))),
    row("grow-fs-retried-on-restage", stage(), "OK",
        setup=chain(used(tags=[GROW_FS], fs_size=GiB // 2), fail("resize2fs"),
                  lambda n: call(n.node.NodeStageVolume, stage()(n))),
        ran="(lvs) resize2fs lvchange",
        check=all_of(tags(lacks=[GROW_FS]), lv_size(GiB, fs_size=GiB), staging(),
                     mounted(STAGE, "ext4"))),
    # Block volumes: the device node bound onto <staging>/<volume id>.
    row("block-fresh-bound-no-mkfs", stage(cap=BLK), "OK", setup=fresh(),
        ran="(lvs) mount",
        check=all_of(mounted(block_file(), "devtmpfs", kind="file"), unmounted(STAGE),
                     ran_cmd("mount", "--bind", "@dev", "@" + block_file()),
                     fs_is(None), staging(access=BLOCK))),
    row("block-legacy-fresh-tag-dropped", stage(cap=BLK), "OK", setup=legacy_fresh(),
        ran="(lvs) lvchange mount", check=all_of(tags(lacks=[FRESH]), staging(access=BLOCK))),
    # Handed out raw: what the unfinished mkfs left is no longer its own.
    row("block-stage-drops-a-formatting-mark", stage(cap=BLK), "OK",
        setup=chain(fresh(), written(), format_mark()), ran="(lvs) mount",
        check=all_of(marked(False), staging(access=BLOCK))),
    row("block-used-never-probed", stage(cap=BLK), "OK", setup=used(), ran="(lvs) mount",
        check=all_of(mounted(block_file(), kind="file"), staging(access=BLOCK))),
    row("block-keeps-grow-fs-tag", stage(cap=BLK), "OK",
        setup=used(tags=[GROW_FS], fs_size=GiB // 2), ran="(lvs) mount",
        check=all_of(tags(has=[GROW_FS]), lv_size(GiB, fs_size=GiB // 2))),
    row("block-keeps-new-fsid-tag", stage(cap=BLK), "OK",
        setup=used("btrfs", tags=[NEW_FSID]), ran="(lvs) mount", check=tags(has=[NEW_FSID])),
    row("block-file-already-there", stage(cap=BLK), "OK",
        setup=chain(used(), touch(block_file())), ran="(lvs) mount",
        check=mounted(block_file(), kind="file")),
    row("block-restage-is-idempotent", stage(cap=BLK), "OK",
        setup=chain(used(), staged(cap=BLK)), ran="(lvs)", changes=""),
    row("block-rebound-after-bind-lost", stage(cap=BLK), "OK",
        setup=chain(used(), staged(cap=BLK), umounted(block_file())), ran="(lvs) mount",
        changes="mounts", check=mounted(block_file(), kind="file")),
]


@pytest.mark.parametrize("case", STAGE_ROWS)
def test_node_stage_volume(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: Case) -> None:
    run_row(tmp_path, monkeypatch, "NodeStageVolume", case)


def test_stage_fs_without_mkfs_on_node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    n = node(tmp_path, monkeypatch)
    fresh()(n)
    monkeypatch.setattr(fsrules, "mkfs_available", lambda fs: fs != "xfs")
    code, msg = call(n.node.NodeStageVolume, stage(cap=mount_cap("xfs"))(n))
    assert (code, "mkfs.xfs is missing" in msg) == ("INVALID_ARGUMENT", True), msg
    assert n.host.calls == [] and n.state.all() == {}


def test_stage_retry_after_mount_failure_does_not_format_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    n = node(tmp_path, monkeypatch)
    fresh()(n)
    n.host.fail_next(("mount",), 32, "mount: boom\n")
    assert call(n.node.NodeStageVolume, stage()(n))[0] == "INTERNAL"
    uuid = n.host.lvs[V].content.uuid
    n.host.calls.clear()
    expect_ok(n.node.NodeStageVolume, stage()(n))
    assert {c[0] for c in n.host.calls} == set(table.expected("(lvs) blkid mount",
                                                              n.host.pv_metadata))
    assert n.host.lvs[V].content.uuid == uuid  # the same file system, not a new one
    mounted(STAGE, "ext4")(n, None)
    staging()(n, None)


@pytest.mark.parametrize(("fs", "tool"), [("xfs", ""), ("btrfs", "btrfstune"), ("ext4", "")])
def test_stage_clone_beside_its_mounted_origin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               fs: str, tool: str) -> None:
    """The kernel refuses a second xfs (without nouuid) or btrfs with a mounted one's
    UUID; the clone's first stage gives btrfs a new fsid and mounts xfs nouuid."""
    n = node(tmp_path, monkeypatch)
    fresh(size=GiB)(n)
    staged(cap=mount_cap(fs))(n)
    clone = pb.CreateVolumeRequest(
        name="vol2", volume_capabilities=[mount_cap(fs)],
        volume_content_source=pb.VolumeContentSource(
            volume=pb.VolumeContentSource.VolumeSource(volume_id=V)))
    expect_ok(n.controller.CreateVolume, clone)
    assert NEW_FSID in n.host.lvs[V2].tags
    assert n.host.lvs[V2].content.uuid == n.host.lvs[V].content.uuid
    n.host.calls.clear()
    expect_ok(n.node.NodeStageVolume, stage(V2, STAGE2, mount_cap(fs))(n))
    assert [c[0] for c in n.host.calls if c[0] == "btrfstune"] == ([tool] if tool else [])
    assert NEW_FSID not in n.host.lvs[V2].tags
    mounted(STAGE, fs)(n, None)
    mounted(STAGE2, fs, vid=V2)(n, None)


# NodeUnstageVolume --------------------------------------------------------------------------

STAGED = chain(used(), staged())
BLOCK_STAGED = chain(used(), staged(cap=BLK))

UNSTAGE_ROWS = [
    *invalid_ids(lambda vid: unstage(vid)),
    *invalid_paths("staging_target_path", lambda p: unstage(path=p), STAGED),
    row("lock-busy", unstage(), "ABORTED", "already in progress", setup=STAGED, busy=BUSY),
    row("still-published", unstage(), "FAILED_PRECONDITION", "is still published at",
        setup=chain(STAGED, published())),
    row("staged-elsewhere", unstage(path=STAGE2), "NOT_FOUND", "is staged at",
        setup=STAGED, check=mounted(STAGE)),
    row("not-staged-no-volume", unstage(), "OK", ran="lvs", changes=""),
    row("not-staged", unstage(), "OK", setup=used(), ran="lvs", changes=""),
    row("not-staged-foreign-id-never-looked-up", unstage(FOREIGN), "OK",
        setup=foreign_mount(STAGE), changes=""),
    # With a record.
    row("mount-unmounted-dir-kept", unstage(), "OK", setup=STAGED, ran="umount",
        check=all_of(ran_cmd("umount", "@stage"), unmounted(STAGE), unstaged(),
                     exists(STAGE, "dir"))),
    row("mount-already-unmounted", unstage(), "OK", setup=chain(STAGED, umounted(STAGE)),
        changes="state", check=unstaged()),
    row("mount-vg-missing-still-unstaged", unstage(), "OK", setup=chain(STAGED, vg_gone),
        ran="umount", check=all_of(unmounted(STAGE), unstaged())),
    row("mount-umount-fails-record-kept", unstage(), "INTERNAL", "umount exited 32",
        setup=chain(STAGED, fail("umount", rc=32)), ran="umount"),
    row("block-unbound-file-removed", unstage(), "OK", setup=BLOCK_STAGED, ran="umount",
        check=all_of(ran_cmd("umount", "@" + block_file()), unmounted(block_file()),
                     exists(block_file(), None), exists(STAGE, "dir"), unstaged())),
    row("block-bind-lost-file-removed", unstage(), "OK",
        setup=chain(BLOCK_STAGED, umounted(block_file())), changes="state",
        check=all_of(exists(block_file(), None), unstaged())),
    row("block-umount-fails-file-kept", unstage(), "INTERNAL", "umount exited 32",
        setup=chain(BLOCK_STAGED, fail("umount", rc=32)), ran="umount",
        check=exists(block_file(), "file")),
    row("block-file-a-symlink-kept", unstage(), "OK",
        setup=chain(used(), touch("elsewhere"), symlink(block_file(), "elsewhere"),
                  record_staging()),
        changes="state", check=all_of(exists(block_file(), "link"), exists("elsewhere", "file"),
                                      unstaged())),
    row("block-file-a-directory-kept", unstage(), "OK",
        setup=chain(used(), mkdir(block_file()), record_staging()), changes="state",
        check=all_of(exists(block_file(), "dir"), unstaged())),
    # Without a record (a stage killed before its state write): LVM says what is ours.
    row("no-record-volume-fs-unmounted", unstage(), "OK", setup=chain(STAGED, forget_staging()),
        ran="lvs umount", changes="mounts", check=unmounted(STAGE)),
    row("no-record-volume-bind-unmounted-file-removed", unstage(), "OK",
        setup=chain(BLOCK_STAGED, forget_staging()), ran="lvs umount", changes="mounts",
        check=all_of(unmounted(block_file()), exists(block_file(), None))),
    row("no-record-foreign-mount-left-alone", unstage(), "OK",
        setup=chain(used(), foreign_mount(STAGE)), ran="lvs", changes=""),
    row("no-record-other-volume-left-alone", unstage(), "OK",
        setup=chain(used(), used(vid=V2), staged(V2)), ran="lvs", changes="",
        check=mounted(STAGE, vid=V2)),
    row("no-record-other-volume-bind-left-alone", unstage(), "OK",
        setup=chain(used(), used(vid=V2), bound_node(V2, block_file())), ran="lvs", changes="",
        check=mounted(block_file(), vid=V2, kind="file")),
    row("no-record-unbound-file-kept", unstage(), "OK",
        setup=chain(used(), touch(block_file())), ran="lvs", changes="",
        check=exists(block_file(), "file")),
    row("no-record-volume-gone-mount-left-alone", unstage(), "OK",
        setup=foreign_mount(STAGE), ran="lvs", changes=""),
    row("no-record-inactive-volume", unstage(), "OK",
        setup=chain(used(active=False), foreign_mount(STAGE)), ran="lvs", changes=""),
    row("no-record-vg-missing", unstage(), "UNAVAILABLE", "volume group vg0 not found",
        setup=chain(STAGED, forget_staging(), vg_gone), ran="lvs"),
]


@pytest.mark.parametrize("case", UNSTAGE_ROWS)
def test_node_unstage_volume(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                             case: Case) -> None:
    run_row(tmp_path, monkeypatch, "NodeUnstageVolume", case)


# NodePublishVolume --------------------------------------------------------------------------


PUBLISHED = chain(STAGED, published())
BLOCK_PUBLISHED = chain(BLOCK_STAGED, published(cap=BLK))
RO_BLOCK_PUBLISHED = chain(BLOCK_STAGED, published(cap=BLK, readonly=True))
LOOP = "/dev/loop0"

# A publish of a staged volume reads its tags first (its format: a newer
# csi-local's volume is refused). The fake host has no committed metadata to
# read them from, so that read is an `lvs` here, where a node whose VG's
# metadata reads starts no process for it.
PUBLISH_ROWS = [
    *invalid_ids(lambda vid: publish(vid)),
    *invalid_paths("target_path", lambda p: publish(target=p), STAGED),
    *[r for r in invalid_paths("staging_target_path", lambda p: publish(path=p), STAGED)
      if r.id != "staging_target_path-missing"],
    # The spec's NodePublishVolume table: "Staging target path not set" is FAILED_PRECONDITION.
    row("staging_target_path-missing", publish(path=""), "FAILED_PRECONDITION",
        "staging_target_path", setup=STAGED),
    *invalid_caps(lambda cap: publish(cap=cap), STAGED),
    # Upstream csi-sanity's requests: a volume that does not exist and no staging path.
    # A REQUIRED field missing or invalid is INVALID_ARGUMENT before the staging path
    # (optional in the spec) is FAILED_PRECONDITION or the volume NOT_FOUND.
    row("capability-missing-no-staging-path", publish(path="", cap=None), "INVALID_ARGUMENT",
        "volume_capability is required"),
    row("capability-invalid-no-staging-path",
        publish(path="", cap=mount_cap(mode=Mode.MULTI_NODE_MULTI_WRITER)), "INVALID_ARGUMENT",
        "MULTI_NODE_MULTI_WRITER is not supported"),
    row("target-missing-no-staging-path", publish(target="", path="", cap=None),
        "INVALID_ARGUMENT", "target_path is required"),
    row("lock-busy", publish(), "ABORTED", "already in progress", setup=STAGED, busy=BUSY),
    # Not staged there: NOT_FOUND first for a volume that does not exist.
    row("volume-missing", publish(), "NOT_FOUND", f"volume '{V}' not found", ran="lvs"),
    row("not-staged", publish(), "FAILED_PRECONDITION", "is not staged at", setup=used(),
        ran="lvs"),
    row("staged-elsewhere", publish(path=STAGE2), "FAILED_PRECONDITION", "is not staged at",
        setup=STAGED, ran="lvs"),
    row("staged-volume-gone", publish(), "NOT_FOUND", "not found",
        setup=chain(STAGED, umounted(STAGE), lv_removed()), ran="lvs"),
    row("staged-as-block-asked-mount", publish(), "INVALID_ARGUMENT",
        "is staged as block, not mount", setup=BLOCK_STAGED, ran="(lvs)"),
    row("staged-as-mount-asked-block", publish(cap=BLK), "INVALID_ARGUMENT",
        "is staged as mount, not block", setup=STAGED, ran="(lvs)"),
    # The same target, published otherwise.
    row("same-target-readonly-differs", publish(readonly=True), "ALREADY_EXISTS",
        "differently", setup=PUBLISHED, ran="(lvs)"),
    row("same-target-mode-differs", publish(cap=SNMW_CAP), "ALREADY_EXISTS", "differently",
        setup=PUBLISHED, ran="(lvs)"),
    row("same-target-other-mount-flags", publish(cap=mount_cap(flags=("noatime",))),
        "ALREADY_EXISTS", "differently", setup=PUBLISHED, ran="(lvs)"),
    row("rebuilt-record-readonly-differs", publish(readonly=True), "ALREADY_EXISTS",
        "differently", setup=chain(PUBLISHED, rebuilt_publish()), ran="(lvs)"),
    # SINGLE_NODE_SINGLE_WRITER: one writer among all targets.
    row("ssw-second-writer", publish(target=TARGET2, cap=SSW_CAP), "FAILED_PRECONDITION",
        "already has a writer at",
        setup=chain(used(), staged(cap=SSW_CAP), published(cap=SSW_CAP)), ran="(lvs)"),
    row("ssw-writer-then-snw-writer", publish(target=TARGET2), "FAILED_PRECONDITION",
        "already has a writer at",
        setup=chain(used(), staged(cap=SSW_CAP), published(cap=SSW_CAP)), ran="(lvs)"),
    row("snw-writer-then-ssw-writer", publish(target=TARGET2, cap=SSW_CAP),
        "FAILED_PRECONDITION", "already has a writer at", setup=PUBLISHED, ran="(lvs)"),
    row("ssw-writer-then-reader", publish(target=TARGET2, cap=SSW_CAP, readonly=True), "OK",
        setup=chain(used(), staged(cap=SSW_CAP), published(cap=SSW_CAP)), ran="(lvs) mount",
        check=all_of(mounted(TARGET2, ro=True), mounted(TARGET, ro=False),
                     publishes((TARGET, False, SSW), (TARGET2, True, SSW)))),
    row("ssw-reader-then-writer", publish(target=TARGET2, cap=SSW_CAP), "OK",
        setup=chain(used(), staged(cap=SSW_CAP), published(cap=SSW_CAP, readonly=True)),
        ran="(lvs) mount",
        check=all_of(mounted(TARGET2, ro=False),
                     publishes((TARGET, True, SSW), (TARGET2, False, SSW)))),
    row("snmw-second-writer", publish(target=TARGET2, cap=SNMW_CAP), "OK",
        setup=chain(used(), staged(cap=SNMW_CAP), published(cap=SNMW_CAP)), ran="(lvs) mount",
        check=publishes((TARGET, False, SNMW), (TARGET2, False, SNMW))),
    # Mount volumes: a bind of the staging directory.
    row("mount-rw", publish(), "OK", setup=STAGED, ran="(lvs) mount",
        check=all_of(ran_cmd("mount", "--bind", "@stage", "@target"), times("mount", 1),
                     mounted(TARGET, "ext4", ro=False), mounted(STAGE, "ext4"),
                     publishes((TARGET, False, SNW)))),
    row("mount-readonly-by-request", publish(readonly=True), "OK", setup=STAGED, ran="(lvs) mount",
        check=all_of(ran_cmd("mount", "-o", "remount,bind,ro", "@target"),
                     mounted(TARGET, "ext4", ro=True), mounted(STAGE, ro=False),
                     publishes((TARGET, True, SNW)))),
    row("mount-readonly-by-reader-only-mode", publish(cap=mount_cap(mode=RO)), "OK",
        setup=chain(used(), staged(cap=mount_cap(mode=RO))), ran="(lvs) mount",
        check=all_of(ran_cmd("mount", "-o", "remount,bind,ro", "@target"),
                     mounted(TARGET, ro=True), publishes((TARGET, True, RO)))),
    # Issue 30, defect 1: read-only wins over a `rw` among the flags (a StorageClass's
    # mountOptions), whichever asks for read-only: the request or a reader-only mode.
    row("readonly-wins-over-rw-flag", publish(cap=mount_cap(flags=("noatime", "rw")),
                                              readonly=True), "OK", setup=STAGED, ran="(lvs) mount",
        check=all_of(ran_cmd("mount", "-o", "remount,bind,noatime,rw,ro", "@target"),
                     mounted(TARGET, "ext4", ro=True), mounted(STAGE, ro=False))),
    row("reader-only-mode-wins-over-rw-flag", publish(cap=mount_cap(mode=RO, flags=("rw",))),
        "OK", setup=chain(used(), staged(cap=mount_cap(mode=RO, flags=("rw",)))), ran="(lvs) mount",
        check=mounted(TARGET, ro=True)),
    row("selinux-context-on-the-bind", publish(cap=mount_cap(flags=(SE_CONTEXT,)),
                                               readonly=True), "OK",
        setup=chain(used(), staged(cap=mount_cap(flags=(SE_CONTEXT,)))), ran="(lvs) mount",
        check=all_of(ran_cmd("mount", "-o", f"remount,bind,{SE_CONTEXT},ro", "@target"),
                     mounted(TARGET, ro=True))),
    row("mount-flags-on-the-bind", publish(cap=mount_cap(flags=("noatime",))), "OK",
        setup=STAGED, ran="(lvs) mount",
        check=ran_cmd("mount", "-o", "remount,bind,noatime", "@target")),
    row("target-dir-made", publish(target="pods/p1/vol"), "OK", setup=STAGED, ran="(lvs) mount",
        check=all_of(exists("pods/p1/vol", "dir"), mounted("pods/p1/vol"))),
    row("idempotent", publish(), "OK", setup=PUBLISHED, changes="", ran="(lvs)"),
    row("idempotent-readonly", publish(readonly=True), "OK",
        setup=chain(STAGED, published(readonly=True)), changes="", ran="(lvs)"),
    row("record-but-bind-lost-rebound", publish(), "OK", setup=chain(PUBLISHED, umounted(TARGET)),
        ran="(lvs) mount", changes="mounts", check=mounted(TARGET, ro=False)),
    # The record says staged, but the volume's file system is no longer mounted there
    # (an operator's umount): binding the bare directory would hand the workload the
    # node's root file system instead of its volume.
    row("staging-mount-lost-bare-dir-never-bound", publish(), "FAILED_PRECONDITION",
        "not", setup=chain(STAGED, umounted(STAGE)), ran="(lvs)"),
    # A publish killed between its bind and its read-only remount.
    row("killed-before-remount-finished", publish(readonly=True), "OK",
        setup=chain(STAGED, bound(STAGE, TARGET)), ran="(lvs) mount",
        check=all_of(times("mount", 1), ran_cmd("mount", "-o", "remount,bind,ro", "@target"),
                     mounted(TARGET, ro=True), publishes((TARGET, True, SNW)))),
    row("killed-before-state-write", publish(), "OK", setup=chain(PUBLISHED, forget_publish()),
        changes="state", check=publishes((TARGET, False, SNW)), ran="(lvs)"),
    # A record rebuilt from mountinfo lacks the access mode; the CO's repeat settles it.
    row("rebuilt-record-takes-the-mode", publish(), "OK", setup=chain(PUBLISHED, rebuilt_publish()),
        changes="state", check=publishes((TARGET, False, SNW)), ran="(lvs)"),
    row("bind-fails", publish(), "INTERNAL", "mount exited 32",
        setup=chain(STAGED, fail("mount", rc=32)), ran="(lvs) mount"),
    row("readonly-remount-fails-bind-undone", publish(readonly=True), "INTERNAL",
        "mount exited 32", setup=chain(STAGED, fail("mount", "-o", rc=32)),
        ran="(lvs) mount umount"),
    # Block volumes: the device node bound onto a file; read-only through a read-only loop.
    row("block-rw", publish(cap=BLK), "OK", setup=BLOCK_STAGED, ran="(lvs) mount",
        check=all_of(ran_cmd("mount", "--bind", f"/dev/vg0/{V}", "@target"), times("mount", 1),
                     mounted(TARGET, "devtmpfs", ro=False, kind="file"), loops(),
                     publishes((TARGET, False, SNW)))),
    row("block-readonly-through-a-loop", publish(cap=BLK, readonly=True), "OK",
        setup=BLOCK_STAGED, ran="(lvs) losetup mount",
        check=all_of(ran_cmd("losetup", "--find", "--show", "--read-only", "--direct-io=on",
                             f"/dev/vg0/{V}"),
                     ran_cmd("mount", "--bind", LOOP, "@target"),
                     ran_cmd("mount", "-o", "remount,bind,ro", "@target"), loops(True),
                     mounted(TARGET, ro=True, kind="file"), publishes((TARGET, True, SNW)))),
    row("block-reader-only-mode-through-a-loop", publish(cap=block_cap(RO)), "OK",
        setup=chain(used(), staged(cap=block_cap(RO))), ran="(lvs) losetup mount",
        check=all_of(loops(True), mounted(TARGET, ro=True), publishes((TARGET, True, RO)))),
    row("block-parent-dir-made", publish(target="pods/p1/dev/vol", cap=BLK), "OK",
        setup=BLOCK_STAGED, ran="(lvs) mount", check=mounted("pods/p1/dev/vol", kind="file")),
    row("block-idempotent", publish(cap=BLK), "OK", setup=BLOCK_PUBLISHED, changes="", ran="(lvs)"),
    row("block-record-but-bind-lost-rebound", publish(cap=BLK), "OK",
        setup=chain(BLOCK_PUBLISHED, umounted(TARGET)), ran="(lvs) mount", changes="mounts",
        check=mounted(TARGET, "devtmpfs", kind="file")),
    row("block-readonly-idempotent", publish(cap=BLK, readonly=True), "OK",
        setup=RO_BLOCK_PUBLISHED, changes="", ran="(lvs)"),
    row("block-losetup-fails", publish(cap=BLK, readonly=True), "INTERNAL",
        "losetup exited 1", setup=chain(BLOCK_STAGED, fail("losetup")), ran="(lvs) losetup"),
    row("block-readonly-bind-fails-loop-detached", publish(cap=BLK, readonly=True), "INTERNAL",
        "mount exited 32", setup=chain(BLOCK_STAGED, fail("mount", rc=32)),
        ran="(lvs) losetup mount",
        check=ran_cmd("losetup", "--detach", LOOP)),
    row("block-readonly-remount-fails-all-undone", publish(cap=BLK, readonly=True),
        "INTERNAL", "mount exited 32", setup=chain(BLOCK_STAGED, fail("mount", "-o", rc=32)),
        ran="(lvs) losetup mount umount", check=ran_cmd("losetup", "--detach", LOOP)),
    # The remount's clean-up takes down only what the call mounted: a mount that was at
    # the target before it stays (it is not the plugin's, or not this call's).
    row("readonly-remount-fails-what-was-there-stays", publish(readonly=True), "INTERNAL",
        "mount exited 32", setup=chain(STAGED, foreign_mount(TARGET), fail("mount", "-o", rc=32)),
        ran="(lvs) mount umount", check=all_of(times("umount", 1), only_foreign(TARGET))),
    row("block-readonly-remount-fails-what-was-there-stays", publish(cap=BLK, readonly=True),
        "INTERNAL", "mount exited 32",
        setup=chain(BLOCK_STAGED, touch(TARGET), foreign_file_mount(TARGET),
                    fail("mount", "-o", rc=32)),
        ran="(lvs) losetup mount umount",
        check=all_of(times("umount", 1), only_foreign(TARGET),
                     ran_cmd("losetup", "--detach", LOOP))),
]


@pytest.mark.parametrize("case", PUBLISH_ROWS)
def test_node_publish_volume(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                             case: Case) -> None:
    run_row(tmp_path, monkeypatch, "NodePublishVolume", case)


@pytest.mark.parametrize(("setup", "cap", "readonly", "tools"), [
    pytest.param(STAGED, EXT4, False, "(lvs) mount umount", id="mount"),
    pytest.param(STAGED, EXT4, True, "(lvs) mount umount", id="mount-readonly"),
    pytest.param(BLOCK_STAGED, BLK, False, "(lvs) mount umount", id="block"),
    pytest.param(BLOCK_STAGED, BLK, True, "(lvs) losetup mount umount", id="block-readonly"),
])
def test_publish_undone_when_its_state_write_fails(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, setup: Setup,
        cap: pb.VolumeCapability, readonly: bool, tools: str) -> None:
    n = node(tmp_path, monkeypatch)
    setup(n)
    before = snapshot(n)
    n.host.calls.clear()

    def refuse(*args: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(StateStore, "add_publish", refuse)
    no_context: Any = None
    with pytest.raises(OSError) as err:  # the interceptor answers INTERNAL
        n.node.NodePublishVolume(publish(cap=cap, readonly=readonly)(n), no_context)
    assert status_of("NodePublishVolume", err.value)[0] == "INTERNAL"
    assert {c[0] for c in n.host.calls} == set(table.expected(tools, n.host.pv_metadata))
    assert snapshot(n) == before  # no mount, no loop device, no record
    if readonly and cap.HasField("block"):
        ran_cmd("losetup", "--detach", LOOP)(n, None)



def test_publish_logs_the_pod_kubelet_names(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            caplog: pytest.LogCaptureFixture) -> None:
    """With podInfoOnMount (the CSIDriver of the Kubernetes manifests),
    kubelet puts the pod's name, namespace and UID into volume_context: the
    publish is accepted with them (and any other key) and its log line names
    the pod; a publish without them (Nomad) logs no pod."""
    n = node(tmp_path, monkeypatch)
    STAGED(n)
    pod = {"csi.storage.k8s.io/pod.name": "app-0",
           "csi.storage.k8s.io/pod.namespace": "shop",
           "csi.storage.k8s.io/pod.uid": "0b7e3c52-5f1a-4c8e-9d2b-2f4c1a7e9b10",
           "csi.storage.k8s.io/serviceAccount.name": "default",
           "csi.storage.k8s.io/ephemeral": "false"}
    request = publish()(n)
    request.volume_context.update(pod)
    with caplog.at_level(logging.INFO, logger="csi_local.csi.node_servicer"):
        expect_ok(n.node.NodePublishVolume, request)
    (line,) = [r.getMessage() for r in caplog.records if "published" in r.getMessage()]
    assert "shop/app-0" in line and "0b7e3c52-5f1a-4c8e-9d2b-2f4c1a7e9b10" in line, line
    assert V in line and at(n, TARGET) in line, line
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="csi_local.csi.node_servicer"):
        expect_ok(n.node.NodePublishVolume, publish(target=TARGET2)(n))
    assert not [r for r in caplog.records if "for pod" in r.getMessage()]

# NodeUnpublishVolume ------------------------------------------------------------------------

UNPUBLISH_ROWS = [
    *invalid_ids(lambda vid: unpublish(vid)),
    *invalid_paths("target_path", lambda p: unpublish(target=p), PUBLISHED),
    row("lock-busy", unpublish(), "ABORTED", "already in progress", setup=PUBLISHED, busy=BUSY),
    row("not-published-nothing-mounted", unpublish(), "OK", setup=STAGED, changes=""),
    row("not-published-no-volume", unpublish(), "OK", changes=""),
    row("foreign-id-never-looked-up", unpublish(FOREIGN), "OK",
        setup=foreign_mount(TARGET), changes=""),
    row("mount-unmounted-dir-removed", unpublish(), "OK", setup=PUBLISHED, ran="umount",
        check=all_of(ran_cmd("umount", "@target"), unmounted(TARGET), exists(TARGET, None),
                     mounted(STAGE), publishes())),
    row("mount-readonly", unpublish(), "OK", setup=chain(STAGED, published(readonly=True)),
        ran="umount", check=all_of(unmounted(TARGET), exists(TARGET, None), publishes())),
    row("one-of-two-targets", unpublish(target=TARGET2), "OK",
        setup=chain(PUBLISHED, published(target=TARGET2)), ran="umount",
        check=all_of(unmounted(TARGET2), mounted(TARGET), publishes((TARGET, False, SNW)))),
    row("target-dir-not-empty-kept", unpublish(), "OK",
        setup=chain(PUBLISHED, touch(f"{TARGET}/left-behind")), ran="umount",
        check=all_of(unmounted(TARGET), exists(TARGET, "dir"), publishes())),
    row("record-but-mount-gone", unpublish(), "OK", setup=chain(PUBLISHED, umounted(TARGET)),
        changes="state", check=all_of(exists(TARGET, None), publishes())),
    row("record-target-gone", unpublish(), "OK",
        setup=chain(PUBLISHED, umounted(TARGET), rmdir(TARGET)), changes="state",
        check=all_of(exists(TARGET, None), publishes())),
    row("record-vg-missing-still-unpublished", unpublish(), "OK",
        setup=chain(PUBLISHED, vg_gone), ran="umount",
        check=all_of(unmounted(TARGET), publishes())),
    row("umount-fails-record-kept", unpublish(), "INTERNAL", "umount exited 32",
        setup=chain(PUBLISHED, fail("umount", rc=32)), ran="umount",
        check=exists(TARGET, "dir")),
    row("block-unbound-file-removed", unpublish(), "OK", setup=BLOCK_PUBLISHED, ran="umount",
        check=all_of(unmounted(TARGET), exists(TARGET, None), publishes(),
                     mounted(block_file()))),
    row("block-readonly-loop-detached", unpublish(), "OK", setup=RO_BLOCK_PUBLISHED,
        ran="umount losetup",
        check=all_of(ran_cmd("losetup", "--detach", LOOP), order("umount", "losetup"),
                     loops(), unmounted(TARGET), exists(TARGET, None), publishes())),
    # Without a record (a publish killed before its state write): LVM says what is ours.
    row("no-record-volume-bind-unmounted", unpublish(), "OK",
        setup=chain(PUBLISHED, forget_publish()), ran="lvs umount", changes="mounts",
        check=all_of(unmounted(TARGET), exists(TARGET, None))),
    row("no-record-block-bind-unmounted", unpublish(), "OK",
        setup=chain(BLOCK_PUBLISHED, forget_publish()), ran="lvs umount", changes="mounts",
        check=all_of(unmounted(TARGET), exists(TARGET, None))),
    row("no-record-readonly-block-loop-detached", unpublish(), "OK",
        setup=chain(RO_BLOCK_PUBLISHED, forget_publish()), ran="lvs umount losetup",
        changes="mounts", check=all_of(loops(), unmounted(TARGET), exists(TARGET, None))),
    row("no-record-foreign-mount-left-alone", unpublish(), "OK",
        setup=chain(STAGED, foreign_mount(TARGET)), ran="lvs", changes="",
        check=exists(TARGET, "dir")),
    row("no-record-other-volume-left-alone", unpublish(), "OK",
        setup=chain(used(), used(vid=V2), staged(V2, STAGE2), published(V2, path=STAGE2)),
        ran="lvs", changes="", check=mounted(TARGET, vid=V2)),
    row("no-record-volume-gone-mount-left-alone", unpublish(), "OK",
        setup=foreign_mount(TARGET), ran="lvs", changes=""),
    row("no-record-vg-missing", unpublish(), "UNAVAILABLE", "volume group vg0 not found",
        setup=chain(PUBLISHED, forget_publish(), vg_gone), ran="lvs"),
]


@pytest.mark.parametrize("case", UNPUBLISH_ROWS)
def test_node_unpublish_volume(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                               case: Case) -> None:
    run_row(tmp_path, monkeypatch, "NodeUnpublishVolume", case)


# NodeGetVolumeStats -------------------------------------------------------------------------

STATS_ROWS = [
    *[r for r in invalid_ids(lambda vid: stats(vid))],
    row("volume-path-missing", stats(path=""), "INVALID_ARGUMENT", "volume_path is required",
        setup=STAGED),
    # The spec: NOT_FOUND for "does not exist on the specified volume_path", so a
    # path that cannot be the volume's is NOT_FOUND too.
    row("not-staged", stats(), "NOT_FOUND", "is not staged or published at", setup=used()),
    row("no-volume", stats(), "NOT_FOUND", "is not staged or published at"),
    row("another-path", stats(path="elsewhere"), "NOT_FOUND", "is not staged or published",
        setup=chain(STAGED, mkdir("elsewhere"))),
    row("relative-path", stats(path="rel:stage"), "NOT_FOUND", "is not staged or published",
        setup=STAGED),
    row("dotdot-path", stats(path="x/../stage"), "NOT_FOUND", "is not staged or published",
        setup=STAGED),
    row("symlink-to-the-staging-path", stats(path="link"), "NOT_FOUND",
        "is not staged or published", setup=chain(STAGED, symlink("link", STAGE))),
    row("unpublished-target", stats(path=TARGET), "NOT_FOUND", "is not staged or published",
        setup=STAGED),
    row("vg-missing", stats(), "UNAVAILABLE", "volume group vg0 not found",
        setup=chain(STAGED, vg_gone), ran="lvs"),
    # Replies.
    row("mount-staging-path", stats(), "OK", setup=STAGED, ran="(lvs)", changes="",
        check=all_of(usage(fs=True), condition())),
    row("mount-trailing-slash", stats(path=STAGE + "/"), "OK", setup=STAGED, ran="(lvs)",
        changes="", check=all_of(usage(fs=True), condition())),
    row("mount-publish-target", stats(path=TARGET), "OK", setup=PUBLISHED, ran="(lvs)",
        changes="", check=all_of(usage(fs=True, path=TARGET), condition())),
    row("answers-while-the-volume-is-locked", stats(), "OK", setup=STAGED, busy=BUSY,
        ran="(lvs)", changes="", check=all_of(usage(fs=True), condition())),
    row("block-staging-path", stats(), "OK", setup=BLOCK_STAGED, ran="(lvs)", changes="",
        check=all_of(usage(block=GiB), condition())),
    row("block-publish-target", stats(path=TARGET), "OK", setup=BLOCK_PUBLISHED, ran="(lvs)",
        changes="", check=all_of(usage(block=GiB), condition())),
    row("block-readonly-target-through-a-loop", stats(path=TARGET), "OK",
        setup=RO_BLOCK_PUBLISHED, ran="(lvs)", changes="",
        check=all_of(usage(block=GiB), condition())),
    # Abnormal conditions.
    row("mount-not-mounted", stats(), "OK", setup=chain(STAGED, umounted(STAGE)), ran="(lvs)",
        changes="", check=all_of(usage(), condition("is not mounted"))),
    row("mount-target-not-mounted", stats(path=TARGET), "OK",
        setup=chain(PUBLISHED, umounted(TARGET)), ran="(lvs)", changes="",
        check=all_of(usage(), condition(f"{TARGET} is not mounted"))),
    row("block-not-bound", stats(), "OK", setup=chain(BLOCK_STAGED, umounted(block_file())),
        ran="(lvs)", changes="", check=all_of(usage(block=GiB), condition("is not mounted"))),
    row("lv-inactive", stats(), "OK", setup=chain(STAGED, umounted(STAGE), deactivated()),
        ran="(lvs)", changes="",
        check=all_of(usage(), condition("logical volume is not active", "is not mounted"))),
    row("block-lv-inactive", stats(), "OK",
        setup=chain(BLOCK_STAGED, umounted(block_file()), deactivated()), ran="(lvs)", changes="",
        check=all_of(usage(), condition("logical volume is not active"))),
    row("lv-missing", stats(), "OK", setup=chain(STAGED, umounted(STAGE), lv_removed()),
        ran="(lvs)", changes="",
        check=all_of(usage(), condition("logical volume is missing", "is not mounted"))),
    row("pool-out-of-data-space", stats(), "OK", setup=chain(STAGED, pool(data_percent=100.0)),
        ran="(lvs)", changes="",
        check=all_of(usage(fs=True), condition("thin pool is out of data space"))),
    row("pool-out-of-metadata-space", stats(), "OK",
        setup=chain(STAGED, pool(metadata_percent=100.0)), ran="(lvs)", changes="",
        check=condition("thin pool is out of metadata space")),
    row("pool-above-high-water-mark", stats(), "OK", setup=chain(STAGED, pool(data_percent=95.0)),
        ran="(lvs)", changes="", check=condition("is above its high-water mark",
                                               "data 95.0% full (limit 90%)")),
    row("pool-missing", stats(), "OK", setup=chain(STAGED, pool_removed), ran="(lvs)",
        changes="", check=condition("thin pool vg0/pool0 is missing")),
    row("fs-read-only", stats(), "OK", setup=chain(STAGED, fs_errors()), ran="(lvs)", changes="",
        check=all_of(usage(fs=True), condition("file system is read-only"))),
    row("fs-read-only-at-target", stats(path=TARGET), "OK", setup=chain(PUBLISHED, fs_errors()),
        ran="(lvs)", changes="", check=condition("file system is read-only")),
    row("fs-read-only-as-asked", stats(), "OK",
        setup=chain(used(), staged(cap=mount_cap(flags=("ro",))), fs_errors()), ran="(lvs)",
        changes="", check=all_of(usage(fs=True), condition())),
    row("fs-read-only-as-asked-in-a-flag-list", stats(), "OK",
        setup=chain(used(), staged(cap=mount_cap(flags=("noatime,ro",)))), ran="(lvs)",
        changes="", check=all_of(usage(fs=True), condition())),
]


@pytest.mark.parametrize("case", STATS_ROWS)
def test_node_get_volume_stats(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                               case: Case) -> None:
    run_row(tmp_path, monkeypatch, "NodeGetVolumeStats", case)


# NodeExpandVolume ---------------------------------------------------------------------------

EXPAND_ROWS = [
    *invalid_ids(lambda vid: expand(vid)),
    row("volume-path-missing", expand(path=""), "INVALID_ARGUMENT", "volume_path is required",
        setup=STAGED),
    row("lock-busy", expand(), "ABORTED", "already in progress", setup=STAGED, busy=BUSY),
    row("volume-missing", expand(), "NOT_FOUND", f"volume '{V}' not found", ran="lvs"),
    row("volume-missing-staged-path-irrelevant", expand(path="rel:x"), "NOT_FOUND",
        f"volume '{V}' not found", ran="lvs"),
    row("not-staged", expand(), "NOT_FOUND", "is not staged or published at", setup=used(),
        ran="lvs"),
    row("another-path", expand(path="elsewhere"), "NOT_FOUND", "is not staged or published",
        setup=STAGED, ran="lvs"),
    row("relative-path", expand(path="rel:stage"), "NOT_FOUND", "is not staged or published",
        setup=STAGED, ran="lvs"),
    row("symlink-to-the-staging-path", expand(path="link"), "NOT_FOUND",
        "is not staged or published", setup=chain(STAGED, symlink("link", STAGE)), ran="lvs"),
    row("vg-missing", expand(), "UNAVAILABLE", "volume group vg0 not found",
        setup=chain(STAGED, vg_gone), ran="lvs"),
    # Capacity the plugin cannot give: OUT_OF_RANGE (the table has no RESOURCE_EXHAUSTED).
    row("shrink", expand(rng=(0, 512 * MiB)), "OUT_OF_RANGE",
        "shrinking a volume is not supported", setup=STAGED, ran="lvs"),
    row("no-whole-extent-in-range", expand(rng=(GiB + 1, GiB + 2)), "OUT_OF_RANGE",
        "whole extents", setup=STAGED, ran="lvs"),
    row("pool-full", expand(rng=(11 * GiB, 0)), "OUT_OF_RANGE", "has room for",
        setup=STAGED, ran="lvs"),
    row("pool-lock-busy", expand(), "ABORTED", "already in progress", setup=STAGED,
        busy=pool_key("vg0", "pool0"), ran="lvs"),
    row("lvextend-fails", expand(), "INTERNAL", "lvextend exited 5",
        setup=chain(STAGED, fail("lvextend", rc=5)), ran="lvs lvextend"),
    row("fs-grow-fails-lv-grown", expand(), "INTERNAL", "resize2fs exited 1",
        setup=chain(STAGED, fail("resize2fs")), ran="lvs lvextend resize2fs", changes="lvs",
        check=lv_size(2 * GiB, fs_size=GiB)),
    # Growth.
    row("ext4", expand(), "OK", setup=STAGED, ran="lvs lvextend resize2fs",
        check=all_of(ran_cmd("lvextend", "--size", f"{2 * GiB}b", f"vg0/{V}"),
                     ran_cmd("resize2fs", "@dev"), order("lvextend", "resize2fs"),
                     capacity(2 * GiB), lv_size(2 * GiB, fs_size=2 * GiB))),
    row("xfs", expand(), "OK", setup=chain(used("xfs"), staged(cap=mount_cap("xfs"))),
        ran="lvs lvextend xfs_growfs",
        check=all_of(ran_cmd("xfs_growfs", "@stage"), capacity(2 * GiB),
                     lv_size(2 * GiB, fs_size=2 * GiB))),
    row("btrfs", expand(), "OK", setup=chain(used("btrfs"), staged(cap=mount_cap("btrfs"))),
        ran="lvs lvextend btrfs",
        check=all_of(ran_cmd("btrfs", "filesystem", "resize", "max", "@stage"),
                     capacity(2 * GiB), lv_size(2 * GiB, fs_size=2 * GiB))),
    row("xfs-by-publish-target-grown-at-staging", expand(path=TARGET), "OK",
        setup=chain(used("xfs"), staged(cap=mount_cap("xfs")),
                  published(cap=mount_cap("xfs"))),
        ran="lvs lvextend xfs_growfs",
        check=all_of(ran_cmd("xfs_growfs", "@stage"), capacity(2 * GiB))),
    row("rounded-up-to-whole-extents", expand(rng=(GiB + 1, 0)), "OK", setup=STAGED,
        ran="lvs lvextend resize2fs", check=all_of(capacity(GiB + 4 * MiB),
                                                   lv_size(GiB + 4 * MiB))),
    row("block-no-fs-grow", expand(), "OK", setup=BLOCK_STAGED, ran="lvs lvextend",
        check=all_of(capacity(2 * GiB), lv_size(2 * GiB, fs_size=GiB))),
    row("block-by-publish-target", expand(path=TARGET), "OK", setup=BLOCK_PUBLISHED,
        ran="lvs lvextend", check=capacity(2 * GiB)),
    row("no-capacity-range-grows-the-fs-only", expand(rng=None), "OK", setup=STAGED,
        ran="lvs resize2fs", changes="", check=capacity(GiB)),
    row("big-enough-already", expand(rng=(GiB, 0)), "OK", setup=STAGED, ran="lvs resize2fs",
        changes="", check=capacity(GiB)),
    # The controller grew the LV; the node grows the file system to match.
    row("finishes-a-controller-expansion", expand(rng=(2 * GiB, 0)), "OK",
        setup=chain(used(size=2 * GiB, fs_size=GiB), staged()), ran="lvs resize2fs",
        check=all_of(capacity(2 * GiB), lv_size(2 * GiB, fs_size=2 * GiB))),
]


@pytest.mark.parametrize("case", EXPAND_ROWS)
def test_node_expand_volume(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                            case: Case) -> None:
    run_row(tmp_path, monkeypatch, "NodeExpandVolume", case)


# NodeGetCapabilities, NodeGetInfo -----------------------------------------------------------


def test_node_get_capabilities(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    n = node(tmp_path, monkeypatch)
    reply = expect_ok(n.node.NodeGetCapabilities, pb.NodeGetCapabilitiesRequest())
    RPC = pb.NodeServiceCapability.RPC
    assert [c.rpc.type for c in reply.capabilities] == [
        RPC.STAGE_UNSTAGE_VOLUME, RPC.GET_VOLUME_STATS, RPC.VOLUME_CONDITION,
        RPC.SINGLE_NODE_MULTI_WRITER, RPC.EXPAND_VOLUME]
    assert n.host.calls == []


def test_node_get_info(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    n = node(tmp_path, monkeypatch)
    reply = expect_ok(n.node.NodeGetInfo, pb.NodeGetInfoRequest())
    assert reply.node_id == "node-1"
    assert reply.max_volumes_per_node == 0
    assert dict(reply.accessible_topology.segments) == {
        "topology.lvm.csi-local.dev/node": "node-1"}
    assert n.backend.config.topology_key == "topology.lvm.csi-local.dev/node"
    assert n.host.calls == []
