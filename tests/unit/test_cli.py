import re

import grpc
import pytest

from csi_local import errors
from csi_local._gen import csi_pb2 as pb
from csi_local.cli import build_parser, config_from_args
from csi_local.config import ConfigError, parse_size
from csi_local.server import redact

BASE = ["serve", "--endpoint", "unix:///run/x.sock", "--node-id", "n1",
        "--volume-group", "vg0", "--thin-pool", "pool", "--state-dir", "/var/lib/x"]


def test_five_flags_make_a_config() -> None:
    cfg = config_from_args(build_parser().parse_args(BASE))
    assert (cfg.socket, cfg.node_id, cfg.volume_group, cfg.thin_pool, cfg.state_dir) == (
        "/run/x.sock", "n1", "vg0", "pool", "/var/lib/x")
    assert cfg.topology_key == "topology.lvm.csi-local.dev/node"


def test_environment_fallbacks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CSI_ENDPOINT", "unix:///run/env.sock")
    monkeypatch.setenv("NODE_ID", "from-env")
    monkeypatch.setenv("CSI_LOCAL_VOLUME_GROUP", "vgenv")
    monkeypatch.setenv("CSI_LOCAL_THIN_POOL", "tp")
    monkeypatch.setenv("CSI_LOCAL_NODE_EXPANSION_ONLY", "true")
    cfg = config_from_args(build_parser().parse_args(["serve"]))
    assert (cfg.endpoint, cfg.node_id, cfg.volume_group, cfg.thin_pool) == (
        "unix:///run/env.sock", "from-env", "vgenv", "tp")
    assert cfg.node_expansion_only is True


def test_help_names_every_environment_variable(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    out = capsys.readouterr().out
    for env in ("CSI_ENDPOINT", "NODE_ID", "CSI_LOCAL_VOLUME_GROUP", "CSI_LOCAL_THIN_POOL",
                "CSI_LOCAL_STATE_DIR", "CSI_LOCAL_DRIVER_NAME", "CSI_LOCAL_LOG_LEVEL"):
        assert re.search(rf"\b{env}\b", out), env


@pytest.mark.parametrize("args", [
    ["--endpoint", "tcp://1.2.3.4:5"],
    ["--driver-name", "Not_A_Domain"],
    ["--overprovision-ratio", "0.5"],
    ["--volume-group=-bad"],
    ["--backing-file", "/x.img"],
])
def test_bad_config_refused(args: list[str]) -> None:
    with pytest.raises(ConfigError):
        config_from_args(build_parser().parse_args(BASE + args))


def test_parse_size() -> None:
    assert parse_size("4G") == 4 << 30
    assert parse_size("512MiB") == 512 << 20
    assert parse_size("100") == 100
    with pytest.raises(ConfigError):
        parse_size("lots")


def test_every_error_maps_to_a_grpc_status() -> None:
    for cls in [errors.CsiError, *errors.CsiError.__subclasses__()]:
        assert isinstance(grpc.StatusCode[cls.code], grpc.StatusCode)


def test_secrets_never_reach_the_log() -> None:
    req = pb.NodeStageVolumeRequest(volume_id="v", secrets={"password": "hunter2"})
    text = redact(req)
    assert "hunter2" not in text and 'volume_id: "v"' in text
    assert req.secrets["password"] == "hunter2"  # the request itself is untouched
