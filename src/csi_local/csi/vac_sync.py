"""`csi-local vac-sync`: Kubernetes VolumeAttributesClasses carried to the
node's volumes (docs/qos.md, "Kubernetes").

external-resizer calls ControllerModifyVolume from its central Deployment,
whose plugin copy reaches no node's LVM: that copy validates the class's
parameters and answers OK (--modify-validate-only), and the resizer records
the class on the PV (`spec.volumeAttributesClassName`). This command runs
beside each node plugin, in a container of its own: every --interval seconds
it lists the PVs of its driver that name a class, reads the class, and calls
ControllerModifyVolume with the class's parameters on the node plugin's
socket. The node plugin answers NOT_FOUND for another node's volume, and
changes nothing (no process) where the tags already say the same; its QoS
reconcile then carries a change into io.max.

The API is read (get and list, nothing written) with the ServiceAccount
token of this command's container, an unprivileged one: the privileged
plugin container holds no token.
"""

from __future__ import annotations

import json
import logging
import os
import ssl
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from typing import Any, Protocol

log = logging.getLogger(__name__)

ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
# storage.k8s.io/v1 since Kubernetes 1.34, v1beta1 from 1.31: the first that answers.
VAC_PATHS = ("/apis/storage.k8s.io/v1/volumeattributesclasses",
             "/apis/storage.k8s.io/v1beta1/volumeattributesclasses")


class Api(Protocol):
    def get(self, path: str) -> dict[str, Any] | None: ...


class InClusterApi:
    """GET on the API server with the container's ServiceAccount; None for 404."""

    def __init__(self, host: str, port: str, directory: str = ACCOUNT_DIR,
                 timeout: float = 10.0) -> None:
        self.base = f"https://{host}:{port}"
        self.directory = directory
        self.timeout = timeout
        self.context = ssl.create_default_context(cafile=os.path.join(directory, "ca.crt"))

    @classmethod
    def from_environment(cls) -> InClusterApi:
        host = os.environ.get("KUBERNETES_SERVICE_HOST")
        if not host:
            raise RuntimeError("not in a Kubernetes pod: KUBERNETES_SERVICE_HOST is not set")
        return cls(host, os.environ.get("KUBERNETES_SERVICE_PORT", "443"))

    def get(self, path: str) -> dict[str, Any] | None:
        # Read at each call: kubelet rotates the token.
        with open(os.path.join(self.directory, "token"), encoding="ascii") as f:
            token = f.read().strip()
        request = urllib.request.Request(self.base + path, headers={  # noqa: S310 (https)
            "Authorization": f"Bearer {token}", "Accept": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout,  # noqa: S310 (https)
                                        context=self.context) as reply:
                answer: dict[str, Any] = json.load(reply)
                return answer
        except urllib.error.HTTPError as err:
            if err.code == 404:
                return None
            raise


# (volume ID, mutable parameters) -> the code the node plugin answered ("OK", "NOT_FOUND"...)
Modify = Callable[[str, Mapping[str, str]], tuple[str, str]]


class VacSync:
    """One node's carrying of its PVs' VolumeAttributesClasses."""

    def __init__(self, api: Api, driver: str, modify: Modify, interval: float = 30.0) -> None:
        self.api = api
        self.driver = driver
        self.modify = modify
        self.interval = interval
        self._stop = threading.Event()

    def _class(self, name: str, cache: dict[str, Mapping[str, str] | None]
               ) -> Mapping[str, str] | None:
        if name not in cache:
            cache[name] = None
            for path in VAC_PATHS:
                found = self.api.get(f"{path}/{name}")
                if found is not None:
                    cache[name] = found.get("parameters") or {}
                    break
        return cache[name]

    def round(self) -> list[str]:
        """One pass; the volume IDs this node's plugin took the class for."""
        listed = self.api.get("/api/v1/persistentvolumes") or {}
        cache: dict[str, Mapping[str, str] | None] = {}
        ours = []
        for pv in listed.get("items", []):
            spec = pv.get("spec") or {}
            csi = spec.get("csi") or {}
            vac = spec.get("volumeAttributesClassName")
            volume_id = csi.get("volumeHandle")
            if csi.get("driver") != self.driver or not vac or not volume_id:
                continue
            parameters = self._class(vac, cache)
            if parameters is None:
                log.warning("PV %s names VolumeAttributesClass %s, which is not there",
                            (pv.get("metadata") or {}).get("name"), vac)
                continue
            code, message = self.modify(volume_id, parameters)
            if code == "OK":
                ours.append(volume_id)
            elif code != "NOT_FOUND":  # NOT_FOUND: another node's volume
                log.warning("volume %s: VolumeAttributesClass %s not applied: %s: %s",
                            volume_id, vac, code, message)
        return ours

    def run(self) -> None:
        while not self._stop.is_set():
            try:
                self.round()
            except Exception as err:  # the API or the plugin down: the next round
                log.warning("VolumeAttributesClass sync: %s", err)
            self._stop.wait(self.interval)

    def stop(self) -> None:
        self._stop.set()


def socket_modify(endpoint: str, timeout: float = 30.0) -> Modify:
    """ControllerModifyVolume on the plugin at `endpoint`, as a Modify."""
    import grpc

    from csi_local._gen import csi_pb2, csi_pb2_grpc

    channel = grpc.insecure_channel(endpoint)
    stub = csi_pb2_grpc.ControllerStub(channel)

    def modify(volume_id: str, parameters: Mapping[str, str]) -> tuple[str, str]:
        try:
            stub.ControllerModifyVolume(csi_pb2.ControllerModifyVolumeRequest(
                volume_id=volume_id, mutable_parameters=dict(parameters)),
                timeout=timeout, wait_for_ready=True)
        except grpc.RpcError as err:
            return err.code().name, str(err.details())
        return "OK", ""

    return modify
