"""IO limits on the node (docs/qos.md): NodePublishVolume writes the volume's
limits into its workload's io.max, NodeUnpublishVolume lifts them, and the
reconcile round makes a changed limit hold; nothing about them ever fails a
mount. Over the fake host's cgroup hierarchy (tests/unit/fakes/cgroups.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from csi_local._gen import csi_pb2 as pb
from csi_local.errors import CgroupError
from csi_local.ops.metrics import Metrics
from csi_local.ops.status import collect_classes, render
from csi_local.volumes import qos
from csi_local.volumes import qos_enforcement as qe
from csi_local.volumes.lock_keys import volume_key
from csi_local.volumes.qos_enforcement import QosReconciler, Reason
from tests.unit import table
from tests.unit.fakehost import DM_MAJOR
from tests.unit.servicers import Node, call, make_node
from tests.unit.test_node import (
    V,
    expect_ok,
    node,
    publish,
    staged,
    unpublish,
    used,
)

UID = "5f0c3e2a-1b7d-4c8e-9a6f-2d4b8e1c7a90"
UID_ = UID.replace("-", "_")
ALLOC = "0b1f6a2c-4d3e-5f60-7182-93a4b5c6d7e8"
K8S_TARGET = f"pods/{UID}/volumes/kubernetes.io~csi/pv-1/mount"
K8S_TARGET2 = f"pods/{UID}/volumes/kubernetes.io~csi/pv-2/mount"
NOMAD_TARGET = f"per-alloc/{ALLOC}/data/rw-file-system-single-node-writer"
LIMITED = [f"{qos.TAG_PREFIX}rbps=1048576", f"{qos.TAG_PREFIX}wiops=100"]
LINE = {"rbps": "1048576", "wbps": "max", "riops": "max", "wiops": "100"}

SYSTEMD_BURSTABLE = (f"kubepods.slice/kubepods-burstable.slice/"
                     f"kubepods-burstable-pod{UID_}.slice")


def ready(n: Node, *, tags: list[str] = LIMITED) -> None:
    used(tags=tags)(n)
    staged()(n)


def device(n: Node) -> tuple[int, int]:
    lv = n.host.lv(V)
    return (DM_MAJOR, lv.minor)


@pytest.mark.parametrize("cgroup", [
    pytest.param(SYSTEMD_BURSTABLE, id="systemd-burstable"),
    pytest.param(f"kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{UID_}.slice",
                 id="systemd-besteffort"),
    pytest.param(f"kubepods.slice/kubepods-pod{UID_}.slice", id="systemd-guaranteed"),
    pytest.param(f"kubepods/burstable/pod{UID}", id="cgroupfs-burstable"),
    pytest.param(f"kubepods/besteffort/pod{UID}", id="cgroupfs-besteffort"),
    pytest.param(f"kubepods/pod{UID}", id="cgroupfs-guaranteed"),
])
def test_publish_limits_the_pod(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                cgroup: str) -> None:
    n = node(tmp_path, monkeypatch)
    ready(n)
    n.host.add_cgroup(cgroup)
    other = n.host.add_cgroup("kubepods.slice/kubepods-podother.slice")
    expect_ok(n.node.NodePublishVolume, publish(target=K8S_TARGET)(n))
    assert n.host.io_max(cgroup) == {device(n): LINE}
    assert n.host.io_max(other) == {}
    # Unpublished: lifted, the line gone as the kernel drops an all-max one.
    expect_ok(n.node.NodeUnpublishVolume, unpublish(target=K8S_TARGET)(n))
    assert n.host.io_max(cgroup) == {}


def test_publish_limits_every_task_of_the_allocation(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    n = node(tmp_path, monkeypatch)
    ready(n)
    web = n.host.add_cgroup(f"nomad.slice/share.slice/{ALLOC}.web.scope")
    db = n.host.add_cgroup(f"nomad.slice/reserve.slice/{ALLOC}.db.scope")
    stranger = n.host.add_cgroup("nomad.slice/share.slice/ffff.web.scope")
    expect_ok(n.node.NodePublishVolume, publish(target=NOMAD_TARGET)(n))
    assert n.host.io_max(web) == n.host.io_max(db) == {device(n): LINE}
    assert n.host.io_max(stranger) == {}


@pytest.mark.parametrize(("world", "reason", "says"), [
    pytest.param("v1", Reason.CGROUP_V1, "no cgroup v2 hierarchy", id="cgroup-v1"),
    pytest.param("no-cgroup", Reason.NO_CGROUP, f"no cgroup of pod {UID}", id="no-cgroup"),
    pytest.param("no-io", Reason.NO_IO_CONTROLLER, "no io controller", id="no-io-controller"),
    pytest.param("unknown-target", Reason.NO_WORKLOAD, "no known CO's workload",
                 id="unknown-target-shape"),
])
def test_unenforced_limits_never_fail_the_publish(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch, world: str,
                                                  reason: Reason, says: str) -> None:
    n = node(tmp_path, monkeypatch)
    counted: list[str] = []
    n.backend.qos.on_unenforced = counted.append
    ready(n)
    target = "target" if world == "unknown-target" else K8S_TARGET
    if world == "v1":
        n.host.cgroup_v2 = False
    if world == "no-io":
        n.host.add_cgroup(SYSTEMD_BURSTABLE, io=False)
    code, reply = call(n.node.NodePublishVolume, publish(target=target)(n))
    assert code == "OK", reply
    assert n.host.is_mount_point(str(n.root / target))
    [outcome] = n.backend.qos.last.values()
    assert (outcome.reason, counted) == (reason, [str(reason)])
    assert says in outcome.describe() and outcome.describe().startswith("not enforced")
    assert n.host.cgroup_writes == []


def test_a_write_the_kernel_refuses_never_fails_the_publish(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    n = node(tmp_path, monkeypatch)
    ready(n)
    n.host.add_cgroup(SYSTEMD_BURSTABLE)
    monkeypatch.setattr(n.host, "set_io_max", _refuse)
    code, reply = call(n.node.NodePublishVolume, publish(target=K8S_TARGET)(n))
    assert code == "OK", reply
    [outcome] = n.backend.qos.last.values()
    assert outcome.reason is Reason.WRITE_FAILED and "EINVAL" in outcome.describe()


def _refuse(cgroup: str, device: Any, keys: str) -> None:
    raise CgroupError(f"cannot write to {cgroup}/io.max: EINVAL")


def test_no_limits_no_write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    n = node(tmp_path, monkeypatch)
    ready(n, tags=[])
    n.host.add_cgroup(SYSTEMD_BURSTABLE)
    expect_ok(n.node.NodePublishVolume, publish(target=K8S_TARGET)(n))
    expect_ok(n.node.NodeUnpublishVolume, unpublish(target=K8S_TARGET)(n))
    assert n.host.cgroup_writes == []


def test_limits_stay_while_the_pod_has_another_publish(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    n = node(tmp_path, monkeypatch)
    ready(n)
    n.host.add_cgroup(SYSTEMD_BURSTABLE)
    expect_ok(n.node.NodePublishVolume, publish(target=K8S_TARGET)(n))
    expect_ok(n.node.NodePublishVolume, publish(target=K8S_TARGET2)(n))
    expect_ok(n.node.NodeUnpublishVolume, unpublish(target=K8S_TARGET)(n))
    assert n.host.io_max(SYSTEMD_BURSTABLE) == {device(n): LINE}
    expect_ok(n.node.NodeUnpublishVolume, unpublish(target=K8S_TARGET2)(n))
    assert n.host.io_max(SYSTEMD_BURSTABLE) == {}


def reconciler(n: Node) -> QosReconciler:
    return QosReconciler(n.backend.qos, n.backend.pools, n.backend.locks, n.state.all)


@pytest.mark.usefixtures("reads")  # on the committed metadata and on `lvs` alike
def test_a_modified_volume_converges_in_one_round(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    n = node(tmp_path, monkeypatch)
    ready(n)
    n.host.add_cgroup(SYSTEMD_BURSTABLE)
    expect_ok(n.node.NodePublishVolume, publish(target=K8S_TARGET)(n))
    expect_ok(n.controller.ControllerModifyVolume, pb.ControllerModifyVolumeRequest(
        volume_id=V, mutable_parameters={"readBps": "max", "writeBps": "2Mi"}))
    assert n.host.io_max(SYSTEMD_BURSTABLE) == {device(n): LINE}  # not yet
    n.host.calls.clear()
    assert reconciler(n).round() == 1
    assert n.host.io_max(SYSTEMD_BURSTABLE) == {
        device(n): {"rbps": "max", "wbps": str(2 << 20), "riops": "max", "wiops": "100"}}
    # The round's one read of LVM: the committed metadata off the PVs where
    # it answers, else one `lvs`.
    assert [c[0] for c in n.host.calls] == table.expected("(lvs)", n.host.pv_metadata)
    # Nothing changed: the next round writes nothing.
    writes = len(n.host.cgroup_writes)
    reconciler(n).round()
    assert len(n.host.cgroup_writes) == writes


def test_a_round_enforces_on_a_cgroup_that_came_late(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    n = node(tmp_path, monkeypatch)
    ready(n)
    expect_ok(n.node.NodePublishVolume, publish(target=K8S_TARGET)(n))
    assert not next(iter(n.backend.qos.last.values())).enforced
    n.host.add_cgroup(f"kubepods/burstable/pod{UID}")
    reconciler(n).round()
    assert n.host.io_max(f"kubepods/burstable/pod{UID}") == {device(n): LINE}
    assert next(iter(n.backend.qos.last.values())).enforced


def test_a_round_skips_a_volume_whose_lock_is_held(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    n = node(tmp_path, monkeypatch)
    ready(n)
    expect_ok(n.node.NodePublishVolume, publish(target=K8S_TARGET)(n))
    n.host.add_cgroup(SYSTEMD_BURSTABLE)
    with n.backend.locks.hold(_key(V)):
        assert reconciler(n).round() == 0
    assert n.host.io_max(SYSTEMD_BURSTABLE) == {}


def _key(vid: str) -> str:
    return volume_key(vid)


@pytest.mark.parametrize(("target", "want"), [
    (f"/var/lib/kubelet/pods/{UID}/volumes/kubernetes.io~csi/pv/mount", qe.Workload("pod", UID)),
    (f"/var/lib/kubelet/plugins/kubernetes.io/csi/volumeDevices/publish/pv/{UID}",
     qe.Workload("pod", UID)),
    (f"/opt/nomad/client/csi/node/csi-local/per-alloc/{ALLOC}/data/"
     "rw-file-system-single-node-writer", qe.Workload("allocation", ALLOC)),
    (f"/var/lib/kubelet/pods/{UID}/volumes/kubernetes.io~csi/pv/mount/sub", None),
    ("/mnt/anywhere", None),
])
def test_workload_of(target: str, want: qe.Workload | None) -> None:
    assert qe.workload_of(target) == want


def test_status_shows_configured_and_enforced_limits(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    n = make_node(tmp_path, monkeypatch)  # its state file written: status reads it
    ready(n)
    n.host.add_cgroup(SYSTEMD_BURSTABLE)
    expect_ok(n.node.NodePublishVolume, publish(target=K8S_TARGET)(n))
    expect_ok(n.node.NodePublishVolume, publish(target=NOMAD_TARGET)(n))  # no scope: not held
    got = collect_classes(n.host, n.backend.config.classes, n.backend.config.state_dir,
                          host=n.host, cgroups=n.host)
    (v,) = got.volumes
    assert v.io_limits == {"rbps": 1048576, "wiops": 100}
    by_target = {p.target.removeprefix(str(n.root) + "/"): p.io_limits for p in v.published}
    assert by_target == {K8S_TARGET: f"enforced on {SYSTEMD_BURSTABLE}",
                         NOMAD_TARGET: f"not enforced: no cgroup of allocation {ALLOC} under "
                                       "/sys/fs/cgroup"}
    text = render(got)
    assert "      IO limits: rbps=1048576, wiops=100" in text
    assert f"        IO limits enforced on {SYSTEMD_BURSTABLE}" in text
    # Status only reads: the limit a modify set is not written by it.
    writes = len(n.host.cgroup_writes)
    collect_classes(n.host, n.backend.config.classes, n.backend.config.state_dir,
                    host=n.host, cgroups=n.host)
    assert len(n.host.cgroup_writes) == writes


def test_metrics_show_configured_and_enforced_limits(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    n = node(tmp_path, monkeypatch)
    metrics = Metrics(node="node-1")
    n.backend.qos.on_unenforced = metrics.qos_unenforced
    metrics.watch_qos(n.backend.qos)
    ready(n)
    n.host.add_cgroup(SYSTEMD_BURSTABLE)
    expect_ok(n.node.NodePublishVolume, publish(target=K8S_TARGET)(n))
    expect_ok(n.node.NodePublishVolume, publish(target=NOMAD_TARGET)(n))
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in metrics.own.collect() for s in f.samples
               if "io_limit" in s.name or "qos" in s.name}
    k8s, nomad = str(n.root / K8S_TARGET), str(n.root / NOMAD_TARGET)
    assert samples[("csi_local_volume_io_limit", (("limit", "rbps"), ("volume_id", V)))] == \
        1048576
    assert samples[("csi_local_volume_io_limit", (("limit", "wiops"), ("volume_id", V)))] == 100
    assert ("csi_local_volume_io_limit", (("limit", "wbps"), ("volume_id", V))) not in samples
    assert samples[("csi_local_volume_io_limit_enforced",
                    (("target", k8s), ("volume_id", V)))] == 1
    assert samples[("csi_local_volume_io_limit_enforced",
                    (("target", nomad), ("volume_id", V)))] == 0
    assert samples[("csi_local_qos_unenforced_total", (("reason", "no_cgroup"),))] == 1
    assert samples[("csi_local_qos_unenforced_total", (("reason", "cgroup_v1"),))] == 0
