"""Identity Probe: what "ready" means on a node with and without the volume group."""

from __future__ import annotations

import json
import logging
import tempfile

import pytest

from csi_local._gen import csi_pb2 as pb
from csi_local.config import Config
from csi_local.csi.identity_servicer import IdentityServicer
from csi_local.host.locks import Locks
from csi_local.volumes.pool import Pools
from tests.unit.conftest import FakeRunner

VG_MISSING = '  Volume group "vg0" not found\n  Cannot process volume group vg0\n'


def pool_report(attr: str) -> str:
    return json.dumps({"report": [{"lv": [{
        "lv_name": "pool", "vg_name": "vg0", "lv_size": "1711276032", "lv_tags": "",
        "lv_attr": attr, "pool_lv": "", "origin": "", "lv_path": "", "data_percent": "0.00",
        "metadata_percent": "11.04", "lv_time": "1795401089", "lv_health_status": "",
        "lv_kernel_major": "254", "lv_kernel_minor": "2"}]}]})


def identity(runner: FakeRunner, **config: object) -> IdentityServicer:
    cfg = Config(endpoint="unix:///run/x.sock", node_id="n1", volume_group="vg0",
                 thin_pool="pool", **config)  # type: ignore[arg-type]
    return IdentityServicer(cfg, Pools(cfg.classes, runner, Locks(tempfile.mkdtemp())))


def probe(ident: IdentityServicer) -> bool:
    reply = ident.Probe(pb.ProbeRequest(), None)  # type: ignore[arg-type]
    assert reply.HasField("ready")
    return reply.ready.value


def test_no_volume_group_is_ready_and_says_so(runner: FakeRunner,
                                              caplog: pytest.LogCaptureFixture) -> None:
    """A node without the VG must not fail its liveness probe forever."""
    runner.on(["lvs"], rc=5, stderr=VG_MISSING)
    ident = identity(runner)
    with caplog.at_level(logging.INFO, logger="csi_local.csi.identity_servicer"):
        assert probe(ident) is True
        assert probe(ident) is True
    lines = [r.getMessage() for r in caplog.records]
    # one line, at the change, naming the VG and what it means
    assert len(lines) == 1, lines
    assert "volume group vg0 not found" in lines[0] and "ready" in lines[0]
    assert caplog.records[0].levelno == logging.WARNING
    assert [c[0] for c in runner.calls] == ["lvs", "lvs"]  # one LVM command a probe


def test_capabilities_only_copy_is_ready_without_volume_group(runner: FakeRunner) -> None:
    """The plugin beside csi-resizer (--node-expansion-only, no host devices):
    csi-resizer waits for ready before it serves its health endpoint."""
    runner.on(["lvs"], rc=5, stderr=VG_MISSING)
    ident = identity(runner, node_expansion_only=True)
    ident.GetPluginInfo(pb.GetPluginInfoRequest(), None)  # type: ignore[arg-type]
    ident.GetPluginCapabilities(pb.GetPluginCapabilitiesRequest(), None)  # type: ignore[arg-type]
    assert runner.calls == []  # identity and capabilities need no LVM at all
    assert probe(ident) is True


def test_active_pool_is_ready(runner: FakeRunner, caplog: pytest.LogCaptureFixture) -> None:
    runner.on(["lvs"], stdout=pool_report("twi-aotz--"))
    with caplog.at_level(logging.INFO, logger="csi_local.csi.identity_servicer"):
        assert probe(identity(runner)) is True
    assert [r.getMessage() for r in caplog.records] == ["probe: ready"]
    # One `lvs` selecting the thin pool: no vgs, no report of every volume.
    (call,) = runner.calls
    assert call[0] == "lvs" and call[-1] == "vg0" and 'lv_name="pool"' in call


@pytest.mark.parametrize(("lvs", "why"), [
    ({"stdout": json.dumps({"report": [{"lv": []}]})}, "vg0/pool not found"),
    ({"stdout": pool_report("twi---tz--")}, "thin pool vg0/pool is not active"),
    ({"stdout": pool_report("-wi-a-----")}, "vg0/pool is not a thin pool"),
], ids=["pool-missing", "pool-inactive", "not-a-pool"])
def test_volume_group_without_a_usable_pool_is_not_ready(
        runner: FakeRunner, caplog: pytest.LogCaptureFixture, lvs: dict[str, object],
        why: str) -> None:
    """A storage node that is broken or still coming up stays not ready."""
    runner.on(["lvs"], **lvs)  # type: ignore[arg-type]
    with caplog.at_level(logging.INFO, logger="csi_local.csi.identity_servicer"):
        assert probe(identity(runner)) is False
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith("probe: not ready") and why in line


def test_lvm_failing_otherwise_is_not_ready(runner: FakeRunner) -> None:
    """Only a VG that LVM reports absent counts as "no VG here"."""
    runner.on(["lvs"], rc=5, stderr="  Device or resource busy\n")
    assert probe(identity(runner)) is False


def test_readiness_change_is_logged_again(runner: FakeRunner,
                                          caplog: pytest.LogCaptureFixture) -> None:
    runner.on(["lvs"], rc=5, stderr=VG_MISSING)
    ident = identity(runner)
    with caplog.at_level(logging.INFO, logger="csi_local.csi.identity_servicer"):
        probe(ident)
        runner.replies.clear()
        runner.on(["lvs"], stdout=pool_report("twi-aotz--"))
        probe(ident)
    assert [r.getMessage() for r in caplog.records][-1] == "probe: ready"
