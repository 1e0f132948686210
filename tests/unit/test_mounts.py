from pathlib import Path

import pytest

from csi_local.host import mounts

SAMPLE = """\
22 1 0:21 / / rw,relatime shared:1 - ext4 /dev/vda rw
30 22 0:5 / /dev rw,nosuid shared:2 - devtmpfs udev rw,size=1000k
41 22 253:4 / /var/lib/kubelet/staging/pv1 rw,noatime shared:20 - ext4 /dev/mapper/vg-csi--v--1 rw
42 22 253:4 / /var/lib/kubelet/pods/x/mount rw,noatime shared:20 - ext4 /dev/mapper/vg-csi--v--1 rw
43 22 253:4 / /var/lib/kubelet/pods/y/mount ro,noatime shared:20 - ext4 /dev/mapper/vg-csi--v--1 rw
44 22 0:5 /dm-5 /var/lib/kubelet/block/dev\\040file rw shared:2 - devtmpfs udev rw
45 22 253:6 / /mnt/broken rw - ext4 /dev/mapper/vg-b ro,errors=remount-ro
"""


def test_parse_fields_and_escapes() -> None:
    table = mounts.parse_mountinfo(SAMPLE)
    assert len(table) == 7
    pub = table[4]
    assert (pub.major, pub.minor, pub.root) == (253, 4, "/")
    assert pub.read_only and not pub.fs_read_only
    assert table[5].mount_point == "/var/lib/kubelet/block/dev file"
    assert table[5].root == "/dm-5" and table[5].fs_type == "devtmpfs"
    assert table[6].fs_read_only


def test_mounts_at_in_mount_order() -> None:
    table = mounts.parse_mountinfo(SAMPLE)
    found = mounts.mounts_at("/var/lib/kubelet/staging/pv1/", table)
    assert [m.mount_id for m in found] == [41]


def test_mount_is_device_for_fs_mounts() -> None:
    table = mounts.parse_mountinfo(SAMPLE)
    assert mounts.mount_is_device(table[2], 253, 4)
    assert not mounts.mount_is_device(table[2], 253, 5)


def test_btrfs_mount_is_recognised_by_its_source(monkeypatch: pytest.MonkeyPatch) -> None:
    # btrfs shows an anonymous device number in mountinfo, not the LV's.
    line = "60 22 0:45 / /stage rw,relatime - btrfs /dev/mapper/vg0-v rw,space_cache=v2\n"
    (m,) = mounts.parse_mountinfo(line)
    monkeypatch.setattr(mounts, "device_numbers",
                        lambda dev: (253, 4) if dev == "/dev/mapper/vg0-v" else (8, 0))
    assert mounts.mount_is_device(m, 253, 4)
    assert not mounts.mount_is_device(m, 253, 5)


@pytest.mark.parametrize("path", ["/", "/dev", "/var/lib/kubelet/staging/pv1/",
                                  "/var/lib/kubelet/block/dev file", "/var/lib/kubelet",
                                  "/var/lib/kubelet/pods/x", "/mnt/broken", "/nowhere"])
def test_read_mounts_at_is_mounts_at_of_the_whole_table(tmp_path: Path, path: str) -> None:
    """Only the lines that name the path are parsed; the answer is the same,
    escapes included, and a path that is a prefix of others matches none of them."""
    source = tmp_path / "mountinfo"
    # A second mount stacked on the staging path, and one whose source names it.
    source.write_text(SAMPLE + "46 41 0:9 / /var/lib/kubelet/staging/pv1 rw - tmpfs "
                      "/var/lib/kubelet/staging/pv1 rw\n")
    whole = mounts.parse_mountinfo(source.read_text())
    assert mounts.read_mounts_at(path, str(source)) == mounts.mounts_at(path, whole)
