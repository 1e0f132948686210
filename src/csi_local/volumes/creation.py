"""Creation policy both front ends share: whether a volume that exists may be
met again by a repeated create, how small a new volume may be, and how small
a copy's limit may be.

The CSI controller (volumes/provisioning.py) and the host volume plugin
(dhv/plugin.py) make volumes with the same steps (volumes/lifecycle.py) in
the same pools (volumes/pool.py, whose Pools.pool_of_copy is the one rule of
the class a copy goes to), placed alike (volumes/placement.py: where a name
is across the classes' VGs); these are the rules they apply before a step
runs, beside encryption.new_volume_tags (whether a new volume is encrypted,
and that a copy is what its source is). They raise storage errors. Where the
front ends word a refusal differently (the CSI plugin names the CO's volume
name and answers with a code; the host volume plugin names Nomad's volume ID
and tells Nomad what to do), each maps the error at its edge and keeps its
words.

What a repeated create that leaves a field out asks for is each front end's
to say, for its CO: a CSI CO repeats a create only until it is answered, and
with the same request, so a field left out asks for the default (the class's
encryption, the default class, no source); Nomad repeats every create at
each client start with the volume's parameters as they are now, so a field
left out asks for whatever the volume is. check_repeat takes what is asked,
so resolved.
"""

from __future__ import annotations

from csi_local.errors import Difference, SizeOutOfRange, VolumeDiffers
from csi_local.storage.lvm import LogicalVolume, VgReport
from csi_local.volumes import encryption
from csi_local.volumes.pool import Pool, Pools


def check_repeat(pools: Pools, lv: LogicalVolume, *, ours: bool, device_class: str | None,
                 same_source: bool, encrypted: bool | None, encrypted_tag: str) -> Pool:
    """The pool of `lv`, the LV a repeated create's name maps to, when the
    create may meet it again. What a volume was made as never changes, so
    VolumeDiffers otherwise, its `difference` the first of:

    - NOT_OURS: `lv` is not the front end's volume of that name (`ours`, by
      its tags);
    - NO_CLASS: it is in no device class of this node (a class since
      removed from the configuration): left alone;
    - CLASS: it is in another class than `device_class` (None: any);
    - SOURCE: it was made from another source than the create names
      (`same_source`, by the front end's tags);
    - ENCRYPTION: it is encrypted (`encrypted_tag`) and the create asks for
      a volume that is not, or the reverse (`encrypted` None: either).
    """
    pool = pools.of_lv(lv)
    where = f"LV {lv.vg}/{lv.name}"
    if not ours:
        raise VolumeDiffers(f"{where} is no volume of this name", Difference.NOT_OURS)
    if pool is None:
        raise VolumeDiffers(f"{where} is in thin pool {lv.vg}/{lv.pool}, which is no device "
                            "class of this node", Difference.NO_CLASS)
    if device_class is not None and pool.class_name != device_class:
        raise VolumeDiffers(f"{where} is in device class {pool.class_name!r}, not "
                            f"{device_class!r}", Difference.CLASS)
    if not same_source:
        raise VolumeDiffers(f"{where} was made from another source", Difference.SOURCE)
    if encrypted is not None and (encrypted_tag in lv.tags) != encrypted:
        raise VolumeDiffers(f"{where} {'is' if encrypted_tag in lv.tags else 'is not'} "
                            "encrypted", Difference.ENCRYPTION)
    return pool


def smallest_size(pool: Pool, report: VgReport, fs_minimum: int, encrypted: bool) -> int:
    """The smallest new volume of `pool` whose file system needs `fs_minimum`
    bytes. An encrypted one holds its LUKS2 header first (written at its first
    use, not here), aligned as cryptsetup will align it to the pool's chunk
    size: a volume of `fs_minimum` bytes would leave its file system the
    header smaller than its smallest."""
    if not encrypted:
        return fs_minimum
    return fs_minimum + encryption.overhead(pool.chunk_size(report))


def check_copy_limit(source: LogicalVolume, limit: int, field: str) -> None:
    """A copy (a restore, a clone) is at least as large as its source, so a
    limit (bytes; 0: none) below the source's size is SizeOutOfRange;
    `field` names the limit as the request did."""
    if limit and limit < source.size:
        raise SizeOutOfRange(f"{field} {limit} is smaller than the source's "
                             f"{source.size} bytes")
