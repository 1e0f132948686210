import tempfile

from csi_local.host import mounts
from csi_local.host.kernel import Kernel
from csi_local.host.locks import Locks
from csi_local.nodestate.recovery import rebuild_state
from csi_local.storage.lvm import Lvm
from csi_local.volumes.node_records import AccessType, Publish, Staging
from csi_local.volumes.pool import Pool, Pools
from tests.unit.conftest import FakeRunner

VOL = "csi-v-" + "a" * 32
BLK = "csi-v-" + "b" * 32
LVS = ('{"report": [{"lv": ['
       '{"lv_name":"pool","vg_name":"vg0","lv_size":"100","lv_tags":"","lv_attr":"twi-aotz--",'
       '"pool_lv":"","origin":"","lv_path":"","data_percent":"1.00","metadata_percent":"1.00",'
       '"lv_time":"1700000000","lv_health_status":"","lv_kernel_major":"253","lv_kernel_minor":"3"},'
       f'{{"lv_name":"{VOL}","vg_name":"vg0","lv_size":"100","lv_tags":"csi-local.kind=volume",'
       '"lv_attr":"Vwi-aotz--","pool_lv":"pool","origin":"","lv_path":"/dev/vg0/v",'
       '"data_percent":"1.00","metadata_percent":"","lv_time":"1700000000",'
       '"lv_health_status":"","lv_kernel_major":"253","lv_kernel_minor":"4"},'
       f'{{"lv_name":"{BLK}","vg_name":"vg0","lv_size":"100","lv_tags":"csi-local.kind=volume",'
       '"lv_attr":"Vwi-aotz--","pool_lv":"pool","origin":"","lv_path":"/dev/vg0/b",'
       '"data_percent":"1.00","metadata_percent":"","lv_time":"1700000000",'
       '"lv_health_status":"","lv_kernel_major":"253","lv_kernel_minor":"5"}'
       ']}]}')
TABLE = f"""\
22 1 0:21 / / rw - ext4 /dev/vda rw
41 22 253:4 / /k/staging/pv1 rw,noatime - xfs /dev/mapper/vg0-v rw
42 22 253:4 / /k/pods/x rw,noatime - xfs /dev/mapper/vg0-v rw
43 22 253:4 / /k/pods/y ro,noatime - xfs /dev/mapper/vg0-v rw
50 22 0:5 /dm-5 /k/blk/staging/{BLK} rw - devtmpfs udev rw
51 22 0:5 /dm-5 /k/blk/pods/z rw - devtmpfs udev rw
"""


class TableHost(Kernel):
    """The mount table above; /dev/dm-5 is the block volume's node."""

    def mounts(self) -> list[mounts.Mount]:
        return mounts.parse_mountinfo(TABLE)

    def device_numbers(self, path: str) -> tuple[int, int] | None:
        return (253, 5) if path == "/dev/dm-5" else None


def test_rebuild_from_mountinfo_and_lvm(runner: FakeRunner) -> None:
    runner.on(["lvs"], stdout=LVS)
    recs = rebuild_state(
        Pools.of(Pool(Lvm(runner, "vg0", "pool"), Locks(tempfile.mkdtemp()), 1.0)), TableHost())
    assert recs[VOL].staging == Staging("/k/staging/pv1", AccessType.MOUNT, "xfs",
                                        flags_known=False)
    assert recs[VOL].publishes == {"/k/pods/x": Publish(False, flags_known=False),
                                  "/k/pods/y": Publish(True, flags_known=False)}
    assert recs[BLK].staging == Staging("/k/blk/staging", AccessType.BLOCK)
    assert recs[BLK].publishes == {"/k/blk/pods/z": Publish(False, flags_known=False)}
