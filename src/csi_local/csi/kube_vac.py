"""Kubernetes VolumeAttributesClass on the node (docs/qos.md, "Kubernetes").

external-resizer calls ControllerModifyVolume from its central Deployment,
whose plugin copy reaches no node's LVM: it validates the new class's
parameters and answers OK (--modify-validate-only), and the resizer then
records the class on the PV (`spec.volumeAttributesClassName`). Each node
plugin reads that record itself: every --vac-sync-interval seconds it lists
the PVs of its driver that name a class, and for each whose volume is in one
of its own VGs it applies the class's parameters as ControllerModifyVolume
would (Provisioner.modify_volume: the limits it names change, the others
stay), when they differ from the LV's tags. The node's QoS reconcile then
carries them into io.max. Nothing is written to the API.

The API is read with the pod's ServiceAccount token, read-only (RBAC:
get/list persistentvolumes and volumeattributesclasses).
"""

from __future__ import annotations

import json
import logging
import os
import ssl
import threading
import urllib.request
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from csi_local.errors import StorageError
from csi_local.volumes import qos
from csi_local.volumes.pool import Pools
from csi_local.volumes.provisioning import Provisioner

log = logging.getLogger(__name__)

SERVICE_ACCOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"
# storage.k8s.io/v1 since Kubernetes 1.34, v1beta1 from 1.31: the first that answers.
VAC_PATHS = ("/apis/storage.k8s.io/v1/volumeattributesclasses",
             "/apis/storage.k8s.io/v1beta1/volumeattributesclasses")


class Api(Protocol):
    def get(self, path: str) -> dict[str, Any] | None: ...


class InClusterApi:
    """GET on the API server with the pod's ServiceAccount, None for 404."""

    def __init__(self, host: str, port: str, directory: str = SERVICE_ACCOUNT,
                 timeout: float = 10.0) -> None:
        self.base = f"https://{host}:{port}"
        self.directory = directory
        self.timeout = timeout
        self.context = ssl.create_default_context(cafile=os.path.join(directory, "ca.crt"))

    @classmethod
    def from_environment(cls) -> InClusterApi | None:
        host = os.environ.get("KUBERNETES_SERVICE_HOST")
        port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        if not host or not os.path.exists(os.path.join(SERVICE_ACCOUNT, "token")):
            return None
        return cls(host, port)

    def get(self, path: str) -> dict[str, Any] | None:
        # The token is read at each call: kubelet rotates it.
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


class VacSync:
    """One node's reading of its PVs' VolumeAttributesClasses."""

    def __init__(self, api: Api, driver: str, pools: Pools, provisioner: Provisioner,
                 interval: float = 30.0) -> None:
        self.api = api
        self.driver = driver
        self.pools = pools
        self.provisioner = provisioner
        self.interval = interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

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
        """One pass; the volume IDs whose limits it changed."""
        listed = self.api.get("/api/v1/persistentvolumes") or {}
        cache: dict[str, Mapping[str, str] | None] = {}
        changed = []
        for pv in listed.get("items", []):
            spec = pv.get("spec") or {}
            csi = spec.get("csi") or {}
            vac = spec.get("volumeAttributesClassName")
            volume_id = csi.get("volumeHandle")
            if csi.get("driver") != self.driver or not vac or not volume_id:
                continue
            found = self.pools.find_committed(volume_id)
            if found is None:
                continue  # another node's volume (or not readable now)
            parameters = self._class(vac, cache)
            if parameters is None:
                log.warning("PV %s names VolumeAttributesClass %s, which is not there",
                            pv.get("metadata", {}).get("name"), vac)
                continue
            try:
                changes = qos.changes_from(parameters)
            except ValueError as err:
                log.warning("VolumeAttributesClass %s: %s", vac, err)
                continue
            have = qos.limits_of(found[1])
            if have.merged(changes) == have:
                continue
            try:
                now = self.provisioner.modify_volume(volume_id, changes)
            except StorageError as err:
                log.warning("volume %s: VolumeAttributesClass %s not applied yet: %s",
                            volume_id, vac, err.message)
                continue
            log.info("volume %s: VolumeAttributesClass %s applied, IO limits now %s",
                     volume_id, vac, now.describe())
            changed.append(volume_id)
        return changed

    def start(self, then: Callable[[], object] | None = None) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, args=(then,), daemon=True,
                                        name="vac-sync")
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)

    def _run(self, then: Callable[[], object] | None) -> None:
        while not self._stop.is_set():
            try:
                if self.round() and then is not None:
                    then()  # the new limits into io.max now, not a round later
            except Exception as err:  # the API down: the next round tries again
                log.warning("VolumeAttributesClass sync: %s", err)
            self._stop.wait(self.interval)
