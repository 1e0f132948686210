"""Identity service: GetPluginInfo, GetPluginCapabilities, Probe; capability listings."""

from __future__ import annotations

import re

import pytest

from sanity import csi_pb2
from sanity.csi import Capabilities, Config, Stubs

# RFC 1035 style: alphanumeric at both ends, alphanumerics, dashes and dots between, <= 63.
NAME_RE = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9.-]{0,61}[A-Za-z0-9])?$")


def test_plugin_info_name_and_version(stubs: Stubs) -> None:
    info = stubs.identity.GetPluginInfo(csi_pb2.GetPluginInfoRequest())
    assert info.name, "GetPluginInfo.name is REQUIRED"
    assert len(info.name) <= 63, f"name {info.name!r} is longer than 63 characters"
    assert NAME_RE.match(info.name), f"name {info.name!r} is not in domain name notation"
    assert info.vendor_version, "GetPluginInfo.vendor_version is REQUIRED"


def test_controller_endpoint_is_same_plugin(stubs: Stubs, cfg: Config) -> None:
    if cfg.controller_endpoint == cfg.endpoint:
        pytest.skip("no separate --controller-endpoint given")
    a = stubs.identity.GetPluginInfo(csi_pb2.GetPluginInfoRequest())
    b = stubs.controller_identity.GetPluginInfo(csi_pb2.GetPluginInfoRequest())
    assert (a.name, a.vendor_version) == (b.name, b.vendor_version)


def test_plugin_capabilities_are_known(stubs: Stubs) -> None:
    resp = stubs.identity.GetPluginCapabilities(csi_pb2.GetPluginCapabilitiesRequest())
    for cap in resp.capabilities:
        kind = cap.WhichOneof("type")
        assert kind in ("service", "volume_expansion"), f"capability without a type: {cap}"
        inner = getattr(cap, kind)
        assert inner.type != 0, f"capability of UNKNOWN type: {cap}"


def test_probe(stubs: Stubs) -> None:
    resp = stubs.identity.Probe(csi_pb2.ProbeRequest())
    assert not (resp.HasField("ready") and not resp.ready.value), "Probe says not ready"


def test_controller_capabilities_are_known(stubs: Stubs, controller: Capabilities) -> None:
    resp = stubs.controller.ControllerGetCapabilities(csi_pb2.ControllerGetCapabilitiesRequest())
    for cap in resp.capabilities:
        assert cap.WhichOneof("type") == "rpc" and cap.rpc.type != 0, f"bad capability {cap}"


def test_node_capabilities_are_known(stubs: Stubs) -> None:
    resp = stubs.node.NodeGetCapabilities(csi_pb2.NodeGetCapabilitiesRequest())
    for cap in resp.capabilities:
        assert cap.WhichOneof("type") == "rpc" and cap.rpc.type != 0, f"bad capability {cap}"


def test_node_get_info(stubs: Stubs) -> None:
    info = stubs.node.NodeGetInfo(csi_pb2.NodeGetInfoRequest())
    assert info.node_id, "NodeGetInfo.node_id is REQUIRED"
    assert info.max_volumes_per_node >= 0, "max_volumes_per_node MUST NOT be negative"

