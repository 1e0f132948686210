"""csi_local.host.device_mapper against the real device-mapper: what its ioctls say of thin
LVs and thin pools, checked against dmsetup and lvs, which ask the kernel the
same questions by another road; and csi_local.storage.lv_devices, which finds
an LV's devices among them as LVM names and stacks them."""

from __future__ import annotations

import concurrent.futures
import json
import os
import time
import uuid

import pytest

from csi_local.errors import DmStatusUnusable
from csi_local.host import device_mapper as dm
from csi_local.host.device_mapper import DmDevice, PoolUsage
from csi_local.host.kernel import Kernel
from csi_local.storage.lv_devices import dm_name, pool_usage
from tests.integration.conftest import SCRATCH, LoopVG, make_vg, run

pytestmark = pytest.mark.integration
MiB = 1 << 20
HOST = Kernel()


def thin_mapped_sectors(name: str) -> int | None:
    """The mapped sectors in device `name`'s one thin target, None when there
    is no such device; DmStatusUnusable for any other table or status."""
    targets = dm.status(name)
    if targets is None:
        return None
    return dm.parse_thin_status(dm.single_target(name, targets, "thin").params)


def thin_pool_usage(name: str) -> PoolUsage | None:
    """The usage in device `name`'s one thin-pool target, as thin_mapped_sectors."""
    targets = dm.status(name)
    if targets is None:
        return None
    return dm.parse_thin_pool_status(dm.single_target(name, targets, "thin-pool").params)


def thin_lv(vg: LoopVG, name: str, size_mib: int = 64) -> str:
    """A new thin LV in the VG's pool; its device-mapper name."""
    run("lvcreate", "--yes", "--thin", "--virtualsize", f"{size_mib}M", "--name", name,
        f"{vg.name}/{vg.pool}")
    return dm_name(vg.name, name)


def dmsetup_status(name: str) -> str:
    """The status text of `name`'s one target, as dmsetup prints it."""
    fields = run("dmsetup", "status", name).stdout.split()
    return " ".join(fields[3:])


def dmsetup_info(name: str) -> tuple[int, int, int]:
    """(major, minor, open count) as dmsetup reports them."""
    out = run("dmsetup", "info", "-c", "--noheadings", "--separator", ":",
              "-o", "major,minor,open", name).stdout.strip()
    major, minor, open_count = (int(x) for x in out.split(":"))
    return major, minor, open_count


def write_direct(path: str, mib: int) -> None:
    """`mib` MiB of random data at the start of `path`, past the page cache."""
    run("dd", "if=/dev/urandom", f"of={path}", "bs=1M", f"count={mib}", "oflag=direct",
        "status=none")


def lvs_percent(vg: LoopVG) -> tuple[float, float]:
    out = run("lvs", "--reportformat", "json", "-o", "data_percent,metadata_percent",
              f"{vg.name}/{vg.pool}").stdout
    row = json.loads(out)["report"][0]["lv"][0]
    return float(row["data_percent"]), float(row["metadata_percent"])


def test_mapped_sectors_follow_writes_snapshots_and_discards(vg: LoopVG) -> None:
    name = thin_lv(vg, "dm-data")  # a "-" in the LV name: doubled in the dm name
    assert name == f"{vg.name}-dm--data"
    path = f"/dev/mapper/{name}"
    assert dmsetup_status(name) == "0 -"
    assert thin_mapped_sectors(name) == 0

    write_direct(path, 3)
    mapped = thin_mapped_sectors(name)
    assert mapped is not None and mapped >= 3 * MiB // 512
    assert str(mapped) == dmsetup_status(name).split()[0]
    assert dm.status(name) == [dm.Target(0, 64 * MiB // 512, "thin", dmsetup_status(name))]

    # A thin snapshot shares its origin's blocks: the same count.
    run("lvcreate", "--yes", "--snapshot", "--name", "dm-snap", f"{vg.name}/dm-data")
    snap = dm_name(vg.name, "dm-snap")
    assert thin_mapped_sectors(snap) is None  # thin snapshots skip activation
    run("lvchange", "--activate", "y", "--ignoreactivationskip", f"{vg.name}/dm-snap")
    assert thin_mapped_sectors(snap) == mapped

    # Discarding the whole LV unmaps every chunk: nothing left, exactly 0;
    # the snapshot keeps what it shared.
    run("blkdiscard", path)
    assert dmsetup_status(name) == "0 -"
    assert thin_mapped_sectors(name) == 0
    assert thin_mapped_sectors(snap) == mapped


def test_device_agrees_with_dmsetup_while_opened_mounted_and_suspended(vg: LoopVG) -> None:
    name = thin_lv(vg, "dm-info")
    path = f"/dev/mapper/{name}"
    rdev = os.stat(path).st_rdev
    major, minor, _ = dmsetup_info(name)
    assert (major, minor) == (os.major(rdev), os.minor(rdev))
    assert dm.device(name) == DmDevice(major, minor, 0, live=True, suspended=False)

    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        assert dmsetup_info(name) == (major, minor, 1)
        assert dm.device(name) == DmDevice(major, minor, 1, live=True, suspended=False)
    finally:
        os.close(fd)
    assert dm.device(name) == DmDevice(major, minor, 0, live=True, suspended=False)

    run("mkfs.ext4", "-q", path)
    mnt = SCRATCH / f"dm-mnt-{uuid.uuid4().hex[:8]}"
    mnt.mkdir(parents=True)
    run("mount", path, str(mnt))
    try:
        assert dmsetup_info(name) == (major, minor, 1)
        assert dm.device(name) == DmDevice(major, minor, 1, live=True, suspended=False)
    finally:
        run("umount", str(mnt))
        mnt.rmdir()
    assert dm.device(name) == DmDevice(major, minor, 0, live=True, suspended=False)

    # A suspended thin device still answers its status (the mapping is the pool's).
    mapped = thin_mapped_sectors(name)
    assert mapped is not None and mapped > 0  # mkfs wrote
    run("dmsetup", "suspend", name)
    try:
        assert dm.device(name) == DmDevice(major, minor, 0, live=True, suspended=True)
        assert thin_mapped_sectors(name) == mapped
    finally:
        run("dmsetup", "resume", name)
    assert dm.device(name) == DmDevice(major, minor, 0, live=True, suspended=False)


def test_no_such_device_and_a_deactivated_lv_are_none(vg: LoopVG) -> None:
    missing = f"csi-local-no-such-{uuid.uuid4().hex[:8]}"
    assert dm.device(missing) is None
    assert dm.status(missing) is None
    assert thin_mapped_sectors(missing) is None
    assert thin_pool_usage(missing) is None

    name = thin_lv(vg, "dm-off")
    assert dm.device(name) is not None
    run("lvchange", "--activate", "n", f"{vg.name}/dm-off")
    assert dm.device(name) is None
    assert dm.status(name) is None
    assert thin_mapped_sectors(name) is None


def test_the_device_list_is_what_dmsetup_ls_lists(vg: LoopVG) -> None:
    thin_lv(vg, "dm-list-a")
    thin_lv(vg, "dm-list-b")
    run("lvchange", "--activate", "n", f"{vg.name}/dm-list-b")

    def dmsetup_ls() -> dict[str, tuple[int, int]]:
        out = run("dmsetup", "ls").stdout
        if "No devices found" in out:
            return {}
        found = {}
        for line in out.splitlines():
            if line.strip():
                name, numbers = line.rsplit(None, 1)  # "vg-lv\t(254:3)"
                major, minor = numbers.strip("()").split(":")
                found[name.strip()] = (int(major), int(minor))
        return found

    listed = dm.devices()
    assert listed == dmsetup_ls()
    assert dm_name(vg.name, "dm-list-a") in listed  # active
    assert dm_name(vg.name, "dm-list-b") not in listed  # deactivated: no device
    rdev = os.stat(f"/dev/mapper/{dm_name(vg.name, 'dm-list-a')}").st_rdev
    assert listed[dm_name(vg.name, "dm-list-a")] == (os.major(rdev), os.minor(rdev))


def test_a_device_of_another_target_is_unusable_not_empty(vg: LoopVG) -> None:
    name = f"csi-local-zero-{uuid.uuid4().hex[:8]}"
    run("dmsetup", "create", name, "--notable")
    try:
        # Created, no table: a device that is not live, with no targets.
        got = dm.device(name)
        assert got is not None and not got.live and got.open_count == 0
        assert dm.status(name) == []
        with pytest.raises(DmStatusUnusable):
            thin_mapped_sectors(name)
        run("dmsetup", "load", name, input="0 8 zero\n")
        run("dmsetup", "resume", name)
        got = dm.device(name)
        assert got is not None and got.live
        assert dm.status(name) == [dm.Target(0, 8, "zero", "")]
        with pytest.raises(DmStatusUnusable):
            thin_mapped_sectors(name)
        with pytest.raises(DmStatusUnusable):
            thin_pool_usage(name)
    finally:
        run("dmsetup", "remove", name)


def test_thin_pool_usage_agrees_with_dmsetup_and_lvs(vg: LoopVG) -> None:
    name = thin_lv(vg, "dm-fill", size_mib=128)
    write_direct(f"/dev/mapper/{name}", 40)
    base = dm_name(vg.name, vg.pool)
    tpool = f"{base}-tpool"
    # With a thin LV active, LVM stacks the pool: the thin-pool target is the
    # -tpool device, under a linear device of the pool's own name.
    assert run("dmsetup", "status", base).stdout.split()[2] == "linear"
    with pytest.raises(DmStatusUnusable):
        thin_pool_usage(base)
    # Each status read makes the pool commit; with no I/O between, the
    # figures stay put, so dmsetup's and ours are the same reading.
    usage = thin_pool_usage(tpool)
    assert usage == dm.parse_thin_pool_status(dmsetup_status(tpool))
    assert usage == pool_usage(HOST, vg.name, vg.pool)
    assert usage is not None
    assert not (usage.read_only or usage.out_of_data_space or usage.needs_check)
    assert usage.data_used > 0 and usage.metadata_used > 0
    data_percent, metadata_percent = lvs_percent(vg)
    assert abs(100 * usage.data_used / usage.data_total - data_percent) < 0.01
    assert abs(100 * usage.metadata_used / usage.metadata_total - metadata_percent) < 0.01


def test_where_the_thin_pool_target_lives() -> None:
    """A pool of its own, from creation: one device until a thin LV is active,
    stacked from then on; pool_usage finds the target either way."""
    small = make_vg(size=256 * MiB)
    try:
        base = dm_name(small.name, small.pool)
        tpool = f"{base}-tpool"
        assert dm.status(tpool) is None
        alone = thin_pool_usage(base)
        assert alone is not None and alone.data_used == 0
        assert pool_usage(HOST, small.name, small.pool) == alone

        thin_lv(small, "t")
        assert [t.target_type for t in dm.status(base) or []] == ["linear"]
        stacked = thin_pool_usage(tpool)
        assert stacked is not None and stacked.transaction_id == alone.transaction_id + 1
        assert pool_usage(HOST, small.name, small.pool) == stacked

        # Deactivating the pool LV with a thin LV active takes away only the
        # linear layer: the target stays for the thin LV.
        run("lvchange", "--activate", "n", f"{small.name}/{small.pool}")
        assert dm.device(base) is None
        assert pool_usage(HOST, small.name, small.pool) == thin_pool_usage(tpool) == stacked
    finally:
        small.destroy()


def test_concurrent_calls_and_their_cost(vg: LoopVG) -> None:
    """Threads share nothing; each call opens and closes the control device."""
    name = thin_lv(vg, "dm-many")
    write_direct(f"/dev/mapper/{name}", 1)
    expected = thin_mapped_sectors(name)
    fds_before = len(os.listdir("/proc/self/fd"))
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda _: thin_mapped_sectors(name), range(200)))
    assert got == [expected] * 200
    assert len(os.listdir("/proc/self/fd")) == fds_before

    started = time.perf_counter()
    for _ in range(20):
        thin_mapped_sectors(name)
    ioctl = (time.perf_counter() - started) / 20
    started = time.perf_counter()
    dmsetup_status(name)
    process = time.perf_counter() - started
    print(f"thin status: ioctl {ioctl * 1e3:.2f} ms, dmsetup {process * 1e3:.0f} ms")
