"""The keys of the named locks (host/locks.py) both plugins take, in one
namespace: the CSI plugin and the Nomad host volume plugin share the lock
directory, so they hold the same key for the same volume, pool or freeze
window and never race on it. The lock order, everywhere: a volume's key
before the pool's; of two volumes, the one being made before its source.
The locks know nothing of what they guard; these keys are the volume
layer's.
"""

from __future__ import annotations


def pool_key(vg: str, pool: str) -> str:
    """The key of one thin pool, held around every capacity check of it and the
    lvcreate or lvextend it allows (each device class's pool has its own)."""
    return f"pool:{vg}/{pool}"


def metadata_key(vg: str, pool: str) -> str:
    """The key of one thin pool's metadata snapshot: the kernel keeps at most one
    per pool, so its readers take turns (not the pool's key: reading mappings
    must not hold up creates)."""
    return f"metadata:{vg}/{pool}"


def volume_key(lv_name: str) -> str:
    """The key of one volume or snapshot, by its LV name (both plugins' LV names
    are disjoint, so one namespace serves both)."""
    return f"volume:{lv_name}"


def freeze_key(name: str) -> str:
    """The key an open freeze window of this name holds (volumes/freezes.py)."""
    return f"freeze:{name}"
