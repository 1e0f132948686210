"""The format version of an LV's tags, and the one rule about it, for both
plugins (docs/on-disk-format.md).

Each plugin's LVs carry a format number in a tag of their own namespace
(`csi-local.format=N`, `csi-local-dhv.format=N`; the numbers live beside
the other tag names, in naming.py and host_volume_names.py). An LV without
one is of format 1: every LV made before the format was written down, and
every LV made while the format is 1, since the tag is written only above 1:
it would tell nothing more, and every tag is bytes in the VG's metadata
area, which bounds how many LVs a VG holds.

The rule: a plugin acts on no LV of a format above its own (it may have
been made or changed by a newer csi-local, whose tags this version may read
wrongly): FormatTooNew, naming both formats, and nothing done. Reading it
(a listing, a condition) stays allowed. A format tag whose value is no
number is not ours to judge either: refused the same way.
"""

from __future__ import annotations

from csi_local.errors import FormatTooNew
from csi_local.storage.lvm import LogicalVolume
from csi_local.version import __version__

# The format of an LV without a format tag.
UNTAGGED = 1


def format_tags(tag: str, current: int) -> list[str]:
    """The format tag a new LV carries: none while the format is 1."""
    return [] if current == UNTAGGED else [f"{tag}={current}"]


def lv_format(lv: LogicalVolume, tag: str) -> int | str:
    """The LV's format: UNTAGGED when it carries no `tag`; the highest when it
    carries several; a value that is not a whole number as it stands."""
    values = [t[len(tag) + 1:] for t in lv.tags if t.startswith(f"{tag}=")]
    if not values:
        return UNTAGGED
    odd = [v for v in values if not (v.isascii() and v.isdigit())]
    return odd[0] if odd else max(int(v) for v in values)


def require_known(lv: LogicalVolume, tag: str, current: int, what: str) -> None:
    """FormatTooNew when `lv` (`what`: "volume", "snapshot", ... for the
    message) is of a format above `current`, or one that is no number."""
    found = lv_format(lv, tag)
    if isinstance(found, int) and found <= current:
        return
    raise FormatTooNew(
        f"{what} {lv.vg}/{lv.name} is of on-disk format {found} ({tag}), newer than "
        f"format {current}, the newest this csi-local ({__version__}) knows: a newer "
        "csi-local made or changed it. Refusing to touch it; upgrade csi-local on this "
        "node (docs/on-disk-format.md)")
