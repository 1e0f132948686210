"""IO limits (docs/qos.md), the controller's part: the parameters that set them
at CreateVolume (StorageClass parameters, a VolumeAttributesClass's
mutable_parameters, the device class's default), ControllerModifyVolume, and
the tags that keep them. Rows over the fake host, run by the one table kit."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from csi_local._gen import csi_pb2 as pb
from csi_local.storage.lvm import LogicalVolume
from csi_local.volumes import qos
from csi_local.volumes.lock_keys import volume_key
from tests.unit.servicers import GiB, Node, make_class_node, make_node
from tests.unit.table import Case, row
from tests.unit.test_controller import KIND_V, NEW, TABLE, V, cv, plain_lv, vol

# Every test twice: reading the committed metadata, and every read an `lvs`.
pytestmark = pytest.mark.usefixtures("reads")

MB = 10**6


def qos_tags(n: Node, vid: str) -> set[str]:
    return {t for t in n.host.lvs[vid].tags if t.startswith(qos.TAG_PREFIX)}


def tagged(vid: str, *want: str) -> Any:
    """A check: the LV `vid` carries exactly these QoS tags."""
    def check(n: Node, reply: Any) -> None:
        assert qos_tags(n, vid) == {qos.TAG_PREFIX + t for t in want}
    return check


def limited(**tags: int) -> Any:
    """A setup: volume V, with these QoS tags (io.max keys)."""
    return vol(tags=[f"{qos.TAG_PREFIX}{k}={v}" for k, v in tags.items()])


def create(params: dict[str, str] | None = None,
           mutable: dict[str, str] | None = None) -> pb.CreateVolumeRequest:
    req = cv(params=params)
    req.mutable_parameters.update(mutable or {})
    return req


def modify(vid: str = V, **mutable: str) -> pb.ControllerModifyVolumeRequest:
    return pb.ControllerModifyVolumeRequest(volume_id=vid, mutable_parameters=mutable)


CREATE = [
    row("no-limits", create(), "OK", ran="(lvs) lvcreate", changes="lvs", check=tagged(NEW)),
    row("storage-class-limits",
        create({"readBps": "100Mi", "writeBps": "50M", "readIops": "1000", "writeIops": "200"}),
        "OK", ran="(lvs) lvcreate", changes="lvs",
        check=tagged(NEW, f"rbps={100 << 20}", f"wbps={50 * MB}", "riops=1000", "wiops=200")),
    row("mutable-parameters-win", create({"readIops": "1000"}, {"readIops": "10"}), "OK",
        ran="(lvs) lvcreate", changes="lvs", check=tagged(NEW, "riops=10")),
    row("mutable-max-lifts-storage-class-limit", create({"readIops": "1000"}, {"readIops": "max"}),
        "OK", ran="(lvs) lvcreate", changes="lvs", check=tagged(NEW)),
    row("bad-value", create({"writeBps": "fast"}), "INVALID_ARGUMENT",
        "parameter 'writeBps' must be a whole number of bytes per second"),
    row("zero", create({"readBps": "0"}), "INVALID_ARGUMENT",
        "parameter 'readBps' must be at least 1"),
    row("iops-with-suffix", create({"readIops": "1k"}), "INVALID_ARGUMENT",
        "parameter 'readIops' must be a whole number of operations per second"),
    row("too-large", create({"readBps": "99999999999999999999T"}), "INVALID_ARGUMENT",
        "parameter 'readBps' must be at least 1 and at most"),
    row("bad-mutable-value", create(mutable={"readIops": "-1"}), "INVALID_ARGUMENT",
        "parameter 'readIops'"),
    row("unknown-mutable-parameter", create(mutable={"deviceClass": "fast"}), "INVALID_ARGUMENT",
        "unknown mutable parameter 'deviceClass'"),
    row("unknown-parameter", create({"readBPS": "1"}), "INVALID_ARGUMENT",
        "unknown parameter 'readBPS'"),
]


@pytest.mark.parametrize("case", CREATE)
def test_create_volume_limits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                              case: Case) -> None:
    n = make_node(tmp_path, monkeypatch, **case.world)
    TABLE.run(n, case, "CreateVolume")


MODIFY = [
    row("sets-limits", modify(readBps="1Gi", writeIops="500"), "OK", setup=vol(),
        ran="(lvs) lvchange", changes="lvs", check=tagged(V, f"rbps={GiB}", "wiops=500")),
    row("keeps-what-it-does-not-name", modify(readIops="7"), "OK",
        setup=limited(rbps=5, wiops=9), ran="(lvs) lvchange", changes="lvs",
        check=tagged(V, "rbps=5", "riops=7", "wiops=9")),
    row("replaces-a-limit", modify(readBps="6"), "OK",
        setup=limited(rbps=5), ran="(lvs) lvchange", changes="lvs", check=tagged(V, "rbps=6")),
    row("max-lifts-a-limit", modify(readBps="max"), "OK", setup=limited(rbps=5, wbps=8),
        ran="(lvs) lvchange", changes="lvs", check=tagged(V, "wbps=8")),
    row("same-limits-no-lvchange", modify(readBps="5"), "OK", setup=limited(rbps=5),
        ran="(lvs)", check=tagged(V, "rbps=5")),
    row("nothing-asked", modify(), "OK", setup=limited(rbps=5), ran="(lvs)",
        check=tagged(V, "rbps=5")),
    row("missing-id", modify(""), "INVALID_ARGUMENT", "volume_id is required"),
    row("malformed-id", modify("a/b"), "INVALID_ARGUMENT", "not a valid ID"),
    row("unknown-mutable-parameter", modify(size="1"), "INVALID_ARGUMENT",
        "unknown mutable parameter 'size'", setup=vol()),
    row("co-key-refused", pb.ControllerModifyVolumeRequest(
        volume_id=V, mutable_parameters={"csi.storage.k8s.io/pvc/name": "x"}),
        "INVALID_ARGUMENT", "unknown mutable parameter", setup=vol()),
    row("bad-value", modify(writeBps="1.5G"), "INVALID_ARGUMENT", "parameter 'writeBps'",
        setup=vol()),
    row("missing", modify(readBps="1"), "NOT_FOUND", f"volume '{V}' not found", ran="lvs"),
    row("not-a-csi-volume", modify(readBps="1"), "NOT_FOUND", "not found", setup=plain_lv(V),
        ran="lvs"),
    row("newer-format", modify(readBps="1"), "FAILED_PRECONDITION", "format",
        setup=vol(tags=["csi-local.format=99"]), ran="(lvs)"),
    row("busy", modify(readBps="1"), "ABORTED", "already in progress", setup=vol(),
        busy=volume_key(V)),
    row("validate-only", modify(readBps="1"), "OK", setup=vol(), ran="",
        check=tagged(V), modify_validate_only=True),
    row("validate-only-still-refuses", modify(size="1"), "INVALID_ARGUMENT",
        "unknown mutable parameter", setup=vol(), modify_validate_only=True),
]


@pytest.mark.parametrize("case", MODIFY)
def test_controller_modify_volume(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                  case: Case) -> None:
    n = make_node(tmp_path, monkeypatch, **case.world)
    TABLE.run(n, case, "ControllerModifyVolume")


CLASS_WITH_LIMITS = """\
[classes.slow]
volume_group = "vg0"
thin_pool = "pool0"

[classes.slow.qos]
read_bps = "10Mi"
write_iops = 100
"""


@pytest.mark.parametrize(("params", "want"), [
    pytest.param({}, {f"rbps={10 << 20}", "wiops=100"}, id="class-default"),
    pytest.param({"writeIops": "5"}, {f"rbps={10 << 20}", "wiops=5"}, id="request-overrides"),
    pytest.param({"readBps": "max"}, {"wiops=100"}, id="request-lifts"),
])
def test_class_default_limits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                              params: dict[str, str], want: set[str]) -> None:
    n = make_class_node(tmp_path, monkeypatch, CLASS_WITH_LIMITS)
    code, reply = TABLE.send(n, "CreateVolume", create(params))
    assert code == "OK", reply
    assert qos_tags(n, NEW) == {qos.TAG_PREFIX + t for t in want}
    assert KIND_V in n.host.lvs[NEW].tags


def test_limits_round_trip() -> None:
    limits = qos.Limits(rbps=1, wbps=None, riops=3, wiops=None)
    assert qos.limits_of(_lv(qos.tags_of(limits))) == limits
    assert limits.io_max() == "rbps=1 wbps=max riops=3 wiops=max"


def test_malformed_tag_is_no_limit() -> None:
    assert qos.limits_of(_lv([f"{qos.TAG_PREFIX}rbps=fast", f"{qos.TAG_PREFIX}wbps=0"])) == \
        qos.NO_LIMITS


def _lv(tags: list[str]) -> LogicalVolume:
    return LogicalVolume(name="x", vg="vg", size=GiB, tags=frozenset(tags), attr="Vwi-a-tz--",
                         pool="p", origin="", path="/dev/vg/x", data_percent=None,
                         metadata_percent=None, created=0, health="", kernel_major=253,
                         kernel_minor=1)
