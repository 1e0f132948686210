"""kill -9 of the plugin at each step of a volume's life, then a retry that
converges, with nothing leaked: no stray LV, mount or state entry."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import grpc
import pytest

from csi_local._gen import csi_pb2 as pb
from csi_local.host import mounts
from tests.integration.conftest import LoopVG, PluginProcess, mount_cap

pytestmark = pytest.mark.integration
MiB = 1 << 20


def kill_during(plugin: PluginProcess, method: str, call: Callable[[], Any], delay: float) -> None:
    """Start `call`, SIGKILL the plugin `delay` s after it logs the request
    arriving, and restart it."""
    mark = len(plugin.log())
    fut = call()
    deadline = time.monotonic() + 120
    while f"{method} request" not in plugin.log()[mark:]:
        if time.monotonic() > deadline:
            raise AssertionError(f"{method} never reached the plugin")
        if fut.done():
            break
        time.sleep(0.01)
    time.sleep(delay)
    plugin.kill()
    try:
        fut.result()
    except grpc.RpcError:
        pass
    plugin.start()


def state_volumes(p: PluginProcess) -> dict[str, Any]:
    path = p.state_dir / "state.json"
    if not path.exists():
        return {}
    volumes: dict[str, Any] = json.loads(path.read_text())["volumes"]
    return volumes


@pytest.mark.parametrize("delay", [0.0, 0.3, 1.0])
def test_kill_at_every_step_then_retry_converges(plugin: PluginProcess, vg: LoopVG,
                                                 delay: float) -> None:
    name = f"crash-{int(delay * 10)}"
    cap = mount_cap()
    staging, target = plugin.path(f"s-{name}"), plugin.path(f"t-{name}")
    create_req = pb.CreateVolumeRequest(name=name, volume_capabilities=[cap],
                                        capacity_range=pb.CapacityRange(required_bytes=32 * MiB))

    kill_during(plugin, "CreateVolume",
                lambda: plugin.controller.CreateVolume.future(create_req), delay)
    vid = plugin.controller.CreateVolume(create_req).volume.volume_id
    assert vg.lv_names() == [vid]

    stage_req = pb.NodeStageVolumeRequest(volume_id=vid, staging_target_path=staging,
                                          volume_capability=cap)
    kill_during(plugin, "NodeStageVolume",
                lambda: plugin.node.NodeStageVolume.future(stage_req), delay)
    plugin.node.NodeStageVolume(stage_req)
    assert len(mounts.mounts_at(staging)) == 1
    with open(f"{staging}/data", "w") as f:
        f.write(name)

    pub_req = pb.NodePublishVolumeRequest(volume_id=vid, staging_target_path=staging,
                                          target_path=target, volume_capability=cap)
    kill_during(plugin, "NodePublishVolume",
                lambda: plugin.node.NodePublishVolume.future(pub_req), delay)
    plugin.node.NodePublishVolume(pub_req)
    assert len(mounts.mounts_at(target)) == 1
    assert open(f"{target}/data").read() == name
    assert list(state_volumes(plugin)[vid]["publishes"]) == [target]

    unpub_req = pb.NodeUnpublishVolumeRequest(volume_id=vid, target_path=target)
    kill_during(plugin, "NodeUnpublishVolume",
                lambda: plugin.node.NodeUnpublishVolume.future(unpub_req), delay)
    plugin.node.NodeUnpublishVolume(unpub_req)
    assert not mounts.is_mount_point(target)

    unstage_req = pb.NodeUnstageVolumeRequest(volume_id=vid, staging_target_path=staging)
    kill_during(plugin, "NodeUnstageVolume",
                lambda: plugin.node.NodeUnstageVolume.future(unstage_req), delay)
    plugin.node.NodeUnstageVolume(unstage_req)
    assert not mounts.is_mount_point(staging)
    assert state_volumes(plugin) == {}

    delete_req = pb.DeleteVolumeRequest(volume_id=vid)
    kill_during(plugin, "DeleteVolume",
                lambda: plugin.controller.DeleteVolume.future(delete_req), delay)
    plugin.controller.DeleteVolume(delete_req)
    assert vg.lv_names() == []
    prefix = str(plugin.workdir) + "/"
    assert not [m for m in mounts.read_mounts() if m.mount_point.startswith(prefix)]
    assert not [p for p in plugin.state_dir.iterdir() if ".tmp." in p.name]
