"""Group snapshots: thin snapshots of several volumes taken at one instant.

A group is no LV of its own. Each member is an ordinary CSI snapshot (it
restores with CreateVolume like any other) tagged with the group's ID and the
number of members the group was made with, so LVM alone says what a group
is, and a group with fewer members than its size is a take that did not
finish; unless a VG that may hold the others is missing, when neither that
nor a group's absence can be told (GroupSnapshots.find).

How the instant is made (the spec's write-order consistency):

1. Every member with a mounted file system is frozen (FIFREEZE on one of its
   mounts): its dirty data is written and every new write on it waits. A
   member that is open but not mounted (a raw block device in use) cannot be
   held still, so a group with more than one member refuses it; a member no
   one has open needs nothing.
2. Each member's thin snapshot is taken with lvcreate while all are frozen.
   LVM suspends the origin with device-mapper's lockfs, a freeze of its own,
   which the kernel must nest inside ours. Linux 6.1 (Debian 12) does not:
   the suspend fails with EBUSY, and the group is refused (nothing is left
   made or frozen). Newer kernels (measured: Debian's 6.12 backports) nest it
   and the file system stays frozen after LVM resumes the origin.
3. Every member is thawed, also after a failure; a failure deletes the
   members it made.

The frozen window has its own limit (--group-freeze-timeout, seconds): LVM
can wait long for its VG lock or a slow device, under the command timeout of
minutes, and every write of the members' workloads waits as long. When the
limit passes, a timer thaws every member at once, even while an lvcreate is
still running (it is left to finish: killing LVM while it holds an origin
suspended would leave the origin suspended), and the take fails with
FreezeTimeout once that lvcreate returns: a snapshot cut after the thaw is
no instant, so every member made is deleted.

No write that completed on one member after the first freeze can be in a
snapshot, and a write waiting on a frozen member completes only after every
snapshot is cut. A group of one volume is taken without a freeze: its one
snapshot is already an instant, and so is a group in which one member has
writers (the others are not open): neither freezes anything, so both work on
6.1 too.

The freeze, its limit and its journal are the one freeze rule of
csi_local.volumes.freezes, which single snapshots and clones of an encrypted
volume follow too. A group's journal also names the group, so that a plugin
killed mid-take thaws those file systems and deletes an unfinished group's
members when it starts again (a frozen file system stays frozen when the
process that froze it dies).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

from csi_local.errors import (
    CannotQuiesce,
    FormatTooNew,
    OriginFrozen,
    StorageError,
    VolumeGroupMissing,
)
from csi_local.host.filesystems import Filesystems
from csi_local.host.kernel import Kernel
from csi_local.storage.lvm import LogicalVolume, VgReport
from csi_local.volumes import encryption, naming
from csi_local.volumes.freezes import Freezes
from csi_local.volumes.lifecycle import CSI_TAGS, VolumeSteps, carried_tags
from csi_local.volumes.pool import Pool, Pools

log = logging.getLogger(__name__)

JOURNAL_PREFIX = "group-take."


@dataclass(frozen=True)
class Group:
    """A group snapshot as LVM shows it: its members, sorted by snapshot ID."""

    group_id: str
    members: tuple[LogicalVolume, ...]
    size: int  # members it was made with

    @property
    def complete(self) -> bool:
        return len(self.members) == self.size

    @property
    def created(self) -> int:
        return min((m.created for m in self.members), default=0)

    def sources(self) -> set[str]:
        return {src.id for m in self.members if (src := naming.source_of(m)) is not None}


@dataclass(frozen=True)
class Taken:
    """What a take made, and how long the members' writes were held."""

    group: Group
    freeze_seconds: float  # first freeze to last thaw; 0 when nothing was frozen


def _size_of(lv: LogicalVolume) -> int:
    raw = lv.tag_value(naming.TAG_GROUP_SIZE)
    return int(raw) if raw and raw.isdigit() else 0


class GroupSnapshots:
    """Find, take and delete group snapshots over every class's pool."""

    def __init__(self, pools: Pools, fs: Filesystems, host: Kernel, freezes: Freezes,
                 legacy_journal_dir: str | None = None) -> None:
        self.pools = pools
        self.fs = fs
        self.host = host
        self.freezes = freezes  # the one freeze rule: its limit, its journals
        # Where versions before the one freeze rule kept a take's journal (the
        # state directory): read once more at start-up.
        self.legacy_journal_dir = legacy_journal_dir
        # Where a member's file system is mounted: the one rule of VolumeSteps.
        self.steps = VolumeSteps(fs, host, CSI_TAGS, freezes=freezes)

    # reading ---------------------------------------------------------------

    def find(self, group_id: str) -> Group | None:
        """The group with this ID, from one `lvs` over the classes' VGs; None
        when no member exists.

        VolumeGroupMissing when a VG that may hold volumes (one this node has
        had, Pools' known VGs) is missing and the members seen are not all of
        the group: the others may be in it. An unfinished group's members are
        deleted and a group not found is taken anew or called gone, so either
        conclusion drawn from a partial view would delete whole groups' members
        or make a second group of this ID. A group with every member seen is
        answered: none of it can be in the missing VG."""
        lvs, missing = self.pools.scan()
        members = sorted((lv for pool, lv in lvs if pool is not None
                          and naming.is_csi_snapshot(lv) and naming.group_of(lv) == group_id),
                         key=lambda lv: lv.name)
        group = (Group(group_id, tuple(members), max(_size_of(m) for m in members))
                 if members else None)
        if missing and (group is None or not group.complete):
            seen = (f"{len(group.members)} of its {group.size} members are seen"
                    if group is not None else "none of its members is seen")
            raise VolumeGroupMissing(
                f"volume group {', '.join(missing)} not found: group snapshot {group_id} "
                f"may have members there ({seen}), so it is neither called unfinished nor "
                "gone until the volume group is back")
        return group

    # taking ----------------------------------------------------------------

    def take(self, group_id: str, sources: Sequence[tuple[Pool, LogicalVolume]]) -> Taken:
        """Snapshot every source volume at one instant (see the module's text).
        The caller holds the sources' volume locks, so none is staged or
        unstaged meanwhile. CannotQuiesce when they cannot be held still
        together; NoRoom when a pool cannot take the snapshots; FormatTooNew,
        before anything is frozen or made, for a newer csi-local's source."""
        for _, lv in sources:
            naming.check_format(lv)
        plan = self._plan(sources)
        if len(plan) <= 1:
            # One member with writers is an instant by itself: LVM's own suspend.
            # Its file system is committed first, as CreateSnapshot does (a
            # btrfs log tree not committed makes the snapshot unmountable).
            for path, _ in plan:
                self.fs.sync(path)
            plan = []
        tags_for = {lv.name: [
            *naming.new_lv_tags(naming.KIND_SNAPSHOT),
            naming.Source(naming.SourceKind.VOLUME, lv.name).tag(),
            f"{naming.TAG_GROUP}={group_id}",
            f"{naming.TAG_GROUP_SIZE}={len(sources)}",
            *carried_tags(CSI_TAGS, lv),
        ] for _, lv in sources}
        made: list[tuple[Pool, LogicalVolume]] = []
        what = f"group snapshot {group_id}"
        try:
            with self.freezes.window(JOURNAL_PREFIX + group_id, plan, what,
                                     extra={"group_id": group_id},
                                     finish=self._finish) as window:
                try:
                    with self._pools_reserved(sources) as reports:
                        for pool in {id(p): p for p, _ in sources}.values():
                            mine = [lv for p, lv in sources if p is pool]
                            pool.admit(reports[id(pool)], sum(lv.size for lv in mine),
                                       len(mine))
                        try:
                            window.freeze_all()
                            for pool, lv in sources:
                                window.check()  # expired: no more snapshots after the thaw
                                sid = naming.member_snapshot_id(group_id, lv.name)
                                made.append((pool, pool.lvm.snapshot(
                                    lv.name, sid, tags_for[lv.name], writable_volume=False,
                                    read_back=False, size=lv.size)))
                            window.check()  # the last one may have been cut after the thaw
                        finally:
                            window.close()  # thawed before the pools' locks go
                except BaseException:
                    self._remove(made)
                    raise
        except OriginFrozen as err:
            raise CannotQuiesce(
                "this kernel cannot snapshot a frozen file system (LVM's suspend of "
                "the origin fails), so mounted volumes cannot be snapshotted together "
                f"here: {err.message}") from err
        # Read back after the thaw (never inside the window): LVM's creation
        # times, so that this reply says what Get and every retry will say.
        found = self.pools.locate(*(lv.name for _, lv in made), required=())
        members = tuple(sorted((found[lv.name][1] if lv.name in found else lv
                                for _, lv in made), key=lambda lv: lv.name))
        return Taken(Group(group_id, members, len(sources)), window.seconds)

    def _plan(self, sources: Sequence[tuple[Pool, LogicalVolume]]
              ) -> list[tuple[str, tuple[int, int]]]:
        """A mount point to freeze, and its device, for each member with a file
        system; CannotQuiesce for a member that is open but not mounted, when
        there are others."""
        table = self.host.mounts()
        paths = []
        for _, lv in sources:
            # An encrypted member's file system is on its dm-crypt device.
            top = encryption.top_device(self.host, lv)
            fs = self.steps.mounted_filesystem(lv, table)
            if fs is not None:
                paths.append((fs.mount_point, (top.major, top.minor)))
            elif (lv.open or self.steps.device_mounts(lv, table)) and len(sources) > 1:
                raise CannotQuiesce(
                    f"volume {lv.name} is in use as a raw block device, which cannot be "
                    "held still while the other members are snapshotted: snapshot it alone, "
                    "or stop its writer first")
        return paths

    @contextlib.contextmanager
    def _pools_reserved(self, sources: Sequence[tuple[Pool, LogicalVolume]]
                        ) -> Iterator[dict[int, VgReport]]:
        """Each pool's lock and fresh report, taken in class-name order (the
        same order everywhere, so two takes never wait on each other)."""
        pools = sorted({id(p): p for p, _ in sources}.values(), key=lambda p: p.class_name)
        with contextlib.ExitStack() as stack:
            yield {id(p): stack.enter_context(p.reserved()) for p in pools}

    def _remove(self, made: list[tuple[Pool, LogicalVolume]]) -> None:
        for pool, lv in made:
            try:
                pool.lvm.remove(lv.name)
            except StorageError as err:
                log.error("could not remove %s, a member of an unfinished group snapshot: %s",
                          lv.name, err.message)

    # deleting --------------------------------------------------------------

    def delete(self, group: Group) -> None:
        """Remove every member. Each removal is idempotent, so a delete cut
        short is finished by the next. A member of a newer csi-local's format:
        FormatTooNew, and none removed."""
        for lv in group.members:
            naming.check_format(lv)
        for lv in group.members:
            pool = self.pools.of_lv(lv)
            if pool is not None:
                pool.lvm.remove(lv.name)

    # after a crash ---------------------------------------------------------

    def recover(self) -> None:
        """At start-up: thaw what any freeze window killed mid-way left frozen
        (a take's, a single snapshot's or clone's, the host volume plugin's),
        and delete the members of a group whose take did not finish (the CO
        got no reply, and a retry takes the group again at a new instant)."""
        legacy: list[str] = []
        if self.legacy_journal_dir is not None:
            try:
                legacy = [os.path.join(self.legacy_journal_dir, n)
                          for n in sorted(os.listdir(self.legacy_journal_dir))
                          if n.startswith(JOURNAL_PREFIX) and ".tmp." not in n]
            except FileNotFoundError:
                pass
        self.freezes.recover(self._finish, also=legacy)

    def _finish(self, entry: Mapping[str, object]) -> None:
        """After a leftover journal's thaw: delete its group's members if the
        take did not finish (a journal of no group: nothing)."""
        group_id = entry.get("group_id")
        if not isinstance(group_id, str):
            return
        try:
            group = self.find(group_id) if naming.is_group_id(group_id) else None
        except VolumeGroupMissing as err:
            # The take may have finished with a member in the missing VG. Left
            # for the CO's retry, which deletes and retakes an unfinished group
            # once the VG is back; the plugin still starts.
            log.warning("group snapshot %s is left as it is: %s", group_id, err.message)
            return
        if group is not None and not group.complete:
            log.warning("deleting %d member(s) of group snapshot %s, whose take did "
                        "not finish", len(group.members), group_id)
            try:
                self.delete(group)
            except FormatTooNew as err:  # a newer csi-local's take: the plugin still starts
                log.error("group snapshot %s did not finish, and is left as it is: %s",
                          group_id, err.message)
