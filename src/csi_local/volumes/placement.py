"""Placement over the node's device classes: where an object of a name is
across the classes' volume groups, and whether a new one may be made. The
one rule of both front ends (the CSI controller's volumes/provisioning.py,
the host volume plugin's dhv/plugin.py), for volumes and snapshots alike.

A class is stored nowhere but in an LV's volume group and thin pool, and LVM
keeps names unique only within one volume group, so with the classes in
several VGs nothing but this rule keeps a name one object. It refuses,
rather than guess, wherever guessing could make a second object of a name or
act on one whose class is unknown:

- A name with an LV in more than one of the classes' VGs: which is the
  object is unknown, so neither is met again nor copied (AmbiguousName).
- A name with no LV in the VGs that are there, while a VG this node has had
  is missing (Pools' known VGs): the object may be in it, so nothing is made
  until it is back (VolumeGroupMissing); a VG the node never had holds none.
- An LV of the name in no class's thin pool (a class since removed, another
  user's LV): it is what the name maps to, found like any other, and the
  front end's repeat check (volumes/creation.py, check_repeat) refuses it;
  never passed over to make another. A source in no class is refused by
  Pools.pool_of_copy, loudly, not called "not found".

A new object goes to the pool of the class asked for (the default when none
is), a copy to its source's (Pools.pool_of_copy). How a source is named is
each front end's (the CSI plugin's IDs are LV names; the host volume plugin
also takes a volume's name, which its tags say): it resolves the source to an
LV over the same read, and the LV then passes the same rule.

Storage errors only; each front end words its refusal.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from csi_local.errors import AmbiguousName, VolumeGroupMissing
from csi_local.storage.lvm import LogicalVolume
from csi_local.volumes.pool import Pool, Pools


@dataclass(frozen=True)
class Seen:
    """One read of the classes' VGs: LVs (each with its class's pool, None
    for an LV in no class's thin pool) and the missing VGs that may hold
    others (Pools.scan, Pools.read_names)."""

    lvs: Sequence[tuple[Pool | None, LogicalVolume]]
    missing: Sequence[str]

    def named(self, name: str) -> list[tuple[Pool | None, LogicalVolume]]:
        """Every LV of that name, in whatever VG and pool."""
        return [(pool, lv) for pool, lv in self.lvs if lv.name == name]


def needs_read(pools: Pools, with_source: bool) -> bool:
    """Whether a create must read the classes' VGs before its pool's report:
    with the classes in several VGs (the name may be in another than the
    pool's), or with a source and several classes (its class is the copy's).
    Otherwise the one report of the pool's VG, under its lock, sees every LV
    the name could be, and fails if the VG is missing."""
    return not pools.single_vg or (with_source and len(pools) > 1)


def read(pools: Pools, names: Sequence[str]) -> Seen:
    """The LVs of `names` in the classes' VGs, from one `lvs`."""
    lvs, missing = pools.read_names(names)
    return Seen(lvs, missing)


def only(seen: Seen, name: str) -> tuple[Pool | None, LogicalVolume] | None:
    """The one LV named `name` that `seen` holds, with its pool; None when
    there is none. AmbiguousName when there are several."""
    found = seen.named(name)
    if len(found) > 1:
        where = ", ".join(f"{lv.vg}/{lv.name}" for _, lv in found)
        raise AmbiguousName(f"{name} has an LV in several volume groups ({where})",
                            tuple(f"{lv.vg}/{lv.name}" for _, lv in found))
    return found[0] if found else None


def existing(seen: Seen, name: str) -> tuple[Pool | None, LogicalVolume] | None:
    """Where the object `name` is: its one LV and its pool (None: in no
    class's pool, for the front end's repeat check to refuse), or None when
    it is nowhere, and so may be made. AmbiguousName for several LVs;
    VolumeGroupMissing when it is nowhere while a VG that may hold it is
    missing."""
    found = only(seen, name)
    if found is None and seen.missing:
        raise VolumeGroupMissing(
            f"volume group {', '.join(seen.missing)} not found: {name} may be there, so "
            "nothing of that name is made until it is back")
    return found
