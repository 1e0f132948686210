"""Which of the classes' volume groups this node has had: the one thing about a
missing VG that LVM cannot say once the VG is gone.

A class's VG that is missing may be one this node had (a disk detached, a VG
not yet activated): its volumes may be there, so nothing may be taken as
deleted, and calls that would have to say so answer UNAVAILABLE. Or it may be
a pool this node never had (classes are per cluster, pools per node): then no
volume can be in it, and listing the node's volumes must not fail for it.

The record is a small file in the state directory, written atomically (see
csi_local.host.atomic_files) before the first volume is made in a VG. Losing it is safe:
it is made again from LVM, the VGs that are there now, and, of those that are
missing, the ones LVM keeps a metadata backup of (`backup/backup_dir`: LVM
writes one for every VG this host changed and removes it on vgremove). When
that cannot be read, every missing VG counts as one it had.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable, Iterable

from csi_local.host.atomic_files import write_atomic

log = logging.getLogger(__name__)

KNOWN_VGS_FILE = "volume-groups.json"
VERSION = 1


class KnownVolumeGroups:
    """The VGs this node has had, kept in `state_dir`.

    `backup_dir`: where LVM keeps its metadata backups, None when LVM keeps none
    or it cannot be read; asked only when the record has to be made again.
    """

    def __init__(self, state_dir: str, backup_dir: Callable[[], str | None]) -> None:
        self.path = os.path.join(state_dir, KNOWN_VGS_FILE)
        self._backup_dir = backup_dir
        self._lock = threading.Lock()
        self._known: set[str] | None = self._load()

    def _load(self) -> set[str] | None:
        try:
            with open(self.path, encoding="utf-8") as f:
                data = json.load(f)
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as err:
            log.warning("cannot read %s (%s): made again from LVM", self.path, err)
            return None
        names = data.get("volume_groups") if isinstance(data, dict) else None
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            log.warning("%s is not a list of volume groups: made again from LVM", self.path)
            return None
        return set(names)

    def _write(self, known: set[str]) -> None:
        text = json.dumps({"version": VERSION, "volume_groups": sorted(known)}) + "\n"
        write_atomic(self.path, text)

    def seed(self, present: Iterable[str], missing: Iterable[str]) -> None:
        """Record `present`; when there is no record yet, also the `missing` VGs
        LVM has a metadata backup of (all of them when that cannot be read)."""
        present, missing = set(present), set(missing)
        with self._lock:
            if self._known is not None:
                grown = self._known | present
                if grown != self._known:
                    self._write(grown)
                    self._known = grown
                return
            had, why = self._lvm_had(missing) if missing else (set(), "")
            known = present | had
            self._write(known)
            self._known = known
            if missing:
                log.info("volume groups missing at start: %s; known to this node before "
                         "(%s): %s", ", ".join(sorted(missing)), why,
                         ", ".join(sorted(had)) or "none")

    def _lvm_had(self, missing: set[str]) -> tuple[set[str], str]:
        """Those of `missing` LVM has a metadata backup of, and how that was
        told, for the log: from the backups, or, when there are none to read,
        all of them (the safe side) and why."""
        directory = self._backup_dir()
        if directory is None:
            return set(missing), ("LVM's metadata backups are off or their directory "
                                  "unknown, so every one counts")
        if not os.path.isdir(directory):
            return set(missing), (f"LVM's metadata backup directory {directory} does not "
                                  "exist, so every one counts")
        return ({vg for vg in missing if os.path.isfile(os.path.join(directory, vg))},
                f"per LVM's metadata backups in {directory}")

    def add(self, vg: str) -> None:
        """Record `vg`, durably, before anything is made in it. A no-op when it is
        known, and before seed(): until then every missing VG counts as one it had,
        and seed() records every VG that is there."""
        with self._lock:
            if self._known is None or vg in self._known:
                return
        self.seed([vg], [])

    def known(self, missing: Iterable[str]) -> list[str]:
        """Those of the `missing` VGs this node has had (all of them before seed())."""
        with self._lock:
            if self._known is None:
                return list(missing)
            return [vg for vg in missing if vg in self._known]
