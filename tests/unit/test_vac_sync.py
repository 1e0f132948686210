"""`csi-local vac-sync` (csi/vac_sync.py): a fake API server's PVs and
VolumeAttributesClasses, carried to the node plugin by ControllerModifyVolume,
here the node servicer's own over the fake host; what changes is the LV's tags."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from csi_local._gen import csi_pb2 as pb
from csi_local.csi.vac_sync import VAC_PATHS, Modify, VacSync
from csi_local.volumes import qos
from tests.unit.servicers import Node, call, make_node
from tests.unit.test_controller import V2, V, add_volume

DRIVER = "lvm.csi-local.dev"
OTHER_NODES = "csi-v-" + "0" * 32


class FakeApi:
    def __init__(self, pvs: list[dict[str, Any]], classes: dict[str, dict[str, str]],
                 version: str = "v1") -> None:
        self.pvs, self.classes, self.version = pvs, classes, version

    def get(self, path: str) -> dict[str, Any] | None:
        if path == "/api/v1/persistentvolumes":
            return {"items": self.pvs}
        prefix = {"v1": VAC_PATHS[0], "v1beta1": VAC_PATHS[1]}[self.version] + "/"
        name = path.removeprefix(prefix)
        if path.startswith(prefix) and name in self.classes:
            return {"parameters": self.classes[name]}
        return None


def pv(volume_id: str, vac: str | None, driver: str = DRIVER) -> dict[str, Any]:
    spec: dict[str, Any] = {"csi": {"driver": driver, "volumeHandle": volume_id}}
    if vac:
        spec["volumeAttributesClassName"] = vac
    return {"metadata": {"name": f"pv-{volume_id[-4:]}"}, "spec": spec}


def tags(n: Node, vid: str) -> set[str]:
    return {t.removeprefix(qos.TAG_PREFIX) for t in n.host.lvs[vid].tags
            if t.startswith(qos.TAG_PREFIX)}


def through(n: Node) -> Modify:
    """ControllerModifyVolume of the node's plugin, answered as on the wire."""
    def modify(volume_id: str, parameters: Mapping[str, str]) -> tuple[str, str]:
        code, answer = call(n.controller.ControllerModifyVolume,
                            pb.ControllerModifyVolumeRequest(
                                volume_id=volume_id, mutable_parameters=dict(parameters)))
        return code, "" if code == "OK" else str(answer)
    return modify


@pytest.fixture
def n(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Node:
    return make_node(tmp_path, monkeypatch)


@pytest.mark.parametrize("version", ["v1", "v1beta1"])
def test_a_pvs_class_reaches_the_volumes_tags(n: Node, version: str) -> None:
    add_volume(n, V, tags=[f"{qos.TAG_PREFIX}wbps=9"])
    api = FakeApi([pv(V, "gold"), pv(OTHER_NODES, "gold")],
                  {"gold": {"readIops": "300", "writeBps": "max"}}, version)
    sync = VacSync(api, DRIVER, through(n))
    assert sync.round() == [V]  # another node's volume: NOT_FOUND here, left
    assert tags(n, V) == {"riops=300"}
    n.host.calls.clear()
    assert sync.round() == [V]
    assert "lvchange" not in {c[0] for c in n.host.calls}  # the same: nothing changed


def test_what_names_no_class_or_is_another_drivers_is_left(n: Node) -> None:
    add_volume(n, V)
    add_volume(n, V2)
    asked: list[str] = []

    def modify(volume_id: str, parameters: Mapping[str, str]) -> tuple[str, str]:
        asked.append(volume_id)
        return "OK", ""

    api = FakeApi([pv(V, None), pv(V2, "gold", driver="other.example")],
                  {"gold": {"readIops": "1"}})
    assert VacSync(api, DRIVER, modify).round() == []
    assert asked == []


@pytest.mark.parametrize(("classes", "why"), [
    pytest.param({}, "missing class", id="missing-class"),
    pytest.param({"gold": {"readIops": "fast"}}, "bad value: INVALID_ARGUMENT",
                 id="bad-value"),
    pytest.param({"gold": {"size": "1"}}, "unknown key: INVALID_ARGUMENT", id="unknown-key"),
])
def test_a_class_that_cannot_apply_changes_nothing(n: Node, classes: dict[str, dict[str, str]],
                                                   why: str) -> None:
    add_volume(n, V, tags=[f"{qos.TAG_PREFIX}riops=5"])
    api = FakeApi([pv(V, "gold")], classes)
    assert VacSync(api, DRIVER, through(n)).round() == [], why
    assert tags(n, V) == {"riops=5"}
