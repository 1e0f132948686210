"""scripts/uninstall-kubernetes against a stand-in kubectl that answers from
a little cluster state and records every call: the order (volumes and
snapshots gone before the DaemonSet), nothing removed while they remain, and
the leftovers (CSIStorageCapacity, node labels, kubelet plugin files)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from tests.deploy._deploy import DRIVER, K8S_DIR, REPO

SCRIPT = REPO / "scripts" / "uninstall-kubernetes"

# A kubectl that answers `get` from state.json and logs every argv; after
# `vanish_after` calls listing PVs the volumes are gone (as if their PVCs'
# deletion finished).
FAKE = r'''#!/usr/bin/env python3
import json, os, sys
state_path = os.environ["FAKE_STATE"]
state = json.load(open(state_path))
args = sys.argv[1:]
with open(os.environ["FAKE_LOG"], "a") as log:
    log.write(json.dumps(args) + "\n")
def items(kind):
    return state.get(kind, [])
if args[:2] == ["get", "persistentvolumes"]:
    state["pv_lists"] = state.get("pv_lists", 0) + 1
    if state["pv_lists"] > state.get("vanish_after", 0):
        state["persistentvolumes"] = []
        state["volumesnapshotcontents"] = []
    json.dump(state, open(state_path, "w"))
    for driver, name in items("persistentvolumes"):
        print(f"{driver} persistentvolume/{name}")
elif args[:2] == ["get", "crd"]:
    sys.exit(0 if state.get("snapshot_crd", True) else 1)
elif args[:2] == ["get", "volumesnapshotcontents"]:
    for driver, name in items("volumesnapshotcontents"):
        print(f"{driver} volumesnapshotcontent/{name}")
elif args[:2] == ["get", "nodes"]:
    for name in items("nodes"):
        print(name)
'''


def run(tmp_path: Path, state: dict[str, object], *args: str,
        timeout: int = 60) -> tuple[subprocess.CompletedProcess[str], list[list[str]]]:
    fake = tmp_path / "kubectl"
    fake.write_text(FAKE)
    fake.chmod(0o755)
    (tmp_path / "state.json").write_text(json.dumps(state))
    log = tmp_path / "log"
    log.write_text("")
    env = {**os.environ, "KUBECTL": str(fake), "FAKE_STATE": str(tmp_path / "state.json"),
           "FAKE_LOG": str(log)}
    r = subprocess.run([str(SCRIPT), *args], capture_output=True, text=True, env=env,
                       timeout=timeout, check=False)
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    return r, calls


def _verbs(calls: list[list[str]]) -> list[str]:
    return [" ".join(c[:2]) for c in calls]


def test_waits_for_volumes_and_snapshots_then_removes_everything(tmp_path: Path) -> None:
    state = {"persistentvolumes": [[DRIVER, "pvc-1"], ["other.csi", "pvc-x"]],
             "volumesnapshotcontents": [[DRIVER, "snapcontent-1"]],
             "nodes": ["node-a", "node-b"], "vanish_after": 1}
    r, calls = run(tmp_path, state, "--clean-nodes", "busybox:1.36")
    assert r.returncode == 0, r.stderr
    verbs = _verbs(calls)
    # listed until gone, and only then anything deleted
    first_delete = verbs.index("delete -k")
    assert verbs[:first_delete].count("get persistentvolumes") == 2
    assert all(v.startswith("get ") for v in verbs[:first_delete])
    assert calls[first_delete][2] == str(K8S_DIR)
    assert "delete csistoragecapacities" in verbs[first_delete:]
    (cap,) = [c for c in calls if c[:2] == ["delete", "csistoragecapacities"]]
    assert f"csi.storage.k8s.io/drivername={DRIVER}" in cap
    (label,) = [c for c in calls if c[:2] == ["label", "nodes"]]
    assert {"lvm.csi-local.dev/storage-node-", "topology.lvm.csi-local.dev/node-"} <= set(label)
    debugs = [c for c in calls if c[0] == "debug"]
    assert [c[1] for c in debugs] == ["node/node-a", "node/node-b"]
    for c in debugs:
        assert c[c.index("--") + 1:] == [
            "rm", "-rf", f"/host/var/lib/kubelet/plugins/{DRIVER}",
            f"/host/var/lib/kubelet/plugins_registry/{DRIVER}-reg.sock"]


def test_removes_nothing_while_volumes_remain(tmp_path: Path) -> None:
    state = {"persistentvolumes": [[DRIVER, "pvc-1"]], "volumesnapshotcontents": [],
             "nodes": ["node-a"], "vanish_after": 10**6}
    r, calls = run(tmp_path, state, "--timeout", "0")
    assert r.returncode == 1
    assert "persistentvolume/pvc-1" in r.stderr and "nothing was removed" in r.stderr
    assert all(c[0] == "get" for c in calls), calls


def test_without_clean_nodes_prints_the_node_commands(tmp_path: Path) -> None:
    state = {"nodes": ["node-a"], "snapshot_crd": False}
    r, calls = run(tmp_path, state)
    assert r.returncode == 0, r.stderr
    assert f"rm -rf /var/lib/kubelet/plugins/{DRIVER}" in r.stdout
    assert not any(c[0] == "debug" for c in calls)
    assert "get volumesnapshotcontents" not in _verbs(calls)  # no CRD, no contents


def test_the_docs_use_the_script() -> None:
    docs = (REPO / "docs" / "kubernetes.md").read_text()
    uninstall = docs.split("## Uninstall", 1)[1]
    assert "scripts/uninstall-kubernetes" in uninstall
    assert "kubectl delete -k" not in uninstall.split("```", 2)[1]
