"""Upgrade and rollback between this version and four earlier ones, on real
LVM: the same VG, state directory and lock directory, served in turn by an
earlier version, installed from its commit into a venv of its own
(scripts/earlier-versions; tests/integration/earlier.py lists them), and by
this one.

Each earlier version makes volumes in every state a node holds (created only,
staged, staged and published with data, raw block staged and published,
encrypted when it can, one in a second device class on a VG of its own when
it knows classes, a snapshot, a volume restored from it, a clone) and is
stopped as a DaemonSet's rolling update stops it, with a CreateVolume and a
NodeStageVolume in flight: SIGTERM, then SIGKILL of it and every process it
started when the grace runs out. This version then reports every volume,
snapshot and the capacity as the earlier one did (ListVolumes, ListSnapshots,
GetCapacity), converges on the create and finishes the stage on their
retries, republishes idempotently, reads the data back (the restore's and the
clone's too), grows a volume (controller and node) and snapshots it,
unpublishes, unstages, stages and publishes again a mount and a raw block
volume, unstages and deletes one, stages
and publishes a volume the earlier one only created, makes one of its own,
and is stopped (SIGTERM) during a CreateVolume. The earlier version, started
again (the rollback), answers for all of them, this version's snapshot
included, converges on the interrupted create, and drains the node: every
volume unpublished, unstaged and deleted, nothing left in the VG or mounted.

The versions are the last release and milestones of CHANGELOG.md
("Pre-release milestones"), one of them from before encryption and device
classes. The README's command runs these tests when their venvs are built
(`.ci/run` builds them); without them they are the deep run's, and the run's
summary counts them there. Run alone, the tests fail naming the script.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from benchmarks.lab import SCRATCH, unmount_under
from csi_local._gen import csi_pb2 as pb
from csi_local.host import crypt, mounts
from csi_local.volumes import naming
from tests.integration.conftest import (
    LoopVG,
    PluginProcess,
    block_cap,
    make_vg,
    mount_cap,
    run,
)
from tests.integration.earlier import (
    EARLIER,
    ENCRYPTING,
    LAST_RELEASE,
    PLACEHOLDERS,
    VENVS,
    WITH_CLASSES,
    installed,
    python_of,
    venv_of,
)
from tests.integration.test_encryption import children, kill_commands
from tests.integration.test_encryption import create as create_encrypted
from tests.integration.test_encryption import stage as stage_encrypted
from tests.integration.test_freezes import child_running, wait_for
from tests.integration.test_node import create, publish, stage, unpublish, unstage

MiB = 1 << 20
DEFAULT_CLASS, SECOND_CLASS = "first", "second"
# What a DaemonSet's rolling update gives the old pod between SIGTERM and
# SIGKILL is its terminationGracePeriodSeconds (60 s as shipped). Here it is
# shorter than the work in flight, so that the SIGKILL lands mid-work: the
# harder case, and the one a slow node meets.
GRACE = 2.0


# In the README's command (`core`) when the venvs are built: the last release
# and the oldest version (the widest span: before device classes, encryption
# and the lvm shell); the others, and all of them without the venvs, are the
# deep run's, counted in the summary's "left to the deep run".
pytestmark = [pytest.mark.integration,
              pytest.mark.core if all(map(installed, EARLIER)) else pytest.mark.deep]
BUDGETED = {LAST_RELEASE, "667ac4e"}
VERSIONS = [pytest.param(c, marks=() if c in BUDGETED else pytest.mark.deep) for c in EARLIER]


@pytest.fixture(scope="module")
def pythons() -> dict[str, str]:
    """Each earlier version's interpreter: its venv's python."""
    missing = [c for c in EARLIER if not installed(c)]
    if missing:
        pytest.fail(f"no venv for {', '.join(missing)} under {VENVS}: build them on the host "
                    "with scripts/earlier-versions (it needs the repository's history and PyPI)")
    return {c: str(python_of(c)) for c in EARLIER}


def runs_from(python: str) -> str:
    """Where `python`'s csi_local comes from (its venv, not this checkout)."""
    return subprocess.run([python, "-I", "-c", "import csi_local; print(csi_local.__file__)"],
                          capture_output=True, text=True, check=True, timeout=300).stdout.strip()


def listed(p: PluginProcess) -> set[str]:
    return {e.volume.volume_id for e in p.controller.ListVolumes(pb.ListVolumesRequest()).entries}


def snapshots(p: PluginProcess) -> set[str]:
    return {e.snapshot.snapshot_id
            for e in p.controller.ListSnapshots(pb.ListSnapshotsRequest()).entries}


def answer(outcome: list[Any]) -> str:
    """What an in_thread call came to, in words."""
    if not outcome:
        return "nothing (cut off)"
    if isinstance(outcome[0], grpc.RpcError):
        return f"{outcome[0].code().name}: {outcome[0].details()}"
    return "OK"


def in_thread(fn: Any, *args: Any) -> tuple[threading.Thread, list[Any]]:
    """Call fn(*args) in a thread; its result or its RpcError in the list."""
    outcome: list[Any] = []

    def body() -> None:
        try:
            outcome.append(fn(*args))
        except grpc.RpcError as err:
            outcome.append(err)

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    return thread, outcome


@pytest.mark.parametrize("earlier", VERSIONS)
def test_upgrade_then_rollback_keeps_every_volume(vg: LoopVG, pythons: dict[str, str],
                                                  earlier: str) -> None:
    python = pythons[earlier]
    assert runs_from(python).startswith(str(venv_of(earlier))), \
        "the earlier version's code is not what runs"
    workdir = SCRATCH / f"up-{uuid.uuid4().hex[:8]}"
    # A version that knows device classes serves two, the second on a VG of
    # its own: both versions read the same classes file.
    second = make_vg(512 * MiB) if earlier in WITH_CLASSES else None
    config = None if second is None else classes_file(workdir, vg, second)
    # -I: the venv's package only, whatever PYTHONPATH or the working directory hold.
    old = PluginProcess(vg=vg, workdir=workdir, python=python, python_args=["-I"],
                        env=slow_mkfs_path(workdir), config_file=config)
    new = PluginProcess(vg=vg, workdir=workdir, config_file=config)
    try:
        with both_versions(old, new, workdir):
            upgrade_and_roll_back(old, new, encrypting=earlier in ENCRYPTING,
                                  placeholders=earlier in PLACEHOLDERS, second=second)
    finally:
        if second is not None:
            second.destroy()


def classes_file(workdir: Path, first: LoopVG, second: LoopVG) -> Path:
    """Two device classes: the default on the test's VG, `second` on a VG
    of its own, over-provisioned 2x (so the classes' capacities differ)."""
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / "classes.toml"
    path.write_text(f'''default = "{DEFAULT_CLASS}"

[classes.{DEFAULT_CLASS}]
volume_group = "{first.name}"
thin_pool = "{first.pool}"

[classes.{SECOND_CLASS}]
volume_group = "{second.name}"
thin_pool = "{second.pool}"
overprovision_ratio = 2.0
''')
    return path


@contextlib.contextmanager
def both_versions(old: PluginProcess, new: PluginProcess, workdir: Path,
                  cleanup: Callable[[], None] | None = None) -> Iterator[None]:
    """Run the block with the earlier version and this one sharing
    `workdir`; on a failure print their log (one file: both append to it);
    then kill both, unmount what is left under `workdir`, run `cleanup` and
    remove `workdir`."""
    try:
        yield
    except BaseException:
        print(f"--- the plugins' log (both versions) ---\n{old.log()[-30000:]}")
        raise
    finally:
        for p in (old, new):
            p.kill()
        unmount_under(workdir)
        if cleanup is not None:
            cleanup()
        run("rm", "-rf", "--one-file-system", str(workdir), check=False)


def slow_mkfs_path(workdir: Path) -> dict[str, str]:
    """A PATH with an `mkfs.ext4` first that, while `shims/slow` exists,
    waits 30 s before running the real one: a stage then stays in flight for
    as long as a test needs (else, on a quiet VM, it may end before the
    signal). Without the mark it is the real mkfs.ext4 at once."""
    shims = workdir / "shims"
    shims.mkdir(parents=True, exist_ok=True)
    real = shutil.which("mkfs.ext4", path="/usr/sbin:/sbin:/usr/bin:/bin")
    assert real is not None
    script = shims / "mkfs.ext4"
    script.write_text(
        "#!/bin/bash\n"
        f"if [[ -e {shlex.quote(str(shims / 'slow'))} ]]; then sleep 30; fi\n"
        f"exec {shlex.quote(real)} \"$@\"\n")
    script.chmod(0o755)
    return {"PATH": f"{shims}:{os.environ.get('PATH', '')}"}


def terminate_then_kill(p: PluginProcess, grace: float) -> bool:
    """Stop the plugin as the kubelet stops a pod: SIGTERM, then, if it still
    runs when `grace` is over, SIGKILL. Either way every process it started
    is killed too, as the end of the container's PID namespace kills them
    (they are watched during the grace: an exited plugin's children are no
    longer its children). Whether the SIGKILL was needed."""
    assert p.proc is not None
    pid = p.proc.pid
    started = children(pid)
    p.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    while p.proc.poll() is None and time.monotonic() < deadline:
        started |= children(pid)
        time.sleep(0.05)
    killed = p.proc.poll() is None
    if killed:
        kill_commands(pid)
    for child in started:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child, signal.SIGKILL)
    p.kill()
    return killed


Views = tuple[dict[str, tuple[int, bytes]], dict[str, tuple[str, int, bool]], list[int]]


def views(p: PluginProcess, classes: list[str]) -> Views:
    """What a CO sees of the node: each volume's capacity and content source
    (ListVolumes), each snapshot's source, size and readiness
    (ListSnapshots), and GetCapacity's bytes (the default class's, and
    each of `classes`')."""
    volumes = {e.volume.volume_id: (e.volume.capacity_bytes,
                                    e.volume.content_source.SerializeToString(deterministic=True))
               for e in p.controller.ListVolumes(pb.ListVolumesRequest()).entries}
    snaps = {e.snapshot.snapshot_id: (e.snapshot.source_volume_id, e.snapshot.size_bytes,
                                      e.snapshot.ready_to_use)
             for e in p.controller.ListSnapshots(pb.ListSnapshotsRequest()).entries}
    capacity = [p.controller.GetCapacity(pb.GetCapacityRequest(
        parameters={naming.DEVICE_CLASS_PARAMETER: c} if c else {})).available_capacity
        for c in ["", *classes]]
    return volumes, snaps, capacity


def same_reports(before: Views, after: Views, extra: int) -> None:
    """This version reports what the earlier one did: every volume and
    snapshot it listed, alike (a content source only where it gave one), and
    the same capacities, the default class's less `extra` bytes made in it
    since."""
    volumes, snaps, capacity = before
    now_volumes, now_snaps, now_capacity = after
    for vid, (size, source) in volumes.items():
        assert vid in now_volumes, vid
        assert now_volumes[vid][0] == size, (vid, now_volumes[vid][0], size)
        if source:
            assert now_volumes[vid][1] == source, vid
    assert {k: now_snaps.get(k) for k in snaps} == snaps
    assert now_capacity[0] == capacity[0] - extra, (now_capacity, capacity, extra)
    if len(capacity) > 1:  # with classes: the first is the default's again
        assert now_capacity[1:] == [capacity[1] - extra, *capacity[2:]], (now_capacity, capacity)


def thin_lv_bytes(p: PluginProcess, lv: str) -> int:
    out = run("lvs", "--noheadings", "--units", "b", "--nosuffix", "-o", "lv_size",
              f"{p.vg.name}/{lv}").stdout
    return int(out.strip())


def stats_total(p: PluginProcess, vid: str, target: str) -> int:
    reply = p.node.NodeGetVolumeStats(pb.NodeGetVolumeStatsRequest(
        volume_id=vid, volume_path=target))
    return max(u.total for u in reply.usage)


def placeholder_intact(p: PluginProcess, vid: str) -> bool:
    """Whether the volume's LV still starts with this version's placeholder
    LUKS2 header (and so holds no file system of an earlier version's)."""
    probe = run("blkid", "-p", "-o", "export", f"/dev/{p.vg.name}/{vid}", check=False).stdout
    return "TYPE=crypto_LUKS" in probe and f"LABEL={crypt.PLACEHOLDER_LABEL}" in probe


def upgrade_and_roll_back(old: PluginProcess, new: PluginProcess, *,
                          encrypting: bool, placeholders: bool,
                          second: LoopVG | None) -> None:
    path = old.path
    classes = [] if second is None else [DEFAULT_CLASS, SECOND_CLASS]
    # The earlier version makes a volume in every state.
    old.start()
    if second is not None:
        # One in the second class, published with data.
        other = old.controller.CreateVolume(pb.CreateVolumeRequest(
            name="up-second", capacity_range=pb.CapacityRange(required_bytes=32 * MiB),
            volume_capabilities=[mount_cap()],
            parameters={naming.DEVICE_CLASS_PARAMETER: SECOND_CLASS})).volume.volume_id
        assert other in second.lv_names()
        s_other, t_other = path("s-second"), path("t-second")
        stage(old, other, s_other)
        publish(old, other, s_other, t_other)
        Path(t_other, "data").write_bytes(b"in the second class\n")
        os.sync()
    made_encrypted: set[str] = set()
    if encrypting:
        # Encrypted, staged and published with data (kept through both moves).
        enc, s_enc, t_enc = create_encrypted(old, "up-enc"), path("s-enc"), path("t-enc")
        stage_encrypted(old, enc, s_enc)
        publish(old, enc, s_enc, t_enc)
        Path(t_enc, "data").write_bytes(b"encrypted by the earlier version\n")
        os.sync()
        made_encrypted.add(enc)
    idle = create(old, "up-idle")
    staged, s_staged = create(old, "up-staged"), path("s-staged")
    stage(old, staged, s_staged)
    pub, s_pub, t_pub = create(old, "up-pub"), path("s-pub"), path("t-pub")
    stage(old, pub, s_pub)
    publish(old, pub, s_pub, t_pub)
    Path(t_pub, "data").write_bytes(b"written by the earlier version\n")
    os.sync()
    blk, s_blk, t_blk = create(old, "up-blk", cap=block_cap()), path("s-blk"), path("t-blk")
    stage(old, blk, s_blk, block_cap())
    publish(old, blk, s_blk, t_blk, block_cap())
    snap = old.controller.CreateSnapshot(pb.CreateSnapshotRequest(
        name="up-snap", source_volume_id=pub), timeout=600).snapshot.snapshot_id
    source = pb.VolumeContentSource(snapshot=pb.VolumeContentSource.SnapshotSource(
        snapshot_id=snap))
    restored = old.controller.CreateVolume(pb.CreateVolumeRequest(
        name="up-restored", capacity_range=pb.CapacityRange(required_bytes=32 * MiB),
        volume_capabilities=[pb.VolumeCapability(
            mount=pb.VolumeCapability.MountVolume(fs_type="ext4"),
            access_mode=pb.VolumeCapability.AccessMode(
                mode=pb.VolumeCapability.AccessMode.SINGLE_NODE_WRITER))],
        volume_content_source=source)).volume.volume_id
    cloned = old.controller.CreateVolume(pb.CreateVolumeRequest(
        name="up-clone", capacity_range=pb.CapacityRange(required_bytes=32 * MiB),
        volume_capabilities=[mount_cap()],
        volume_content_source=pb.VolumeContentSource(
            volume=pb.VolumeContentSource.VolumeSource(volume_id=pub))),
        timeout=600).volume.volume_id
    mid, s_mid = create(old, "up-mid"), path("s-mid")
    # What the earlier version reports, for this one to report alike.
    seen_before = views(old, classes)
    # Stopped as a rolling update stops it, a stage and a create in flight:
    # the stage's mkfs held (the shim), the create sent just before SIGTERM.
    slow = old.workdir / "shims" / "slow"
    slow.touch()
    taker, staged_out = in_thread(stage, old, mid, s_mid)
    wait_for("the stage's mkfs", lambda: bool(staged_out) or child_running(old, "mkfs"), 300)
    creator, created_out = in_thread(create, old, "up-flight")
    time.sleep(0.1)  # sent; under emulation a create takes a second or more
    assert not staged_out, f"the stage ended before the signal: {answer(staged_out)}"
    assert not created_out, f"the create ended before the signal: {answer(created_out)}"
    killed = terminate_then_kill(old, GRACE)
    slow.unlink()
    taker.join(timeout=120)
    creator.join(timeout=120)
    print(f"SIGTERM with a create and a stage in flight; SIGKILL after {GRACE:.0f} s: "
          f"{'sent' if killed else 'not needed'}; "
          f"the stage answered {answer(staged_out)}, the create {answer(created_out)}")
    made = {idle, staged, pub, blk, restored, cloned, mid}
    if second is not None:
        made.add(other)

    # The upgrade: this version finds and finishes all of it.
    new.start()
    flight = create(new, "up-flight")  # the CO's retry converges
    if created_out and isinstance(created_out[0], str):
        assert flight == created_out[0]
    made.add(flight)
    assert made | made_encrypted <= listed(new)
    assert snap in snapshots(new)
    # ListVolumes, ListSnapshots and GetCapacity as the earlier version had
    # them (the converged create's LV aside, which the earlier one may not
    # have finished before its stop).
    same_reports(seen_before, views(new, classes), extra=thin_lv_bytes(new, flight))
    if second is not None:
        assert other in listed(new)
        publish(new, other, s_other, t_other)  # the kubelet's repeat: idempotent
        assert Path(t_other, "data").read_bytes() == b"in the second class\n"
    if encrypting:
        publish(new, enc, s_enc, t_enc)  # the kubelet's repeat: idempotent
        assert Path(t_enc, "data").read_bytes() == b"encrypted by the earlier version\n"
    # Encrypted, never staged: its placeholder header is all an earlier
    # version finds on it (below).
    unstaged_enc = create_encrypted(new, "up-enc-new")
    assert placeholder_intact(new, unstaged_enc)
    stage(new, mid, s_mid)
    assert len(mounts.mounts_at(s_mid)) == 1
    publish(new, pub, s_pub, t_pub)  # the kubelet's repeat: idempotent
    assert Path(t_pub, "data").read_bytes() == b"written by the earlier version\n"
    stats = new.node.NodeGetVolumeStats(pb.NodeGetVolumeStatsRequest(
        volume_id=pub, volume_path=t_pub))
    assert any(u.total > 0 for u in stats.usage)
    s_idle, t_idle = path("s-idle"), path("t-idle")
    stage(new, idle, s_idle)
    publish(new, idle, s_idle, t_idle)
    # The earlier version's restore and clone hold the data its volume held.
    copies = {restored: (path("s-restored"), path("t-restored")),
              cloned: (path("s-clone"), path("t-clone"))}
    for vid, (staging, target) in copies.items():
        stage(new, vid, staging)
        publish(new, vid, staging, target)
        assert Path(target, "data").read_bytes() == b"written by the earlier version\n", vid
    # Grown (controller, then node) and snapshotted by this version.
    total = stats_total(new, pub, t_pub)
    grown = new.controller.ControllerExpandVolume(pb.ControllerExpandVolumeRequest(
        volume_id=pub, capacity_range=pb.CapacityRange(required_bytes=64 * MiB)))
    assert grown.capacity_bytes >= 64 * MiB
    new.node.NodeExpandVolume(pb.NodeExpandVolumeRequest(
        volume_id=pub, volume_path=t_pub, staging_target_path=s_pub,
        capacity_range=pb.CapacityRange(required_bytes=64 * MiB), volume_capability=mount_cap()))
    assert stats_total(new, pub, t_pub) > total
    assert Path(t_pub, "data").read_bytes() == b"written by the earlier version\n"
    snap_new = new.controller.CreateSnapshot(pb.CreateSnapshotRequest(
        name="up-snap-new", source_volume_id=pub), timeout=600).snapshot.snapshot_id
    # Unpublished, unstaged, staged and published again by this version, in
    # mount and block mode; the data still there.
    for vid, staging, target, cap in ((pub, s_pub, t_pub, mount_cap()),
                                      (blk, s_blk, t_blk, block_cap())):
        unpublish(new, vid, target)
        unstage(new, vid, staging)
        assert len(mounts.mounts_at(staging)) == 0
        stage(new, vid, staging, cap)
        publish(new, vid, staging, target, cap)
    assert Path(t_pub, "data").read_bytes() == b"written by the earlier version\n"
    # A volume the earlier version staged: unstaged and deleted by this one.
    unstage(new, staged, s_staged)
    new.controller.DeleteVolume(pb.DeleteVolumeRequest(volume_id=staged))
    assert staged not in listed(new) and staged not in new.vg.lv_names()
    made.discard(staged)
    own, s_own = create(new, "up-own"), path("s-own")
    stage(new, own, s_own)
    # Stopped (SIGTERM) while a CreateVolume runs.
    creator, created = in_thread(create, new, "up-term")
    time.sleep(0.3)
    new.stop()
    creator.join(timeout=120)

    # The rollback: the earlier version answers for everything and drains the node.
    old.start()
    term = create(old, "up-term")  # converges whether or not the first one finished
    if created and isinstance(created[0], str):
        assert term == created[0]
    every = made | made_encrypted | {own, term, unstaged_enc}
    assert every <= listed(old)
    assert {snap, snap_new} <= snapshots(old)
    s_new_enc = path("s-enc-new")
    if placeholders:
        # A version that writes the placeholder header formats it for real at
        # the first stage, as this one does.
        stage_encrypted(old, unstaged_enc, s_new_enc)
        assert not placeholder_intact(old, unstaged_enc)
        assert len(mounts.mounts_at(s_new_enc)) == 1
        unstage(old, unstaged_enc, s_new_enc)
    else:
        # An earlier version that knows no encryption takes the volume for a
        # plain one, and its mkfs meets the placeholder header: refused,
        # nothing written (before the placeholder, the bare LV took a file
        # system in plain text). One that encrypts but knows no placeholder
        # finds a header its key does not open: refused too
        # (UNAUTHENTICATED), nothing written.
        with pytest.raises(grpc.RpcError) as refused:
            if encrypting:
                stage_encrypted(old, unstaged_enc, s_new_enc)
            else:
                stage(old, unstaged_enc, s_new_enc)
        print(f"the earlier version's stage of a new encrypted volume: "
              f"{refused.value.code().name}: {refused.value.details()}")
        assert placeholder_intact(old, unstaged_enc)
        assert len(mounts.mounts_at(s_new_enc)) == 0
    if encrypting:
        unpublish(old, enc, t_enc)
        unstage(old, enc, s_enc)
    published = [(pub, s_pub, t_pub), (idle, s_idle, t_idle), (blk, s_blk, t_blk),
                 *((vid, staging, target) for vid, (staging, target) in copies.items())]
    if second is not None:
        published.append((other, s_other, t_other))
    for vid, staging, target in published:
        unpublish(old, vid, target)
        unstage(old, vid, staging)
    for vid, staging in ((mid, s_mid), (own, s_own)):
        unstage(old, vid, staging)
    for snapshot_id in (snap, snap_new):
        old.controller.DeleteSnapshot(pb.DeleteSnapshotRequest(snapshot_id=snapshot_id))
    for vid in sorted(every):
        old.controller.DeleteVolume(pb.DeleteVolumeRequest(volume_id=vid))
    assert old.vg.lv_names() == []
    assert second is None or second.lv_names() == []
    prefix = str(old.workdir) + "/"
    assert [m.mount_point for m in mounts.read_mounts() if m.mount_point.startswith(prefix)] == []
