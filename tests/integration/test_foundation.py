"""The ground everything stands on: LVM, mkfs and mount in the real kernel,
and the Identity service over the unix socket."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from csi_local import __version__
from csi_local._gen import csi_pb2 as pb
from csi_local.host import mounts
from csi_local.host.filesystems import Filesystems
from csi_local.host.kernel import Kernel
from csi_local.host.runner import ProcessRunner
from csi_local.storage.lvm import Lvm
from csi_local.volumes.sizes import round_up
from tests.integration.conftest import LoopVG, PluginProcess, make_vg

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("fs_type", ["ext4", "xfs"])
def test_thin_lv_filesystem_roundtrip(vg: LoopVG, tmp_path_factory: pytest.TempPathFactory,
                                      fs_type: str) -> None:
    runner = ProcessRunner(timeout=60)
    lvm = Lvm(runner, vg.name, vg.pool)
    fs = Filesystems(runner, Kernel())
    extent = lvm.volume_group().extent_size
    size = round_up(320 << 20, extent)  # mkfs.xfs refuses < 300 MiB
    lv = lvm.create_thin(f"found-{fs_type}", size, ["csi-local.kind=test"])
    assert lv.size == size and lv.active and lv.is_thin_volume
    assert "csi-local.kind=test" in lv.tags
    assert fs.probe(lv.path) == (None, False)
    fs.mkfs(lv.path, fs_type)
    assert fs.probe(lv.path) == (fs_type, False)
    target = f"/run/csi-local-tests/found-{fs_type}"
    os.makedirs(target, exist_ok=True)
    fs.mount(lv.path, target, fs_type, ["noatime"])
    try:
        top = mounts.top_mount(target)
        assert top is not None and top.fs_type == fs_type and "noatime" in top.options
        payload = os.urandom(1 << 20)
        with open(f"{target}/data", "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        fs.umount(target)
        assert not mounts.is_mount_point(target)
        fs.mount(lv.path, target, fs_type, [])
        with open(f"{target}/data", "rb") as f:
            assert f.read() == payload
    finally:
        fs.umount(target)
    assert lvm.remove(lv.name) is True
    assert lvm.remove(lv.name) is False
    assert lvm.find(lv.name) is None


def test_identity_over_socket(plugin: PluginProcess) -> None:
    info = plugin.identity.GetPluginInfo(pb.GetPluginInfoRequest())
    assert info.name == "lvm.csi-local.dev"
    assert info.vendor_version == __version__
    caps = plugin.identity.GetPluginCapabilities(pb.GetPluginCapabilitiesRequest())
    services = {c.service.type for c in caps.capabilities if c.HasField("service")}
    assert pb.PluginCapability.Service.CONTROLLER_SERVICE in services
    assert pb.PluginCapability.Service.VOLUME_ACCESSIBILITY_CONSTRAINTS in services
    probe = plugin.identity.Probe(pb.ProbeRequest())
    assert probe.HasField("ready") and probe.ready.value is True


def test_probe_not_ready_without_pool(plugin_factory: object) -> None:
    other = make_vg(size=256 << 20)
    try:
        subprocess.run(["lvremove", "--yes", f"{other.name}/pool"], check=True,
                       capture_output=True)
        p = plugin_factory(target_vg=other)  # type: ignore[operator]
        probe = p.identity.Probe(pb.ProbeRequest())
        assert probe.ready.value is False
        p.stop()
        assert "not ready" in p.log() and f"{other.name}/pool not found" in p.log()
    finally:
        other.destroy()


def test_second_server_refused_and_stale_socket_replaced(plugin: PluginProcess) -> None:
    proc = subprocess.run(plugin.argv(), capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "already listening" in proc.stderr
    # SIGKILL leaves the socket file behind; a new server replaces it.
    plugin.kill()
    assert os.path.exists(plugin.socket)
    plugin.start()
    assert plugin.identity.Probe(pb.ProbeRequest()).ready.value


def test_sigterm_lets_inflight_rpc_finish(plugin: PluginProcess) -> None:
    import threading

    results: list[object] = []

    def slow_call() -> None:
        # A burst of probes: each runs lvm; SIGTERM arrives in the middle.
        for _ in range(3):
            results.append(plugin.identity.Probe(pb.ProbeRequest(), timeout=60).ready.value)

    t = threading.Thread(target=slow_call)
    t.start()
    assert plugin.proc is not None
    while not results:
        pass
    rc = plugin.stop()
    t.join()
    assert rc == 0
    assert results[0] is True
    assert not os.path.exists(plugin.socket)


def test_cli_version_and_module_entry() -> None:
    out = subprocess.run([sys.executable, "-m", "csi_local", "--version"],
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == f"csi-local {__version__}"


def test_probe_command(plugin: PluginProcess) -> None:
    out = subprocess.run([sys.executable, "-m", "csi_local", "probe", "--endpoint",
                          plugin.endpoint], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == '{"ready": true}'
