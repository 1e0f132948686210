"""What the node records of a CSI volume's use: where it is staged and
published, how, and where a block volume's device is bound at its stage.

The volume layer's node side (volumes/staging.py) makes these records and
reads them back; nodestate/state_file.py stores them (the state file) and
nodestate/recovery.py rebuilds them from the mount table. Here, below all
three, so that each works on the same types and the same rules. No gRPC
types: an access mode is the CSI spec's number for it, as the state file
stores it.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from enum import StrEnum

# The CSI spec's VolumeCapability.AccessMode numbers that the records' rules
# need (tests/unit/test_node_records.py checks them against the generated
# stubs). 0 is no mode at all: a record rebuilt from the mount table.
SINGLE_NODE_SINGLE_WRITER = 6

# The publish (target) paths of the COs: what recovery attributes a mount by
# (nodestate/recovery.py) and what names the workload whose cgroup gets a
# volume's IO limits (volumes/qos_enforcement.py). kubelet (pkg/volume/csi):
# a file system at <kubelet>/pods/<pod uid>/volumes/kubernetes.io~csi/<pv>/mount,
# a block device at <kubelet>/plugins/kubernetes.io/csi/volumeDevices/publish/<pv>/<pod uid>.
K8S_PUBLISH = re.compile(r"/pods/(?P<pod>[^/]+)/volumes/kubernetes\.io~csi/[^/]+/mount\Z")
K8S_BLOCK_PUBLISH = re.compile(
    r"/plugins/kubernetes\.io/csi/volumeDevices/publish/[^/]+/(?P<pod>[^/]+)\Z")
# Nomad (client/pluginmanager/csimanager): <mount dir>/per-alloc/<alloc id>/<volume>/<usage>.
NOMAD_PUBLISH = re.compile(
    r"/per-alloc/(?P<alloc>[^/]+)/[^/]+/[a-z]+-(?:file-system|block-device)-[a-z-]+\Z")


class AccessType(StrEnum):
    """How a volume is staged and published: a mounted file system or the raw device."""

    MOUNT = "mount"
    BLOCK = "block"


@dataclass(frozen=True)
class Publish:
    readonly: bool = False
    access_mode: int = 0  # 0: unknown (a record rebuilt from the mount table)
    mount_flags: tuple[str, ...] = ()
    # False for a record rebuilt from mountinfo or written before flags were
    # recorded: the CO's repeat of its request settles them.
    flags_known: bool = True

    def matches(self, want: Publish) -> bool:
        """Whether a repeat of the publish that asks for `want` is this one. What
        the record does not know (the access mode, the flags) does not differ."""
        return (self.readonly == want.readonly
                and self.access_mode in (0, want.access_mode)
                and (not self.flags_known or self.mount_flags == want.mount_flags))


@dataclass(frozen=True)
class Staging:
    path: str
    access_type: AccessType
    fs_type: str = ""
    mount_flags: tuple[str, ...] = ()
    access_mode: int = 0
    # False for a record rebuilt from mountinfo, which shows the effective mount
    # options, not the flags the CO asked for.
    flags_known: bool = True

    def mount_point(self, volume_id: str) -> str:
        """Where this stage mounts the volume's device: the staging path for a
        file system, the block stage file for the raw device."""
        if self.access_type is AccessType.BLOCK:
            return block_stage_file(self.path, volume_id)
        return self.path


@dataclass(frozen=True)
class VolumeRecord:
    volume_id: str
    staging: Staging | None = None
    publishes: dict[str, Publish] = field(default_factory=dict)

    @property
    def publish_count(self) -> int:
        return len(self.publishes)

    @property
    def empty(self) -> bool:
        return self.staging is None and not self.publishes


def block_stage_file(staging_path: str, volume_id: str) -> str:
    """Where a block volume's stage binds its device node: a file named after
    the volume in the staging directory, so that the kernel's mount table
    shows the stage too (and a restart can find it there again)."""
    return os.path.join(staging_path, volume_id)


def block_staging_path(mount_point: str, volume_id: str) -> str | None:
    """The staging path whose block stage file of volume `volume_id` is
    `mount_point` (block_stage_file's inverse), None for a mount point of
    another shape."""
    if os.path.basename(mount_point) != volume_id:
        return None
    return os.path.dirname(mount_point)


def writer_in_the_way(publishes: dict[str, Publish], target: str, want: Publish) -> str | None:
    """The target of a writer that a publish of `want` at `target` may not
    join, else None. SINGLE_NODE_SINGLE_WRITER allows one writer on the node:
    a writable publish is refused while another target has a writer, when
    either the new publish or that writer asked for single-writer access.
    Readers never conflict; the same target again is a repeat, not a second
    writer."""
    others = {t: p for t, p in publishes.items() if t != target}
    if want.readonly or not others:
        return None
    single = want.access_mode == SINGLE_NODE_SINGLE_WRITER or any(
        p.access_mode == SINGLE_NODE_SINGLE_WRITER and not p.readonly for p in others.values())
    if not single:
        return None
    writers = [t for t, p in others.items() if not p.readonly]
    return writers[0] if writers else None
