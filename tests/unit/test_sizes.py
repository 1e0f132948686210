"""The size rule of a CSI volume (sizes.size_for with the CSI plugin's
default) and the range check of a retry (sizes.in_range)."""

import pytest

from csi_local.errors import SizeOutOfRange, UnsupportedFilesystem
from csi_local.host import filesystem_rules as fsrules
from csi_local.volumes import sizes
from csi_local.volumes.provisioning import DEFAULT_SIZE

MiB = 1 << 20
EXTENT = 4 * MiB


@pytest.mark.parametrize(
    ("req", "lim", "minimum", "want"),
    [
        (1, 0, 0, EXTENT),
        (EXTENT + 1, 0, 0, 2 * EXTENT),
        (0, 0, 0, 1 << 30),
        (0, 10 * MiB, 0, 8 * MiB),
        (10 * MiB, 12 * MiB, 0, 12 * MiB),
        (10 * MiB, 0, 300 * MiB, 300 * MiB),
    ],
)
def test_size_rounds_up_to_extents(req: int, lim: int, minimum: int, want: int) -> None:
    assert sizes.size_for(req, lim, EXTENT, default=DEFAULT_SIZE, minimum=minimum) == want


@pytest.mark.parametrize(("req", "lim"), [(5 * MiB, 6 * MiB), (10, 5), (0, MiB)])
def test_unmeetable_range_is_out_of_range(req: int, lim: int) -> None:
    with pytest.raises(SizeOutOfRange):
        sizes.size_for(req, lim, EXTENT, default=DEFAULT_SIZE)


@pytest.mark.parametrize(("size", "req", "lim", "want"), [
    (8 * MiB, 0, 0, True),
    (8 * MiB, 8 * MiB, 8 * MiB, True),
    (8 * MiB, 8 * MiB + 1, 0, False),
    (8 * MiB, 0, 8 * MiB - 1, False),
    (8 * MiB, 4 * MiB, 12 * MiB, True),
])
def test_in_range(size: int, req: int, lim: int, want: bool) -> None:
    assert sizes.in_range(size, req, lim) is want


@pytest.mark.parametrize(
    ("fs_types", "default", "want"),
    [
        ((), "xfs", 0),  # block only: no file system asks for room
        (("",), "ext4", 2 * MiB),  # the smallest with a journal
        (("",), "xfs", 300 * MiB),  # "" is the class's default
        (("ext4", "btrfs"), "xfs", 128 * MiB),  # the largest of those asked
        (("", "btrfs"), "xfs", 300 * MiB),
    ],
)
def test_minimum_size(monkeypatch: pytest.MonkeyPatch, fs_types: tuple[str, ...],
                      default: str, want: int) -> None:
    monkeypatch.setattr(fsrules, "mkfs_available", lambda fs: True)
    assert sizes.minimum_size(fs_types, default) == want


def test_minimum_size_refuses_a_file_system_it_cannot_make(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fsrules, "mkfs_available", lambda fs: fs != "xfs")
    with pytest.raises(UnsupportedFilesystem, match=r"mkfs\.xfs is missing"):
        sizes.minimum_size(("",), "xfs")
    with pytest.raises(UnsupportedFilesystem, match="not supported"):
        sizes.minimum_size(("zfs",), "ext4")


@pytest.mark.parametrize(("io_size", "offset"), [
    (0, 16 * MiB),  # unknown: cryptsetup's default alignment, 1 MiB
    (64 << 10, 16 * MiB),  # divides 1 MiB: aligned to 1 MiB
    (192 << 10, 16 * MiB + (128 << 10)),  # does not: to 192 KiB (86 of them)
    (MiB, 16 * MiB),
    (2 * MiB, 16 * MiB),
    (3 * MiB, 18 * MiB),
    (32 * MiB, 32 * MiB),
])
def test_the_data_offset_cryptsetup_chooses(io_size: int, offset: int) -> None:
    from csi_local.host.crypt import data_offset_for
    assert data_offset_for(io_size) == offset
