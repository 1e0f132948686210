"""Group snapshots: thin snapshots of several volumes taken at one instant.

A group is no LV of its own. Each member is an ordinary CSI snapshot (it
restores with CreateVolume like any other) tagged with the group's ID and the
number of members the group was made with, so LVM alone says what a group
is, and a group with fewer members than its size is a take that did not
finish.

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

A journal file per group being taken records what is frozen, so a plugin
killed mid-take thaws those file systems and deletes an unfinished group's
members when it starts again (a frozen file system stays frozen when the
process that froze it dies).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from csi_local.errors import (
    CannotQuiesce,
    FormatTooNew,
    FreezeTimeout,
    OriginFrozen,
    StorageError,
)
from csi_local.host.atomic_files import write_atomic
from csi_local.host.filesystems import Filesystems
from csi_local.host.kernel import Host
from csi_local.storage.lvm import LogicalVolume, VgReport
from csi_local.volumes import encryption
from csi_local.volumes import naming as vols
from csi_local.volumes.lifecycle import CSI_TAGS, VolumeSteps, carried_tags
from csi_local.volumes.pool import Pool, Pools

# Seconds a group snapshot may keep its members' file systems frozen
# (--group-freeze-timeout): lvcreate takes well under a second per member on
# real hardware.
DEFAULT_FREEZE_LIMIT = 10.0

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
        return {src.id for m in self.members if (src := vols.source_of(m)) is not None}


@dataclass(frozen=True)
class Taken:
    """What a take made, and how long the members' writes were held."""

    group: Group
    freeze_seconds: float  # first freeze to last thaw; 0 when nothing was frozen


def _size_of(lv: LogicalVolume) -> int:
    raw = lv.tag_value(vols.TAG_GROUP_SIZE)
    return int(raw) if raw and raw.isdigit() else 0


class FreezeWindow:
    """File systems frozen for at most `limit` seconds from the first freeze: a
    timer thaws them all when the limit passes, whatever the take is doing
    then; check() says whether it did. Thread-safe between the take and the
    timer: each frozen path is thawed exactly once."""

    def __init__(self, host: Host, limit: float) -> None:
        self.host = host
        self.limit = limit
        self._lock = threading.Lock()
        self._frozen: list[str] = []
        self._timer: threading.Timer | None = None
        self._over = False  # thawed: by the timer (expired) or by close()
        self.expired = False
        self.stuck: list[str] = []  # frozen paths a thaw failed on
        self.started = self.ended = 0.0

    def freeze(self, path: str) -> None:
        """FIFREEZE `path` (OSError as the kernel says); FreezeTimeout when the
        limit passed meanwhile (the path is thawed again then)."""
        if self._timer is None:
            self.started = time.monotonic()
            self._timer = threading.Timer(self.limit, self._expire)
            self._timer.daemon = True
            self._timer.start()
        self.host.freeze(path)
        with self._lock:
            if self._over:  # the timer thawed the others while this one froze
                self.stuck += _thaw(self.host, [path])
            else:
                self._frozen.append(path)
        self.check()

    def check(self) -> None:
        """FreezeTimeout if the limit has passed: the timer thawed everything."""
        if self.expired:
            raise FreezeTimeout(
                f"the group's file systems were frozen for its limit of {self.limit:g} s "
                "(--group-freeze-timeout) before every member's snapshot was cut (LVM "
                "waited for its VG lock or a slow device): they were thawed and the group "
                "failed, no member is kept; retry")

    def _expire(self) -> None:
        with self._lock:
            if self._over:
                return
            self.expired = True
            log.error("group snapshot: writes held for the limit of %g s; thawing %s",
                      self.limit, ", ".join(self._frozen) or "nothing")
            self._thaw_all()

    def _thaw_all(self) -> None:
        self._over = True
        self.stuck += _thaw(self.host, self._frozen)
        self.ended = time.monotonic()

    def close(self) -> list[str]:
        """Thaw what is still frozen (the timer's thaw is not repeated); the
        paths that could not be thawed."""
        if self._timer is not None:
            self._timer.cancel()
        with self._lock:
            if not self._over:
                self._thaw_all()
        return self.stuck


def _thaw(host: Host, paths: list[str]) -> list[str]:
    """Thaw each path, the last frozen first; the ones that could not be thawed."""
    stuck = []
    for path in reversed(paths):
        try:
            host.thaw(path)
        except OSError as err:  # never hide the take's own error; say it loudly
            log.error("could not thaw %s after a group snapshot: %s", path, err)
            stuck.append(path)
    return stuck


class GroupSnapshots:
    """Find, take and delete group snapshots over every class's pool."""

    def __init__(self, pools: Pools, fs: Filesystems, host: Host, journal_dir: str,
                 freeze_limit: float = DEFAULT_FREEZE_LIMIT) -> None:
        self.pools = pools
        self.fs = fs
        self.host = host
        self.journal_dir = journal_dir
        self.freeze_limit = freeze_limit  # seconds the members may stay frozen
        # Where a member's file system is mounted: the one rule of VolumeSteps.
        self.steps = VolumeSteps(fs, host, CSI_TAGS)

    # reading ---------------------------------------------------------------

    def find(self, group_id: str) -> Group | None:
        """The group with this ID, from one `lvs` over the classes' VGs; None
        when no member exists."""
        lvs, _ = self.pools.scan()
        members = sorted((lv for pool, lv in lvs if pool is not None
                          and vols.is_csi_snapshot(lv) and vols.group_of(lv) == group_id),
                         key=lambda lv: lv.name)
        if not members:
            return None
        return Group(group_id, tuple(members), max(_size_of(m) for m in members))

    # taking ----------------------------------------------------------------

    def take(self, group_id: str, sources: Sequence[tuple[Pool, LogicalVolume]]) -> Taken:
        """Snapshot every source volume at one instant (see the module's text).
        The caller holds the sources' volume locks, so none is staged or
        unstaged meanwhile. CannotQuiesce when they cannot be held still
        together; NoRoom when a pool cannot take the snapshots; FormatTooNew,
        before anything is frozen or made, for a newer csi-local's source."""
        for _, lv in sources:
            vols.check_format(lv)
        plan = self._plan(sources)
        if len(plan) <= 1:
            # One member with writers is an instant by itself: LVM's own suspend.
            # Its file system is committed first, as CreateSnapshot does (a
            # btrfs log tree not committed makes the snapshot unmountable).
            for path, _ in plan:
                self.fs.sync(path)
            plan = []
        frozen_paths = [path for path, _ in plan]
        tags_for = {lv.name: [
            *vols.new_lv_tags(vols.KIND_SNAPSHOT),
            vols.Source(vols.SourceKind.VOLUME, lv.name).tag(),
            f"{vols.TAG_GROUP}={group_id}",
            f"{vols.TAG_GROUP_SIZE}={len(sources)}",
            *carried_tags(CSI_TAGS, lv),
        ] for _, lv in sources}
        made: list[tuple[Pool, LogicalVolume]] = []
        journal = os.path.join(self.journal_dir, JOURNAL_PREFIX + group_id)
        self._settle(journal)
        write_atomic(journal, json.dumps({"group_id": group_id, "frozen": [
            [path, major, minor] for path, (major, minor) in plan]}))
        window = FreezeWindow(self.host, self.freeze_limit)
        stuck: list[str] = []  # frozen paths a thaw failed on
        try:
            with self._pools_reserved(sources) as reports:
                for pool in {id(p): p for p, _ in sources}.values():
                    mine = [lv for p, lv in sources if p is pool]
                    pool.admit(reports[id(pool)], sum(lv.size for lv in mine), len(mine))
                if frozen_paths:
                    log.debug("group snapshot %s: freezing %s for at most %g s", group_id,
                              ", ".join(frozen_paths), self.freeze_limit)
                try:
                    for path in frozen_paths:
                        self._freeze(window, path)
                    for pool, lv in sources:
                        window.check()  # expired: no more snapshots after the thaw
                        sid = vols.member_snapshot_id(group_id, lv.name)
                        made.append((pool, pool.lvm.snapshot(
                            lv.name, sid, tags_for[lv.name], writable_volume=False,
                            read_back=False, size=lv.size)))
                    window.check()  # the last one may have been cut after the thaw
                finally:
                    stuck = window.close()
        except BaseException as err:
            self._remove(made)
            self._done(journal, stuck)
            if isinstance(err, OriginFrozen):
                raise CannotQuiesce(
                    "this kernel cannot snapshot a frozen file system (LVM's suspend of "
                    "the origin fails), so mounted volumes cannot be snapshotted together "
                    f"here: {err.message}") from err
            raise
        self._done(journal, stuck)
        # Read back after the thaw (never inside the window): LVM's creation
        # times, so that this reply says what Get and every retry will say.
        found = self.pools.locate(*(lv.name for _, lv in made), required=())
        members = tuple(sorted((found[lv.name][1] if lv.name in found else lv
                                for _, lv in made), key=lambda lv: lv.name))
        return Taken(Group(group_id, members, len(sources)),
                     window.ended - window.started if frozen_paths else 0.0)

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

    def _freeze(self, window: FreezeWindow, path: str) -> None:
        try:
            window.freeze(path)
        except OSError as err:
            raise CannotQuiesce(
                f"cannot freeze the file system at {path}: {err.strerror or err} "
                "(frozen by someone else, or a file system that cannot freeze)") from err

    def _settle(self, journal: str) -> None:
        """Before a take: the journal an earlier take of this group kept (a
        thaw failed) names file systems that may still be frozen, and a new
        journal must not replace it. Thaw them now and drop it; CannotQuiesce,
        with the journal kept, when one still cannot be thawed."""
        if not os.path.exists(journal):
            return
        stuck = self._recover_journal(journal)
        if stuck:
            raise CannotQuiesce(
                f"file system(s) {', '.join(stuck)} frozen by an earlier take of this group "
                "still cannot be thawed (run fsfreeze --unfreeze on them); the group is "
                "not taken again until they are")

    @staticmethod
    def _done(journal: str, stuck: list[str]) -> None:
        """The take is over: its journal goes, unless a file system it froze
        could not be thawed. Then the journal stays, so that the plugin's next
        start (recover) tries the thaw again."""
        if stuck:
            log.error("file system(s) %s stay frozen; the plugin's next start thaws them "
                      "(or run fsfreeze --unfreeze)", ", ".join(stuck))
            return
        os.unlink(journal)

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
            vols.check_format(lv)
        for lv in group.members:
            pool = self.pools.of_lv(lv)
            if pool is not None:
                pool.lvm.remove(lv.name)

    # after a crash ---------------------------------------------------------

    def recover(self) -> None:
        """At start-up: thaw what a take killed mid-way left frozen, and delete
        the members of a group it did not finish (the CO got no reply, and a
        retry takes the group again at a new instant)."""
        try:
            names = [n for n in os.listdir(self.journal_dir) if n.startswith(JOURNAL_PREFIX)]
        except FileNotFoundError:
            return
        for name in names:
            self._recover_journal(os.path.join(self.journal_dir, name))

    def _recover_journal(self, path: str) -> list[str]:
        """Thaw what the journal at `path` names as frozen (only where that
        device is still mounted) and delete the members of its group if the
        take did not finish. The journal goes unless a thaw failed; the mount
        points that could not be thawed."""
        try:
            with open(path, encoding="utf-8") as f:
                entry = json.load(f)
            group_id = str(entry["group_id"])
            frozen = [(str(p), int(ma), int(mi)) for p, ma, mi in entry["frozen"]]
        except (OSError, ValueError, KeyError, TypeError) as err:
            log.error("unreadable group snapshot journal %s (%s); removing it", path, err)
            os.unlink(path)
            return []
        stuck = []
        for mount_point, major, minor in frozen:
            # Only the file system that was frozen: the path may now show
            # another one (unmounted since), which is not ours to thaw.
            if not self.host.device_mounted_at(mount_point, major, minor):
                continue
            try:
                if self.host.thaw(mount_point):
                    log.warning("thawed %s, left frozen by a group snapshot of %s that "
                                "did not finish", mount_point, group_id)
            except OSError as err:
                log.warning("could not thaw %s (group snapshot %s): %s",
                            mount_point, group_id, err)
                stuck.append(mount_point)
        group = self.find(group_id) if vols.is_group_id(group_id) else None
        if group is not None and not group.complete:
            log.warning("deleting %d member(s) of group snapshot %s, whose take did "
                        "not finish", len(group.members), group_id)
            try:
                self.delete(group)
            except FormatTooNew as err:  # a newer csi-local's take: the plugin still starts
                log.error("group snapshot %s did not finish, and is left as it is: %s",
                          group_id, err.message)
        if not stuck:  # else kept: the next take or start tries the thaw again
            os.unlink(path)
        return stuck
