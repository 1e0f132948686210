"""The plugin's mounts against mount(8)'s, option set by option set (issue 30).

The plugin mounts with mount(2) itself (host.kernel.mount_call and remount_flags)
where it knows the call mount(8) would make. Each row here stages and
publishes a volume through the plugin (read-write and read-only), then mounts
the same device with mount(8) and the same options (and `ro` last for the
read-only publish), and compares the mountinfo lines field by field: the
mount's options and the file system's (super) options. The outcome is compared
too: an option set mount(8) refuses must fail the stage, one it takes must not.

Any difference fails, unless docs/architecture.md documents it: DOCUMENTED
below names each such difference and the text that explains it.

One plugin and one volume per file system serve every row (stage, publish,
compare, unpublish, unstage), to keep the emulated VM's time low.
"""

from __future__ import annotations

import errno
import os
import time
from dataclasses import dataclass

import grpc
import pytest

from csi_local._gen import csi_pb2 as pb
from csi_local.host import mounts
from tests.integration.conftest import LoopVG, PluginProcess, block_cap, mount_cap, run
from tests.integration.test_node import create, publish, stage, unpublish, unstage

pytestmark = pytest.mark.integration
MiB = 1 << 20
SIZES = {"ext4": 32 * MiB, "xfs": 300 * MiB, "btrfs": 128 * MiB}
SE_CONTEXT = 'context="system_u:object_r:container_file_t:s0:c10,c20"'

# Differences from mount(8) that docs/architecture.md documents, by (line, field, option):
# the plugin's line shows the option where mount(8)'s does not ("+") or the
# reverse ("-"). The value names the text.
README_RO_PUBLISH = ("docs/architecture.md, Mount options: \"A read-only publish is a "
                     "read-only bind of the read-write staged file system\"")
README_NOUUID = "docs/architecture.md, Mount options and Snapshots: xfs is mounted with nouuid"
DOCUMENTED: dict[tuple[str, str, str], str] = {
    # mount(8) -o ...,ro mounts the file system itself read-only; a read-only
    # publish only makes its bind read-only (other publishes may write).
    ("publish-ro", "super", "+rw"): README_RO_PUBLISH,
    ("publish-ro", "super", "-ro"): README_RO_PUBLISH,
}
DOCUMENTED_XFS: dict[tuple[str, str, str], str] = {
    (line, "super", "+nouuid"): README_NOUUID for line in ("stage", "publish-rw", "publish-ro")
}

# mount(8)'s flag options (libmount's map), each with its negation, and the
# orders that conflict; `defaults`, SELinux's context, and unknown options.
# The flags are the kernel's, the same for every file system: ext4 takes the
# whole table, xfs and btrfs a few rows of it and their own options.
FLAG_ROWS: list[tuple[str, ...]] = [
    (),
    ("defaults",),
    ("ro",),
    ("nosuid", "nodev", "noexec", "nosymfollow", "nodiratime", "noatime", "sync", "dirsync",
     "lazytime", "iversion", "mand", "silent"),
    ("suid", "dev", "exec", "symfollow", "diratime", "atime", "async", "nolazytime",
     "noiversion", "nomand", "loud", "norelatime", "nostrictatime"),
    ("ro", "rw"), ("rw", "ro"), ("noatime", "rw"),
    ("noatime", "atime"), ("atime", "noatime"),
    ("noatime", "relatime"), ("relatime", "noatime"),
    ("strictatime", "noatime"), ("noatime", "strictatime"),
    ("strictatime", "relatime"), ("relatime", "norelatime"), ("strictatime", "nostrictatime"),
    ("nosuid", "suid"), ("nodev", "dev"), ("noexec", "exec"), ("nosymfollow", "symfollow"),
    ("nodiratime", "diratime"), ("sync", "async"), ("lazytime", "nolazytime"),
    ("nodev,noatime,ro",),
    (SE_CONTEXT,), (f"noatime,{SE_CONTEXT}",),
    ("bogus_option",),
]
SOME_FLAG_ROWS: list[tuple[str, ...]] = [
    (), ("ro",), ("noatime", "rw"), ("noatime", "relatime"), (f"nodev,{SE_CONTEXT}",),
]
ROWS: dict[str, list[tuple[str, ...]]] = {
    "ext4": [*FLAG_ROWS, ("discard",), ("errors=remount-ro", "commit=30"),
             ("nodelalloc", "noatime"), ("data=journal",), ("barrier=0",)],
    "xfs": [*SOME_FLAG_ROWS, ("discard",), ("logbufs=4", "noatime"), ("inode64", "noquota"),
            ("ro", "norecovery"), ("nouuid",)],
    "btrfs": [*SOME_FLAG_ROWS, ("compress=zstd",), ("discard=async", "noatime"),
              ("space_cache=v2",), ("ssd", "ro"), ("noacl",)],
}


@dataclass
class Seen:
    """What one mount showed: its options and its file system's, or why it failed."""

    options: frozenset[str] = frozenset()
    super_options: frozenset[str] = frozenset()
    error: str = ""


def seen(path: str) -> Seen:
    top = mounts.top_mount(path)
    assert top is not None, f"nothing mounted at {path}"
    return Seen(top.options, top.super_options)


def mount8(argv: list[str], target: str) -> Seen:
    """mount(8) as given, its line in mountinfo, and umount."""
    res = run(*argv, check=False)
    if res.returncode != 0:
        return Seen(error=res.stderr.strip() or f"exit {res.returncode}")
    try:
        return seen(target)
    finally:
        run("umount", target)


def diff(line: str, field: str, ours: frozenset[str], theirs: frozenset[str]) -> set[str]:
    return ({f"{line} {field} +{o}" for o in ours - theirs}
            | {f"{line} {field} -{o}" for o in theirs - ours})


def undocumented(found: set[str], documented: dict[tuple[str, str, str], str]) -> list[str]:
    return sorted(d for d in found if tuple(d.split(" ", 2)) not in documented)


def write_error(path: str) -> int | None:
    """errno of creating a file under `path` (None: the write worked)."""
    try:
        with open(os.path.join(path, "probe"), "w") as f:
            f.write("x")
    except OSError as err:
        return err.errno
    os.unlink(os.path.join(path, "probe"))
    return None


def compare_row(plugin: PluginProcess, vid: str, dev: str, fs: str,
                flags: tuple[str, ...], n: int) -> list[str]:
    """One row: the plugin's stage and publishes, then mount(8)'s; the differences."""
    staging = plugin.path(f"stage-{fs}-{n}")
    rw_target, ro_target = plugin.path("pod", f"{fs}-{n}-rw"), plugin.path("pod", f"{fs}-{n}-ro")
    cap = mount_cap(fs, flags)
    ours: dict[str, Seen] = {}
    problems: list[str] = []
    try:
        stage(plugin, vid, staging, cap)
    except grpc.RpcError as err:
        ours["stage"] = Seen(error=f"{err.code().name}: {err.details()}")
    else:
        try:
            ours["stage"] = seen(staging)
            publish(plugin, vid, staging, rw_target, cap)
            ours["publish-rw"] = seen(rw_target)
            publish(plugin, vid, staging, ro_target, cap, readonly=True)
            ours["publish-ro"] = seen(ro_target)
            # Read-only wins, whatever the flags say.
            got = write_error(ro_target)
            if got != errno.EROFS:
                problems.append(f"write to the read-only publish: {errno.errorcode.get(got or 0)}"
                                " instead of EROFS")
            rw_fails = write_error(rw_target) is not None
            if rw_fails != ("ro" in ours["publish-rw"].options):
                problems.append("the read-write publish's writes do not match its ro flag")
        finally:
            for t in (ro_target, rw_target):
                if os.path.exists(t):
                    unpublish(plugin, vid, t)
            unstage(plugin, vid, staging)
    reference = plugin.path(f"mount8-{fs}-{n}")
    os.makedirs(reference, exist_ok=True)
    opts = ",".join(flags)
    base = ["mount", "-t", fs]
    theirs_rw = mount8([*base, *(["-o", opts] if opts else []), dev, reference], reference)
    theirs_ro = mount8([*base, "-o", f"{opts},ro" if opts else "ro", dev, reference], reference)
    if ours["stage"].error or theirs_rw.error:
        if bool(ours["stage"].error) != bool(theirs_rw.error):
            problems.append(f"outcome: plugin {ours['stage'].error or 'mounted'}, "
                            f"mount(8) {theirs_rw.error or 'mounted'}")
        return problems
    found: set[str] = set()
    for line, theirs in (("stage", theirs_rw), ("publish-rw", theirs_rw),
                         ("publish-ro", theirs_ro)):
        found |= diff(line, "options", ours[line].options, theirs.options)
        found |= diff(line, "super", ours[line].super_options, theirs.super_options)
    documented = {**DOCUMENTED, **(DOCUMENTED_XFS if fs == "xfs" else {})}
    problems += undocumented(found, documented)
    return problems


def run_table(plugin: PluginProcess, vg: LoopVG, fs: str) -> None:
    start = time.monotonic()
    vid = create(plugin, f"diff-{fs}", SIZES[fs], mount_cap(fs))
    dev = f"/dev/{vg.name}/{vid}"
    # The first stage formats the volume; every row then mounts it as it is.
    first = plugin.path(f"format-{fs}")
    stage(plugin, vid, first, mount_cap(fs))
    unstage(plugin, vid, first)
    rows = ROWS[fs]
    failures = {}
    for n, flags in enumerate(rows):
        problems = compare_row(plugin, vid, dev, fs, flags, n)
        if problems:
            failures[",".join(flags) or "(none)"] = problems
    print(f"{fs}: {len(rows)} option sets compared in {time.monotonic() - start:.1f} s")
    assert not failures, "\n".join(f"{k}: {v}" for k, v in failures.items())


@pytest.mark.parametrize("fs", ["ext4", "xfs", "btrfs"])
def test_mounts_match_mount8(plugin: PluginProcess, vg: LoopVG, fs: str) -> None:
    run_table(plugin, vg, fs)


def test_block_publishes_match_mount8(plugin: PluginProcess, vg: LoopVG) -> None:
    """A block volume's publishes against mount(8)'s bind (and its read-only
    remount) of the device node; a read-only publish refuses writes to the
    device, where a read-only bind of the node alone would not."""
    vid = create(plugin, "diff-block", 8 * MiB, block_cap())
    dev = f"/dev/{vg.name}/{vid}"
    staging = plugin.path("stage-block")
    rw_target, ro_target = plugin.path("dev", "blk-rw"), plugin.path("dev", "blk-ro")
    stage(plugin, vid, staging, block_cap())
    publish(plugin, vid, staging, rw_target, block_cap())
    publish(plugin, vid, staging, ro_target, block_cap(), readonly=True)
    ours = {"publish-rw": seen(rw_target), "publish-ro": seen(ro_target)}
    with pytest.raises(OSError) as info:
        fd = os.open(ro_target, os.O_WRONLY)
        try:
            os.pwrite(fd, b"x" * 4096, 0)
        finally:
            os.close(fd)
    # The read-only loop device under the publish: the block layer's EPERM.
    assert info.value.errno == errno.EPERM
    fd = os.open(rw_target, os.O_WRONLY)
    try:
        assert os.pwrite(fd, b"y" * 4096, 0) == 4096
    finally:
        os.close(fd)
    unpublish(plugin, vid, ro_target)
    unpublish(plugin, vid, rw_target)
    unstage(plugin, vid, staging)
    reference = plugin.path("dev", "mount8")
    open(reference, "a").close()
    found: set[str] = set()
    for line, ro in (("publish-rw", False), ("publish-ro", True)):
        run("mount", "--bind", dev, reference)
        try:
            if ro:
                run("mount", "-o", "remount,bind,ro", reference)
            theirs = seen(reference)
        finally:
            run("umount", reference)
        found |= diff(line, "options", ours[line].options, theirs.options)
        found |= diff(line, "super", ours[line].super_options, theirs.super_options)
    assert not undocumented(found, {}), sorted(found)


# Regression tests for issue 30's defects 1 and 5, on their own -------------------------


def test_a_rw_flag_never_makes_a_read_only_publish_writable(plugin: PluginProcess) -> None:
    """Defect 1: a StorageClass's mountOptions [noatime, rw] with a read-only
    publish, by the request or by a reader-only mode: the target is read-only."""
    vid = create(plugin, "ro-wins")
    staging = plugin.path("stage-ro-wins")
    flags = ("noatime", "rw")
    stage(plugin, vid, staging, mount_cap(flags=flags))
    by_request, by_mode = plugin.path("pod", "ro-request"), plugin.path("pod", "ro-mode")
    publish(plugin, vid, staging, by_request, mount_cap(flags=flags), readonly=True)
    reader = mount_cap(flags=flags, mode=pb.VolumeCapability.AccessMode.SINGLE_NODE_READER_ONLY)
    publish(plugin, vid, staging, by_mode, reader)
    for target in (by_request, by_mode):
        top = mounts.top_mount(target)
        assert top is not None and "ro" in top.options and "noatime" in top.options, top
        assert write_error(target) == errno.EROFS, target
    assert write_error(staging) is None  # the staged file system stays writable
    for target in (by_request, by_mode):
        unpublish(plugin, vid, target)
    unstage(plugin, vid, staging)


def test_an_selinux_context_flag_mounts_as_mount8_does(plugin: PluginProcess,
                                                       vg: LoopVG) -> None:
    """Defect 5: kubelet's seLinuxMount flag (quoted, with a comma) is taken at
    stage and publish, and the stage has the outcome and options of mount(8)
    with the same flag (on this kernel without SELinux: mounted, the context
    dropped by mount(8); mount(2) with it alone fails with EINVAL)."""
    vid = create(plugin, "selinux")
    staging, target = plugin.path("stage-selinux"), plugin.path("pod", "selinux")
    cap = mount_cap(flags=(f"nodev,{SE_CONTEXT}",))
    stage(plugin, vid, staging, cap)
    publish(plugin, vid, staging, target, cap, readonly=True)
    ours = seen(staging), seen(target)
    assert write_error(target) == errno.EROFS
    unpublish(plugin, vid, target)
    unstage(plugin, vid, staging)
    reference = plugin.path("mount8-selinux")
    os.makedirs(reference)
    theirs = mount8(["mount", "-t", "ext4", "-o", f"nodev,{SE_CONTEXT}",
                     f"/dev/{vg.name}/{vid}", reference], reference)
    assert not theirs.error
    assert (ours[0].options, ours[0].super_options) == (theirs.options, theirs.super_options)
    assert "nodev" in ours[1].options and "ro" in ours[1].options
