"""Differential test: the plugin's answers from the VGs' committed metadata
against LVM's own (`lvs`), after every step of a seeded random walk that
mixes the plugin's RPCs with what an operator and other tools do to the same
VG: LVs made, removed, renamed, extended and deactivated by hand, tags
changed by hand, PVs added and removed (vgextend, vgreduce), a PV detached
and attached again with its outdated metadata, two metadata copies on a PV
and one ignored (pvchange --metadataignore), metadata areas small enough that
their ring wraps many times, and the plugin's lvm shell killed in the middle
of a command.

After each step, one `lvs` (a process of its own) is LVM's answer; every
answer of the plugin (ListVolumes, ControllerGetVolume, ListSnapshots,
GetCapacity, a CreateVolume retry) must equal what it says, and so must
`csi-local status --json` (see STATUS_EVERY). So must what the plugin reads
at its start from a partial parse of the text (only the LVs it names): Probe's
thin pool (CommittedMetadata.thin_pools) and the state's records
(Pools.lookup); and the partial parse itself must equal the whole one
restricted to the same LVs (see Walk.compare_partial). The plugin runs in this
process (its servicers called directly: gRPC adds nothing to what is compared), with
its lvm shell, as `serve` runs it. Each part prints its seed, its steps, and
where its time went.

    CSI_LOCAL_WALK_STEPS  steps in all (default 80), split evenly between
                          PARTS walks of their own VG and seed: 20 a part,
                          each kind of step once and 6 drawn. A step took
                          2.6 to 6.5 s on a quiet emulated CPU (see
                          Walk.actions), 11 s in a loaded CI run. The README's
                          command runs the parts that fit its VM budget
                          (tests/harness/vm.py); the long walk is a command
                          of its own (CONTRIBUTING.md, "Deep runs"): 5,000
                          steps.
    CSI_LOCAL_WALK_SEED   the first part's seed, part i's is that plus i
                          (default: a fresh random one each run, printed)

However short, every part takes every kind of step at least once (see
`must_take`): a short walk draws other states than a long one, never fewer
kinds of change.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import random
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest

from csi_local._gen import csi_pb2 as pb
from csi_local.config import Config
from csi_local.csi.plugin import CsiPlugin
from csi_local.csi.rpc import status_of
from csi_local.host.kernel import Kernel
from csi_local.host.runner import Output, ProcessRunner, Result
from csi_local.ops import status as status_mod
from csi_local.storage.lvm import _REPORT, LV_FIELDS, LogicalVolume, VgReport, parse_lvs
from csi_local.storage.lvm_shell import LvmShell
from csi_local.storage.vg_text import VgMetadata, read_committed, vg_metadata
from csi_local.volumes import naming
from csi_local.volumes.pool import capacity_of
from tests.integration.conftest import SCRATCH, mount_cap, run

pytestmark = pytest.mark.integration
MiB = 1 << 20
STEPS = int(os.environ.get("CSI_LOCAL_WALK_STEPS", "80"))
# 50 steps a part at the default: a walk's VG gathers LVs and long tags, so a
# step costs more the longer its part (every command parses the whole VG).
PARTS = 4
POOL = "pool"
PROGRESS = os.environ.get("CSI_LOCAL_WALK_PROGRESS") == "1"  # a line per step, as it goes
# `csi-local status` reads LVM itself: a `vgs`, a `pvs` and a `vgs` of its own
# (its `lvs` is the comparison's), 1 to 2 s in a VM. Its code runs in this
# process every STATUS_EVERY steps and after every step of the PV that goes
# away (where its answer changes); the command itself, a Python of its own
# as an operator runs it, at each part's last step and every CLI_EVERY steps.
STATUS_EVERY = 50
CLI_EVERY = 125
# The weight of the step that moves the PV going away on, while it is missing
# or outdated (see Walk.actions).
DEGRADED_PACE = 10.0
# Pools.lookup asks `lvs` for the names the committed metadata cannot answer
# (one that is gone: LVM has the last word on absence; the pool: not a
# volume). That `lvs` is a second one each step (1.1 s a step in a VM on a
# busy host: a fifth of the step), so such names are asked every
# LOOKUP_LVM_EVERY steps; the other steps ask only for thin LVs, which the
# metadata answers without a process.
LOOKUP_LVM_EVERY = 5


class Divergence(AssertionError):
    pass


class Moment:
    """LVM's answers in the moment between a step and the next: each command
    a process of its own, run once; the same argv asked again before
    forget() gets the answer the first run gave, as a second process would
    (nothing the comparisons do changes LVM). A failure is not kept."""

    def __init__(self, runner: ProcessRunner) -> None:
        self.runner = runner
        self.answers: dict[tuple[str, ...], Result] = {}

    def forget(self) -> None:
        self.answers.clear()

    def run(self, argv: Sequence[str], *, ok_codes: Sequence[int] = (0,),
            input: str | bytes | None = None, timeout: float | None = None) -> Result:
        key = tuple(str(a) for a in argv)
        kept = self.answers.get(key)
        if kept is not None and input is None:
            return kept
        result = self.runner.run(argv, ok_codes=ok_codes, input=input, timeout=timeout)
        if input is None and result.returncode == 0:
            self.answers[key] = result
        return result

    def stream(self, argv: Sequence[str], *, timeout: float | None = None
               ) -> contextlib.AbstractContextManager[Output]:
        return self.runner.stream(argv, timeout=timeout)


@dataclass
class Clock:
    """Where a walk's time goes: seconds and count per kind of work, printed
    at the end of each part (a step's cost is CI's time)."""

    spent: dict[str, float] = field(default_factory=dict)
    count: dict[str, int] = field(default_factory=dict)

    def add(self, what: str, seconds: float) -> None:
        self.spent[what] = self.spent.get(what, 0.0) + seconds
        self.count[what] = self.count.get(what, 0) + 1

    @contextlib.contextmanager
    def timed(self, what: str) -> Iterator[None]:
        started = time.monotonic()
        try:
            yield
        finally:
            self.add(what, time.monotonic() - started)

    def observe(self, tool: str, seconds: float, ok: bool) -> None:
        """The plugin runner's observer: every command the plugin runs."""
        self.add(f"plugin runs {tool}", seconds)

    def summary(self) -> str:
        return "; ".join(f"{what} {self.count[what]}x {secs:.1f} s"
                         for what, secs in sorted(self.spent.items(), key=lambda i: -i[1]))


@dataclass
class Disk:
    """A loop device on an image: one PV of the walk."""

    image: Path
    loop: str
    pv_args: tuple[str, ...]
    in_vg: bool = False
    attached: bool = True
    outdated: bool = False  # attached again after the VG was reduced without it

    @property
    def degraded(self) -> bool:
        """Away while the VG lists it, or back with an outdated copy: LVM
        refuses changes or warns, and the plugin takes LVM's answers."""
        return (self.in_vg and not self.attached) or (self.attached and self.outdated)

    def attach(self) -> None:
        run("losetup", self.loop, str(self.image))  # at the node the plugin knew
        self.attached = True

    def detach(self) -> None:
        run("losetup", "--detach", self.loop)
        self.attached = False


@dataclass
class Walk:
    rng: random.Random
    vg: str
    disks: dict[str, Disk]
    plugin: CsiPlugin
    made: dict[str, tuple[str, int]] = field(default_factory=dict)  # CO name -> (id, size)
    ever: set[str] = field(default_factory=set)  # every LV name seen
    last: list[LogicalVolume] = field(default_factory=list)  # the last `lvs`'s LVs
    counter: int = 0
    steps: dict[str, int] = field(default_factory=dict)
    failed_commands: int = 0
    fallbacks: int = 0
    clock: Clock = field(default_factory=Clock)
    moment: Moment = field(default_factory=lambda: Moment(ProcessRunner()))
    # What the checks of the partial parse pick (compare_partial): a draw of
    # their own, so that a seed walks the same steps with them as without.
    picks: random.Random = field(default_factory=random.Random)
    parsed: VgMetadata | None = None  # the walk's own last whole parse of the text
    partial_fallbacks: int = 0  # comparisons where thin_pools did not answer

    # LVM's answer ---------------------------------------------------------

    def truth(self) -> tuple[list[LogicalVolume], int, str]:
        """Every LV of the VG, the extent size, and LVM's warnings: one `lvs`,
        a process of its own started after the step (never an lvm shell,
        whose view of the devices is as old as the shell). Its argv is
        `Lvm.report`'s: `status`, run in this moment, takes its answer
        (Moment) instead of running the same command again."""
        self.moment.forget()
        with self.clock.timed("lvs (LVM's answer)"):
            proc = self.moment.run(["lvs", *_REPORT, "-o", LV_FIELDS + ",vg_extent_size",
                                    self.vg])
        rows = [r for rep in json.loads(proc.stdout)["report"] for r in rep["lv"]]
        lvs = parse_lvs(proc.stdout)
        self.ever.update(lv.name for lv in lvs)
        self.last = lvs
        return lvs, int(rows[0]["vg_extent_size"]), proc.stderr

    def lvm(self, *argv: str) -> bool:
        """A command by hand; False when LVM refused it (as it may, mid-walk)."""
        proc = run(*argv, check=False)
        if proc.returncode != 0:
            self.failed_commands += 1
        return proc.returncode == 0

    # the plugin's answers --------------------------------------------------

    def call(self, method: str, request: Any) -> tuple[str, Any]:
        servicer = self.plugin.controller
        try:
            return "OK", getattr(servicer, method)(request, None)
        except Exception as err:  # the code the wire would carry
            return status_of(method, err)[0], err

    def compare(self, step: int, action: str, *, last: bool = False) -> None:
        started = time.monotonic()
        fallbacks = self.fallbacks
        try:
            self._compare(step, action, last)
        finally:
            self.clock.add("compare, plugin fell back" if self.fallbacks > fallbacks
                           else "compare", time.monotonic() - started)

    def _compare(self, step: int, action: str, last: bool) -> None:
        lvs, extent, warnings = self.truth()
        pool_obj = self.plugin.backend.pools.default
        report = VgReport(tuple(lvs), extent)
        mine = [lv for lv in lvs if lv.pool == POOL]
        where = f"step {step} ({action})"
        problem = pool_obj.metadata_problem()

        def check(what: str, got: Any, want: Any) -> None:
            if got != want:
                # LVM asked again: when it now agrees with the plugin, a third
                # actor changed the VG between the two reads.
                now = run("lvs", "--noheadings", "-o", "lv_name,lv_attr", self.vg,
                          check=False).stdout
                raise Divergence(f"{where}: {what}: plugin {got!r}, LVM {want!r}; "
                                 f"LVM's warnings: {warnings.strip()!r}; "
                                 f"plugin's metadata problem: {problem!r}; "
                                 f"lvs after the plugin answered: {now!r}")

        # First, before ListVolumes: the plugin keeps only a whole parse, and
        # until ListVolumes makes this step's it holds the last step's, so
        # after a step that changed the text the reads of its start parse
        # just the LVs they name, as at a start.
        self.compare_partial(step, lvs, check)
        # ListVolumes
        with self.clock.timed("check ListVolumes"):
            code, resp = self.call("ListVolumes", pb.ListVolumesRequest())
        check("ListVolumes code", code, "OK")
        got = {e.volume.volume_id: (e.volume.capacity_bytes, _message_source(e.volume))
               for e in resp.entries}
        want_vols = {lv.name: lv for lv in mine if naming.is_csi_volume(lv)}
        check("ListVolumes", got, {name: (lv.size, _source(lv))
                                   for name, lv in want_vols.items()})
        problem = pool_obj.metadata_problem()
        if problem is None:
            # Its condition says what lvs says of the LV's activity.
            got_c = {e.volume.volume_id: e.status.volume_condition.abnormal
                     for e in resp.entries}
            check("ListVolumes conditions", got_c,
                  {name: not lv.active for name, lv in want_vols.items()})
        else:
            self.fallbacks += 1
        # ControllerGetVolume: one that exists, one that does not
        existing = sorted(want_vols)
        if existing:
            vid = self.rng.choice(existing)
            with self.clock.timed("check ControllerGetVolume"):
                code, resp = self.call("ControllerGetVolume",
                                       pb.ControllerGetVolumeRequest(volume_id=vid))
            check(f"ControllerGetVolume {vid}", (code, code == "OK" and resp.volume.
                                                  capacity_bytes), ("OK", want_vols[vid].size))
        absent = sorted(n for n in self.ever if n.startswith("csi-v-") and n not in want_vols)
        if absent:
            vid = self.rng.choice(absent)
            with self.clock.timed("check ControllerGetVolume"):
                code, _ = self.call("ControllerGetVolume", pb.ControllerGetVolumeRequest(
                    volume_id=vid))
            check(f"ControllerGetVolume {vid} (not a volume now)", code, "NOT_FOUND")
        # ListSnapshots
        with self.clock.timed("check ListSnapshots"):
            code, resp = self.call("ListSnapshots", pb.ListSnapshotsRequest())
        check("ListSnapshots code", code, "OK")
        check("ListSnapshots",
              {e.snapshot.snapshot_id: (e.snapshot.source_volume_id, e.snapshot.size_bytes)
               for e in resp.entries},
              {lv.name: (_source(lv), lv.size)
               for lv in mine if naming.is_csi_snapshot(lv)})
        # GetCapacity
        with self.clock.timed("check GetCapacity"):
            code, resp = self.call("GetCapacity", pb.GetCapacityRequest())
        pool_lv = report.find(POOL)
        cap = capacity_of(report, POOL, pool_obj.ratio).available
        if pool_obj.fill_problem(pool_lv) is not None:
            cap = 0
        check("GetCapacity", (code, code == "OK" and resp.available_capacity), ("OK", cap))
        # A CreateVolume retry of a volume the plugin made, still there under its name
        retry = [(name, vid, size) for name, (vid, size) in self.made.items()
                 if vid in want_vols and want_vols[vid].size == size]
        if retry:
            name, vid, size = self.rng.choice(retry)
            with self.clock.timed("check CreateVolume retry"):
                code, resp = self.call("CreateVolume", _create_request(name, size))
            check(f"CreateVolume retry of {name}",
                  (code, code == "OK" and resp.volume.volume_id), ("OK", vid))
        # `csi-local status --json` (see STATUS_EVERY)
        command = last or (step > 0 and step % CLI_EVERY == 0)
        if command or step % STATUS_EVERY == 0 or action == "detach_or_attach":
            how = "csi-local status --json" if command else "status in-process"
            with self.clock.timed(f"check {how}"):
                status = self.status(command=command)
            check(f"{how}: volumes", sorted(v["id"] for v in status["volumes"]),
                  sorted(want_vols))
            problems = status["volume_group"]["metadata_problems"]
            check(f"{how}: a PV missing or outdated is reported", bool(problems),
                  any(d.degraded for d in self.disks.values()))

    def compare_partial(self, step: int, lvs: list[LogicalVolume],
                        check: Callable[[str, Any, Any], None]) -> None:
        """What the plugin's start reads from a partial parse of the text
        against LVM's answer `lvs`: Probe's thin pool (thin_pools) and the
        state's records (Pools.lookup: some thin LVs, and every
        LOOKUP_LVM_EVERY steps one that is gone and the pool); and the
        partial parse itself against the whole one of the same text."""
        pools = self.plugin.backend.pools
        committed = pools.committed
        assert committed is not None
        by_name = {lv.name: lv for lv in lvs}
        gone = sorted(self.ever - set(by_name))  # a record whose LV went away
        absent = self.picks.choice(gone) if gone else "never-made"
        with self.clock.timed("check thin_pools (partial parse)"):
            got_pools = committed.thin_pools([(self.vg, POOL), (self.vg, absent)])
        if got_pools is None:
            # No answer from the metadata (a PV missing or outdated, see
            # Walk.actions): Probe asks `lvs`, nothing of the parse to compare.
            self.partial_fallbacks += 1
        else:
            check("thin_pools", {name: _as_probe_reads(got_pools[(self.vg, name)])
                                 for name in (POOL, absent)},
                  {POOL: _as_probe_reads(by_name.get(POOL)), absent: None})
        thin = sorted(name for name, lv in by_name.items() if lv.pool == POOL)
        asked = self.picks.sample(thin, self.picks.randint(1, min(4, len(thin)))) if thin else []
        if step % LOOKUP_LVM_EVERY == 0 or not asked:
            asked += [absent, POOL]  # what only `lvs` answers: a name gone, not a volume
        with self.clock.timed("check Pools.lookup"):
            found, missing = pools.lookup(asked)
        check(f"Pools.lookup {asked}",
              ({name: (pool.class_name, _as_lookup_reads(lv))
                for name, (pool, lv) in found.items()}, missing),
              ({name: (pools.default.class_name, _as_lookup_reads(by_name[name]))
                for name in asked if name in by_name and by_name[name].pool == POOL}, []))
        # The parse itself, from one text: PV a's (always in the VG and
        # attached, it holds the newest), each LV's section parsed from
        # scratch and again with the last whole parse's sections at hand,
        # as the plugin's reader has them. Hidden LVs (a pool's _tmeta,
        # _tdata) may be asked for too: the partial parse must take them.
        with self.clock.timed("check vg_metadata(only=...)"):
            text = read_committed(Kernel(), self.disks["a"].loop).text
            whole = vg_metadata(text, self.parsed)
            every = sorted(whole.lvs)
            only = [*self.picks.sample(every, self.picks.randint(1, min(5, len(every)))), absent]
            # A thin pool comes with its metadata LV (lvs shows its size as the pool's).
            taken = set(only) | {whole.lvs[n].metadata_lv for n in only if n in whole.lvs}
            want = replace(whole, lvs={n: lv for n, lv in whole.lvs.items() if n in taken})
            alone = vg_metadata(text, only=only)
            helped = vg_metadata(text, self.parsed, only=only)
            self.parsed = whole
        # Here "plugin" is the partial parse, "LVM" the whole one's LVs.
        check(f"vg_metadata(only={only}) against the whole parse", alone, want)
        check(f"vg_metadata(only={only}) with the last parse's sections against the whole "
              "parse", helped, want)

    def status(self, *, command: bool) -> Any:
        """What `csi-local status --json` prints: the command run as an operator
        runs it (a Python of its own: 5 to 20 s under emulation), or its code
        here, whose `lvs` is this moment's (Moment) and whose `vgs`, `pvs`
        and second `vgs` run as processes of their own."""
        state = self.plugin.config.state_dir
        if not command:
            return json.loads(status_mod.to_json(status_mod.collect(
                self.moment, self.vg, POOL, state)))
        proc = run(sys.executable, "-m", "csi_local", "status", "--json", "--volume-group",
                   self.vg, "--thin-pool", POOL, "--state-dir", state)
        return json.loads(proc.stdout)

    # steps -----------------------------------------------------------------

    def name(self, prefix: str) -> str:
        self.counter += 1
        return f"{prefix}{self.counter}"

    def lvs_now(self) -> list[LogicalVolume]:
        """The pool's LVs as the last comparison's `lvs` saw them (no process:
        only the choice of a step's LV rests on it)."""
        return [lv for lv in self.last if lv.pool == POOL]

    def plugin_create(self) -> None:
        name = self.name("walk-")
        size = self.rng.choice((4, 8, 12)) * MiB
        code, resp = self.call("CreateVolume", _create_request(name, size))
        if code == "OK":
            self.made[name] = (resp.volume.volume_id, size)

    def plugin_delete(self) -> None:
        ids = [vid for vid, _ in self.made.values()]
        if ids:
            self.call("DeleteVolume", pb.DeleteVolumeRequest(volume_id=self.rng.choice(ids)))

    def plugin_snapshot(self) -> None:
        ids = [vid for vid, _ in self.made.values()]
        if ids:
            self.call("CreateSnapshot", pb.CreateSnapshotRequest(
                source_volume_id=self.rng.choice(ids), name=self.name("snap-")))

    def plugin_delete_snapshot(self) -> None:
        snaps = [lv.name for lv in self.lvs_now() if naming.is_csi_snapshot(lv)]
        if snaps:
            self.call("DeleteSnapshot", pb.DeleteSnapshotRequest(
                snapshot_id=self.rng.choice(snaps)))

    def _thin(self) -> list[LogicalVolume]:
        return [lv for lv in self.lvs_now() if lv.is_thin_volume]

    def hand_create(self) -> None:
        # A CSI-looking volume made by hand (its kind tag), or another user's LV.
        name = f"csi-v-{uuid.UUID(int=self.rng.getrandbits(128)).hex}" \
            if self.rng.random() < 0.5 \
            else self.name("other-")
        tags = ["--addtag", "csi-local.kind=volume"] if name.startswith("csi-v-") else []
        self.lvm("lvcreate", "--yes", "--thin", "-V", f"{self.rng.choice((4, 8))}M",
                 "-n", name, *tags, f"{self.vg}/{POOL}")

    def hand_remove(self) -> None:
        thin = self._thin()
        if thin:
            self.lvm("lvremove", "--yes", f"{self.vg}/{self.rng.choice(thin).name}")

    def hand_rename(self) -> None:
        thin = self._thin()
        if thin:
            new = f"csi-v-{uuid.UUID(int=self.rng.getrandbits(128)).hex}" \
                if self.rng.random() < 0.5 \
                else self.name("renamed-")
            self.lvm("lvrename", self.vg, self.rng.choice(thin).name, new)

    def hand_extend(self) -> None:
        thin = self._thin()
        if thin:
            self.lvm("lvextend", "--size", "+4M", f"{self.vg}/{self.rng.choice(thin).name}")

    def hand_activation(self) -> None:
        thin = self._thin()
        if thin:
            lv = self.rng.choice(thin)
            self.lvm("lvchange", "--activate", "n" if lv.active else "y",
                     f"{self.vg}/{lv.name}")

    def hand_tags(self) -> None:
        thin = self._thin()
        if not thin:
            return
        lv = self.rng.choice(thin)
        mine = sorted(t for t in lv.tags if t.startswith("walk."))
        if mine and self.rng.random() < 0.4:
            self.lvm("lvchange", "--deltag", self.rng.choice(mine), f"{self.vg}/{lv.name}")
        else:  # long tags: the metadata grows, and its ring wraps sooner
            tag = f"walk.{self.counter}=" + "x" * self.rng.randrange(10, 200)
            self.counter += 1
            self.lvm("lvchange", "--addtag", tag, f"{self.vg}/{lv.name}")

    def vg_extend_or_reduce(self) -> None:
        disk = self.disks["b"]
        if disk.in_vg:
            if self.lvm("vgreduce", self.vg, disk.loop):
                disk.in_vg = False
        elif self.lvm("vgextend", self.vg, disk.loop):
            disk.in_vg = True

    def metadata_ignore(self) -> None:
        disk = self.disks["b"]
        if disk.in_vg:
            self.lvm("pvchange", "--metadataignore", self.rng.choice("yn"), disk.loop)

    def detach_or_attach(self) -> None:
        """The PV that goes away, one phase a step: detached (the VG runs with
        it missing: LVM refuses changes), the VG reduced without it (changes
        go on), attached again with its outdated copy, that copy wiped
        (vgck --updatemetadata), and the PV made and added again."""
        disk = self.disks["c"]
        if disk.attached and disk.in_vg:
            disk.detach()
        elif not disk.attached and disk.in_vg:
            run("vgreduce", "--removemissing", self.vg)
            disk.in_vg = False
        elif not disk.attached:
            disk.attach()
            disk.outdated = True
        elif disk.outdated:
            run("vgck", "--updatemetadata", self.vg)
            disk.outdated = False
        else:
            run("pvcreate", "--yes", "--force", "--force", *disk.pv_args, disk.loop)
            run("vgextend", self.vg, disk.loop)
            disk.in_vg = True

    def kill_the_shell(self) -> None:
        """The plugin's lvm shell killed while it runs the plugin's lvcreate."""
        shell = self.plugin.runner.shell
        assert isinstance(shell, LvmShell)
        name = self.name("killed-")
        worker = threading.Thread(target=self.call,
                                  args=("CreateVolume", _create_request(name, 4 * MiB)))
        worker.start()
        time.sleep(self.rng.uniform(0.0, 1.0))
        pid = shell.pid
        if pid is not None:
            os.kill(pid, signal.SIGKILL)
        worker.join()
        # The CO retries until it succeeds.
        code, resp = self.call("CreateVolume", _create_request(name, 4 * MiB))
        if code == "OK":
            self.made[name] = (resp.volume.volume_id, 4 * MiB)

    def actions(self) -> list[tuple[float, Callable[[], None]]]:
        """The steps and their weights: cheap ones often, costly ones rarely.
        The PV that goes away moves on quickly from the two phases in which
        it is missing or outdated (see detach_or_attach): there LVM refuses
        changes or warns, and every answer of the plugin is an `lvs` of its
        own (its fallback): some 6 `lvs` a comparison, which then costs 3 to
        5 times a plain one (measured). At the weight of the others' (1.3:
        some 50 steps a phase) a walk spent two fifths of its steps there;
        at DEGRADED_PACE (some 7 steps a phase) one step in ten, with more
        cycles, so more of the transitions where a reader goes wrong."""
        pv_pace = DEGRADED_PACE if self.disks["c"].degraded else 1.3
        return [
            (14, self.plugin_create), (8, self.plugin_delete), (4, self.plugin_snapshot),
            (3, self.plugin_delete_snapshot), (5, self.hand_create), (5, self.hand_remove),
            (3, self.hand_rename), (3, self.hand_extend), (3, self.hand_activation),
            (14, self.hand_tags),
            # About 30, 12, 9 and 9 times in 1,000 steps.
            (pv_pace, self.detach_or_attach), (0.8, self.vg_extend_or_reduce),
            (0.6, self.metadata_ignore), (0.6, self.kill_the_shell),
        ]


def _as_probe_reads(lv: LogicalVolume | None) -> LogicalVolume | None:
    """A thin pool as CommittedMetadata.thin_pools claims to see it: all
    that `lvs` says but its device numbers (it reads no list of the
    kernel's devices: Probe needs none) and whether it is open (lv_attr's
    sixth character, not read and shown as not)."""
    if lv is None:
        return None
    return replace(lv, kernel_major=-1, kernel_minor=-1, attr=f"{lv.attr[:5]}-{lv.attr[6:]}")


def _as_lookup_reads(lv: LogicalVolume) -> LogicalVolume:
    """A thin LV as Pools.lookup claims to see it: all that `lvs` says but
    how much of it is mapped (data_percent), which the committed metadata's
    answer does not read (CommittedMetadata.thin_volume: a caller that
    needs it asks the kernel); when it falls back to `lvs`, that says it."""
    return replace(lv, data_percent=None)


def _source(lv: LogicalVolume) -> str:
    src = naming.source_of(lv)
    return src.id if src is not None else ""


def _message_source(volume: pb.Volume) -> str:
    source = volume.content_source
    return source.snapshot.snapshot_id or source.volume.volume_id


def _create_request(name: str, size: int) -> pb.CreateVolumeRequest:
    return pb.CreateVolumeRequest(name=name, capacity_range=pb.CapacityRange(required_bytes=size),
                                  volume_capabilities=[mount_cap()])


@pytest.fixture
def walk_vg() -> Iterator[tuple[str, dict[str, Disk]]]:
    """A VG first on PVs `c` (the one that goes away, nothing allocated on it;
    made first, so `pvs` lists it first) and `a` (the thin pool; two metadata
    copies); `b` is added and removed, its metadata sometimes ignored. Small
    metadata areas: their rings wrap many times in a walk."""
    SCRATCH.mkdir(parents=True, exist_ok=True)
    vg = f"csiwalk{uuid.uuid4().hex[:8]}"
    specs = {"c": ("--metadatasize", "512k"),
             "a": ("--metadatasize", "512k", "--metadatacopies", "2"),
             "b": ("--metadatasize", "512k")}
    disks: dict[str, Disk] = {}
    for key, args in specs.items():
        image = SCRATCH / f"{vg}-{key}.img"
        with open(image, "wb") as f:
            f.truncate(384 * MiB)
        loop = run("losetup", "--find", "--show", str(image)).stdout.strip()
        run("pvcreate", "--yes", *args, loop)
        disks[key] = Disk(image, loop, args)
    run("vgcreate", "--yes", vg, disks["c"].loop, disks["a"].loop)
    disks["c"].in_vg = disks["a"].in_vg = True
    run("lvcreate", "--yes", "--type", "thin-pool", "--size", "256M", "--name", POOL, vg,
        disks["a"].loop)
    yield vg, disks
    run("vgremove", "--yes", "--force", vg, check=False)
    for disk in disks.values():
        run("losetup", "--detach", disk.loop, check=False)
        disk.image.unlink(missing_ok=True)


def must_take(walk: Walk, kinds: list[Callable[[], None]],
              left: int) -> Callable[[], None] | None:
    """A kind of step this part has not taken yet, once the steps left (this
    one included) are no more than such kinds: a rare kind (a PV detached,
    metadata ignored, the shell killed: some 1 in 100 steps each) is then
    taken even in a short walk. None while the draw may stand."""
    untaken = [k for k in kinds if walk.steps.get(k.__name__, 0) == 0]
    return walk.rng.choice(untaken) if untaken and left <= len(untaken) else None


_BASE_SEED = int(os.environ.get("CSI_LOCAL_WALK_SEED") or random.randrange(1 << 32))


# The first part runs in every README run whatever the VM budget (`core`):
# each kind of step, against a fresh seed.
@pytest.mark.parametrize("part", [pytest.param(0, marks=pytest.mark.core),
                                  *range(1, PARTS)])
def test_committed_metadata_walk(walk_vg: tuple[str, dict[str, Disk]], part: int) -> None:
    vg, disks = walk_vg
    seed = _BASE_SEED + part
    steps = STEPS // PARTS + (1 if part < STEPS % PARTS else 0)
    print(f"metadata walk part {part}: seed {seed}, {steps} of {STEPS} steps "
          f"(CSI_LOCAL_WALK_SEED={_BASE_SEED} CSI_LOCAL_WALK_STEPS={STEPS} to run it again)")
    work = SCRATCH / f"walk-{uuid.uuid4().hex[:8]}"
    config = Config(endpoint=f"unix://{work}/csi.sock", node_id="node-1", volume_group=vg,
                    thin_pool=POOL, state_dir=str(work / "state"),
                    lock_dir=str(work / "locks"))
    plugin = CsiPlugin(config)
    walk = Walk(random.Random(seed), vg, disks, plugin, picks=random.Random(f"picks {seed}"))
    plugin.runner.observe = walk.clock.observe
    plugin.runner.start_shell()
    started = time.monotonic()
    ends: list[float] = []  # when each step's comparison ended
    try:
        walk.compare(0, "start")
        for step in range(1, steps + 1):
            actions = walk.actions()
            (action,) = walk.rng.choices([a for _, a in actions], [w for w, _ in actions])
            action = must_take(walk, [a for _, a in actions], steps - step + 1) or action
            if PROGRESS:
                print(f"metadata walk: step {step} {action.__name__} at "
                      f"{time.monotonic() - started:.0f} s", flush=True)
            with walk.clock.timed(f"step {action.__name__}"):
                action()
            with walk.clock.timed("udev settle"):
                # A new or changed PV is a udev event, and LVM's rules answer
                # it with `vgchange -aay` (event autoactivation): it would
                # activate a volume between LVM's answer and the plugin's.
                # Its events end before the two are compared.
                run("udevadm", "settle", "--timeout=60", check=False)
            walk.steps[action.__name__] = walk.steps.get(action.__name__, 0) + 1
            walk.compare(step, action.__name__, last=step == steps)
            ends.append(time.monotonic() - started)
    finally:
        took = time.monotonic() - started
        done = len(ends)
        # A step's cost as the VG grows: seconds a step in each quarter of the part.
        cuts = [done * q // 4 for q in range(5)]
        quarters = ", ".join(
            f"{(ends[hi - 1] - (ends[lo - 1] if lo else 0.0)) / (hi - lo):.2f}"
            for lo, hi in itertools.pairwise(cuts) if hi > lo)
        print(f"metadata walk part {part}: {done} of {steps} steps in {took:.0f} s "
              f"({took / max(1, done):.2f} s a step; by quarter: {quarters}); steps taken: "
              f"{dict(sorted(walk.steps.items()))}; commands LVM refused: "
              f"{walk.failed_commands}; comparisons while the plugin took LVM's answer: "
              f"{walk.fallbacks}; comparisons where thin_pools asked LVM: "
              f"{walk.partial_fallbacks}; time: {walk.clock.summary()}")
        for disk in disks.values():
            if not disk.attached:
                disk.attach()
        plugin.close()
