"""An LV's device-mapper devices as LVM names and stacks them, and what their
status says: whether a thin volume maps any block, how full a thin pool is.
Asked of the kernel through the Kernel (one ioctl each, no process); the Kernel
knows device-mapper, this module knows which of its devices is which LV.

Which device to ask (LVM 2.03, verified on Debian 12's 6.1 kernel):

- a thin LV is one device, `dm_name(vg, lv)`, with one `thin` target, while
  it is active. An inactive LV (deactivated, or a snapshot with activation
  skip) has no device at all.
- a thin pool's `thin-pool` target moves. A pool with no thin LV ever
  activated beside it is one device, `dm_name(vg, pool)`, carrying the
  target. Once a thin LV is active, LVM stacks it: the target is in
  `dm_name(vg, pool) + "-tpool"` and `dm_name(vg, pool)` is a read-only
  `linear` over it (which stays, as does the -tpool device, after the thin
  LVs are deactivated again). `lvchange -an` of the pool with thin LVs
  active removes only the linear device: the -tpool device lives on for
  them. Hence `pool_usage`, which asks both.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from csi_local.errors import DmReplyMalformed, DmStatusUnusable, SyscallError
from csi_local.host import device_mapper as dm
from csi_local.host.device_mapper import PoolUsage

if TYPE_CHECKING:
    from csi_local.host.kernel import Kernel

log = logging.getLogger(__name__)


def dm_name(vg: str, lv: str) -> str:
    """The device-mapper name LVM gives vg/lv: every "-" in each part doubled,
    the parts joined by "-" (so the join stays unambiguous)."""
    return f"{vg.replace('-', '--')}-{lv.replace('-', '--')}"


def thin_mapped_sectors(host: Kernel, vg: str, lv: str) -> int | None:
    """Sectors (512 bytes) the active thin volume `vg`/`lv` maps in its pool,
    from the kernel's status of its device; 0: it holds no data at all. None
    when that cannot be known (not active, not a thin device, a failed pool):
    callers take None as "may hold data"."""
    name = dm_name(vg, lv)
    try:
        targets = host.dm_status(name)
        if targets is None:
            return None
        return dm.parse_thin_status(dm.single_target(name, targets, "thin").params)
    except (DmStatusUnusable, DmReplyMalformed, SyscallError, ValueError) as err:
        log.warning("device-mapper status of %s/%s: %s", vg, lv, err)
        return None


def pool_usage(host: Kernel, vg: str, pool: str) -> PoolUsage | None:
    """The usage of LVM thin pool vg/pool, from whichever device carries its
    thin-pool target; None when neither exists (the pool is not active).
    Reading it makes the pool commit its metadata first, as `dmsetup status`
    does, so the figures are current.

    "<pool>-tpool" first: once it exists, the plain name is a linear layer
    over it. The plain name is asked only when there is no -tpool device; if
    it is not the thin-pool target there, LVM has just stacked the pool (the
    first thin LV's activation) between the two lookups, so they are asked
    again."""
    base = dm_name(vg, pool)
    for _ in range(2):
        targets = host.dm_status(f"{base}-tpool")
        if targets is None:
            targets = host.dm_status(base)
            if targets is None:
                return None
            if len(targets) == 1 and targets[0].target_type != "thin-pool":
                continue  # stacked meanwhile: the target is in -tpool now
            return dm.parse_thin_pool_status(dm.single_target(base, targets, "thin-pool").params)
        return dm.parse_thin_pool_status(dm.single_target(f"{base}-tpool", targets,
                                                          "thin-pool").params)
    raise DmStatusUnusable(f"thin pool {vg}/{pool}: neither {base}-tpool nor {base} carries "
                           "a thin-pool target")
