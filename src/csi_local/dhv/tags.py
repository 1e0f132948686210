"""What a host volume is in LVM terms: its LV name and its tags.

LV names ("dhv-<hash of the volume ID>") and tags ("csi-local-dhv.*") are
disjoint from the CSI plugin's, so neither plugin lists, changes or removes
the other's volumes.
"""

from __future__ import annotations

from csi_local.dhv.request import Request
from csi_local.lvm import decode_hex_tag, hex_tag

__all__ = ["decode_hex_tag", "volume_tags"]

TAG_KIND = "csi-local-dhv.kind"
KIND_VOLUME = "volume"
TAG_ID = "csi-local-dhv.id"  # the Nomad volume ID, verbatim (validated)
TAG_NAME = "csi-local-dhv.name"  # the Nomad volume name, hex-encoded
TAG_NAMESPACE = "csi-local-dhv.namespace"  # hex-encoded
TAG_FS = "csi-local-dhv.fs"  # the file system the volume was made with
TAG_FRESH = "csi-local-dhv.fresh"  # never formatted: mkfs is allowed
TAG_GROW_FS = "csi-local-dhv.grow-fs"  # extended, fs not yet grown


def volume_tags(req: Request, fs_type: str) -> list[str]:
    """Tags of a new volume: its own namespace, never the CSI plugin's."""
    return [
        f"{TAG_KIND}={KIND_VOLUME}",
        f"{TAG_ID}={req.volume_id}",
        f"{TAG_FS}={fs_type}",
        TAG_FRESH,
        *hex_tag(TAG_NAME, req.volume_name),
        *hex_tag(TAG_NAMESPACE, req.namespace),
    ]
