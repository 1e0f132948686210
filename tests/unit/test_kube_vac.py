"""The node's reading of its PVs' VolumeAttributesClasses (csi/kube_vac.py):
a fake API server's PVs and classes, the node's own volumes over the fake
host; what changes is the LV's tags, as ControllerModifyVolume changes them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from csi_local.csi.kube_vac import VAC_PATHS, VacSync
from csi_local.volumes import qos
from tests.unit.servicers import Node, make_node
from tests.unit.test_controller import V2, V, add_volume

DRIVER = "lvm.csi-local.dev"


class FakeApi:
    def __init__(self, pvs: list[dict[str, Any]], classes: dict[str, dict[str, str]],
                 version: str = "v1") -> None:
        self.pvs, self.classes, self.version = pvs, classes, version
        self.paths: list[str] = []

    def get(self, path: str) -> dict[str, Any] | None:
        self.paths.append(path)
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


@pytest.fixture
def n(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Node:
    node = make_node(tmp_path, monkeypatch)
    # The fake host has no committed metadata: what it would find, `lvs` finds.
    monkeypatch.setattr(node.backend.pools, "find_committed", node.backend.pools.find)
    return node


@pytest.mark.parametrize("version", ["v1", "v1beta1"])
def test_a_pvs_class_is_applied_once(n: Node, version: str) -> None:
    add_volume(n, V, tags=[f"{qos.TAG_PREFIX}wbps=9"])
    api = FakeApi([pv(V, "gold")], {"gold": {"readIops": "300", "writeBps": "max"}}, version)
    sync = VacSync(api, DRIVER, n.backend.pools, n.controller.volumes)
    assert sync.round() == [V]
    assert tags(n, V) == {"riops=300"}
    n.host.calls.clear()
    assert sync.round() == []  # the same: no lvchange
    assert "lvchange" not in {c[0] for c in n.host.calls}


def test_what_is_not_this_nodes_or_names_no_class_is_left(n: Node) -> None:
    add_volume(n, V)
    add_volume(n, V2)
    api = FakeApi([pv(V, None), pv(V2, "gold", driver="other.example"),
                   pv("csi-v-" + "0" * 32, "gold")], {"gold": {"readIops": "1"}})
    assert VacSync(api, DRIVER, n.backend.pools, n.controller.volumes).round() == []
    assert tags(n, V) == tags(n, V2) == set()


@pytest.mark.parametrize(("classes", "why"), [
    pytest.param({}, "missing class", id="missing-class"),
    pytest.param({"gold": {"readIops": "fast"}}, "bad value", id="bad-value"),
])
def test_a_class_that_cannot_apply_changes_nothing(n: Node, classes: dict[str, dict[str, str]],
                                                   why: str) -> None:
    add_volume(n, V, tags=[f"{qos.TAG_PREFIX}riops=5"])
    api = FakeApi([pv(V, "gold")], classes)
    assert VacSync(api, DRIVER, n.backend.pools, n.controller.volumes).round() == [], why
    assert tags(n, V) == {"riops=5"}
