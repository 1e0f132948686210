"""What a Nomad host volume is in LVM terms: its LV name prefix and its tags.

LV names ("dhv-<hash of the volume ID>") and tags ("csi-local-dhv.*") are
disjoint from the CSI plugin's, so neither plugin lists, changes or removes
the other's volumes. Here, below both front ends, because `status` reads
them too; the host volume plugin (dhv/) validates requests and derives the
names.
"""

from __future__ import annotations

from csi_local.storage.lvm import LogicalVolume, decode_hex_tag, hex_tag
from csi_local.volumes.format_version import format_tags, require_known

__all__ = ["decode_hex_tag", "volume_tags"]

LV_PREFIX = "dhv-"
SNAPSHOT_LV_PREFIX = "dhv-snap-"
TAG_KIND = "csi-local-dhv.kind"
KIND_VOLUME = "volume"
KIND_SNAPSHOT = "snapshot"  # made by `csi-local-dhv snapshot create`
TAG_ID = "csi-local-dhv.id"  # the Nomad volume ID, verbatim (validated)
TAG_NAME = "csi-local-dhv.name"  # the Nomad volume name, hex-encoded
TAG_NAMESPACE = "csi-local-dhv.namespace"  # hex-encoded
TAG_FS = "csi-local-dhv.fs"  # the file system the volume was made with
TAG_FRESH = "csi-local-dhv.fresh"  # never formatted: mkfs is allowed
TAG_GROW_FS = "csi-local-dhv.grow-fs"  # extended, fs not yet grown
TAG_NEW_FSID = "csi-local-dhv.new-fsid"  # a clone whose fs needs its own identity first
TAG_ENCRYPTED = "csi-local-dhv.encryption=luks2"  # LUKS2 (volumes/encryption.py)
# What a clone or snapshot was made from: "volume:<Nomad ID>" or "snapshot:<name>".
TAG_SOURCE = "csi-local-dhv.source"
TAG_SNAPSHOT = "csi-local-dhv.snapshot"  # a snapshot's name, verbatim (validated)
# A clone's source_volume as the request gave it, when that was a name (hex):
# the request Nomad repeats at every client start must still match it.
TAG_SOURCE_NAME = "csi-local-dhv.source-name"
# The format of this version's tags (volumes/format_version.py;
# docs/on-disk-format.md); no tag while it is 1.
TAG_FORMAT = "csi-local-dhv.format"
FORMAT = 1


def check_format(lv: LogicalVolume) -> None:
    """FormatTooNew for a host volume or snapshot of a newer csi-local-dhv's
    format: create (a repeat, a grow), delete, a snapshot of it and a clone
    from it ask first."""
    require_known(lv, TAG_FORMAT, FORMAT, f"host {lv.tag_value(TAG_KIND) or 'LV'}")


def volume_tags(volume_id: str, volume_name: str, namespace: str, fs_type: str,
                source: str | None = None) -> list[str]:
    """Tags of a new volume: its own namespace, never the CSI plugin's. A
    clone (`source` "volume:<id>" or "snapshot:<name>") is never formatted, so
    it has no fresh tag (the clone step adds its new-fsid and grow-fs tags:
    volumes/lifecycle)."""
    tags = [
        f"{TAG_KIND}={KIND_VOLUME}",
        *format_tags(TAG_FORMAT, FORMAT),
        f"{TAG_ID}={volume_id}",
        f"{TAG_FS}={fs_type}",
        *hex_tag(TAG_NAME, volume_name),
        *hex_tag(TAG_NAMESPACE, namespace),
    ]
    if source is None:
        tags.append(TAG_FRESH)
    else:
        tags.append(f"{TAG_SOURCE}={source}")
    return tags


def snapshot_tags(name: str, volume_id: str, fs_type: str, namespace: str) -> list[str]:
    return [
        f"{TAG_KIND}={KIND_SNAPSHOT}",
        *format_tags(TAG_FORMAT, FORMAT),
        f"{TAG_SNAPSHOT}={name}",
        f"{TAG_SOURCE}=volume:{volume_id}",
        f"{TAG_FS}={fs_type}",
        *hex_tag(TAG_NAMESPACE, namespace),
    ]
