"""The volume lifecycle again, on the newer kernel (Debian's 6.12 backports
kernel, tests/harness/vm.py NEWER_KERNEL_FILES): the rest of the suite runs
on Debian 12's 6.1, and the README names both as the supported range.

The tests are the stock kernel's own, imported (pytest collects them here as
this file's tests, so the harness boots them in the newer kernel's guest):
create, stage, publish, IO through a mount and a raw block device, a
snapshot and its restore, a clone of a mounted volume, online growth, and an
encrypted raw block volume (dm-crypt). `core`: the README's budgeted command
always runs them, so CI covers both ends of the kernel range.
"""

from __future__ import annotations

import os

import pytest

from tests.integration.test_encryption import test_block_volume_round_trip
from tests.integration.test_node import (
    test_block_volume_io_through_target,
    test_mount_lifecycle_keeps_data,
)
from tests.integration.test_snapshots import (
    test_clone_of_live_mounted_volume,
    test_online_expansion_while_published,
    test_snapshot_restore_holds_exactly_the_first_data,
)

pytestmark = [pytest.mark.integration, pytest.mark.core]

__all__ = [
    "test_block_volume_io_through_target",
    "test_block_volume_round_trip",
    "test_clone_of_live_mounted_volume",
    "test_mount_lifecycle_keeps_data",
    "test_online_expansion_while_published",
    "test_snapshot_restore_holds_exactly_the_first_data",
]

# The oldest kernel this file's guest may run: the newer end of the range.
NEWER = (6, 12)


def test_the_guest_runs_the_newer_kernel() -> None:
    """Proof that the lifecycle above ran on the newer kernel, not 6.1."""
    release = os.uname().release
    major, minor = (int(x) for x in release.split(".")[:2])
    assert (major, minor) >= NEWER, f"this guest runs {release}, not {NEWER[0]}.{NEWER[1]}+"
