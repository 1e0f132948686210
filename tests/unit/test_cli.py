import concurrent.futures
import json
import logging
import re
import types
from pathlib import Path
from typing import Any, TypeVar, cast

import grpc
import pytest
from google.protobuf import wrappers_pb2

from csi_local import errors
from csi_local._gen import csi_pb2 as pb
from csi_local._gen import csi_pb2_grpc
from csi_local.cli import build_parser, config_from_args, main
from csi_local.config import ConfigError, parse_size
from csi_local.csi import rpc
from csi_local.csi.server import redact
from tests.unit.servicers import NO_CONTEXT

T = TypeVar("T")

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


def _all_subclasses(cls: type[T]) -> list[type[T]]:
    out = [cls]
    for sub in cls.__subclasses__():
        out += _all_subclasses(sub)
    return out


def test_every_error_maps_to_a_grpc_status() -> None:
    # Every RPC error's own code, and every storage error's code through the one
    # table (rpc.CODES), is a real gRPC status; a storage error class without an
    # entry of its own would fall back to its base's code silently, so each one
    # must be listed.
    for cls in _all_subclasses(rpc.RpcError):
        assert isinstance(grpc.StatusCode[cls.code], grpc.StatusCode)
    for storage_cls in _all_subclasses(errors.StorageError):
        assert storage_cls in rpc.CODES, \
            f"{storage_cls.__name__} has no status code in rpc.CODES"
        assert isinstance(grpc.StatusCode[rpc.CODES[storage_cls]], grpc.StatusCode)
    for (_method, mapped), code in rpc.PER_RPC.items():
        assert mapped in rpc.CODES and isinstance(grpc.StatusCode[code], grpc.StatusCode)


def test_secrets_never_reach_the_log() -> None:
    req = pb.NodeStageVolumeRequest(volume_id="v", secrets={"password": "hunter2"})
    text = redact(req)
    assert "hunter2" not in text and 'volume_id: "v"' in text
    assert req.secrets["password"] == "hunter2"  # the request itself is untouched


# Every environment fallback that restricts its values, with a value it must refuse.
BAD_ENV = [
    ("--log-level", "CSI_LOCAL_LOG_LEVEL", "verbose"),
    ("--log-format", "CSI_LOCAL_LOG_FORMAT", "yaml"),
    ("--default-fs-type", "CSI_LOCAL_DEFAULT_FS_TYPE", "zfs"),
    ("--overprovision-ratio", "CSI_LOCAL_OVERPROVISION_RATIO", "lots"),
    ("--max-volumes-per-node", "CSI_LOCAL_MAX_VOLUMES_PER_NODE", "1.5"),
    ("--command-timeout", "CSI_LOCAL_COMMAND_TIMEOUT", "2m"),
    ("--group-freeze-timeout", "CSI_LOCAL_GROUP_FREEZE_TIMEOUT", "10s"),
    ("--shutdown-grace", "CSI_LOCAL_SHUTDOWN_GRACE", "20s"),
    ("--node-expansion-only", "CSI_LOCAL_NODE_EXPANSION_ONLY", "maybe"),
    ("--backing-size", "CSI_LOCAL_BACKING_SIZE", "4 gigs"),
]


def _parse_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(("flag", "env", "bad"), BAD_ENV, ids=[e for _, e, _ in BAD_ENV])
def test_bad_environment_value_fails_like_the_flag(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        flag: str, env: str, bad: str) -> None:
    flag_error = _parse_error([*BASE, f"{flag}={bad}"], capsys)
    assert f"argument {flag}: " in flag_error and repr(bad) in flag_error
    monkeypatch.setenv(env, bad)
    assert _parse_error(BASE, capsys) == flag_error


def test_good_environment_values_are_converted(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in [("CSI_LOCAL_LOG_LEVEL", "debug"), ("CSI_LOCAL_LOG_FORMAT", "json"),
                        ("CSI_LOCAL_DEFAULT_FS_TYPE", "xfs"),
                        ("CSI_LOCAL_OVERPROVISION_RATIO", "2.5"),
                        ("CSI_LOCAL_MAX_VOLUMES_PER_NODE", "7"),
                        ("CSI_LOCAL_COMMAND_TIMEOUT", "30"),
                        ("CSI_LOCAL_NODE_EXPANSION_ONLY", "yes"),
                        ("CSI_LOCAL_BACKING_FILE", "/x.img"), ("CSI_LOCAL_BACKING_SIZE", "1G")]:
        monkeypatch.setenv(name, value)
    args = build_parser().parse_args(BASE)
    assert (args.log_level, args.log_format) == ("debug", "json")
    cfg = config_from_args(args)
    assert (cfg.default_fs_type, cfg.overprovision_ratio, cfg.max_volumes_per_node,
            cfg.command_timeout, cfg.node_expansion_only, cfg.backing_size) == (
        "xfs", 2.5, 7, 30.0, True, 1 << 30)


def test_group_freeze_timeout_flag_env_and_default(monkeypatch: pytest.MonkeyPatch) -> None:
    assert config_from_args(build_parser().parse_args(BASE)).group_freeze_timeout == 10.0
    monkeypatch.setenv("CSI_LOCAL_GROUP_FREEZE_TIMEOUT", "2.5")
    assert config_from_args(build_parser().parse_args(BASE)).group_freeze_timeout == 2.5
    args = build_parser().parse_args([*BASE, "--group-freeze-timeout", "4"])
    assert config_from_args(args).group_freeze_timeout == 4.0  # the flag wins
    for bad in ("0", "-1", "inf", "nan"):
        with pytest.raises(ConfigError, match="group freeze timeout must be a finite number"):
            config_from_args(build_parser().parse_args([*BASE, "--group-freeze-timeout",
                                                        bad]))


def test_shutdown_grace_flag_env_and_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """20 s unless set: below the Nomad job's kill_timeout of 30 s with time
    to stop (tests/deploy/test_plugin_flags.py checks every shipped one)."""
    assert config_from_args(build_parser().parse_args(BASE)).shutdown_grace == 20.0
    monkeypatch.setenv("CSI_LOCAL_SHUTDOWN_GRACE", "12.5")
    assert config_from_args(build_parser().parse_args(BASE)).shutdown_grace == 12.5
    args = build_parser().parse_args([*BASE, "--shutdown-grace", "4"])
    assert config_from_args(args).shutdown_grace == 4.0  # the flag wins


def test_flag_overrides_a_bad_environment_value(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CSI_LOCAL_LOG_LEVEL", "verbose")
    assert build_parser().parse_args([*BASE, "--log-level", "error"]).log_level == "error"


def test_flag_forms_still_parse() -> None:
    args = build_parser().parse_args([*BASE, "--node-expansion-only", "--backing-size", ""])
    cfg = config_from_args(args)
    assert cfg.node_expansion_only is True and cfg.backing_size is None
    assert config_from_args(build_parser().parse_args(BASE)).node_expansion_only is False


@pytest.mark.parametrize(("level", "fmt"), [("verbose", "text"), ("info", "yaml")])
def test_setup_logging_refuses_unknown_values(level: str, fmt: str) -> None:
    from csi_local.logs import setup_logging

    root = logging.getLogger()
    before = (list(root.handlers), root.level)
    with pytest.raises(ValueError, match="choose from"):
        setup_logging(level, fmt)
    assert (list(root.handlers), root.level) == before  # nothing changed on the way


class _Served(Exception):
    pass


@pytest.mark.parametrize(("env", "bad"), [("CSI_LOCAL_LOG_LEVEL", "verbose"),
                                          ("CSI_LOCAL_LOG_FORMAT", "yaml")])
def test_main_refuses_bad_environment_before_serving(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        env: str, bad: str) -> None:
    """Used to be a traceback (level) or a silent fall-back to text (format)."""
    import csi_local.csi.server
    from csi_local.cli import main

    def serve(config: object) -> None:
        raise _Served

    monkeypatch.setattr(csi_local.csi.server, "serve", serve)
    monkeypatch.setenv(env, bad)
    with pytest.raises(SystemExit) as exc:
        main(BASE)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"invalid choice: {bad!r}" in err and "Traceback" not in err


def test_requests_are_rendered_only_when_debug_logging_is_on(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Rendering a request as text costs a copy and text_format on every RPC;
    at the default level nobody reads it."""
    from csi_local.csi import server

    rendered: list[str] = []
    real = server.redact
    def redact(req: Any) -> str:
        rendered.append("x")
        return real(req)

    monkeypatch.setattr(server, "redact", redact)
    interceptor = server.ErrorInterceptor()
    details = types.SimpleNamespace(method="/csi.v1.Identity/Probe")
    handler = interceptor.intercept_service(
        lambda _: grpc.unary_unary_rpc_method_handler(lambda req, ctx: pb.ProbeResponse()),
        cast(grpc.HandlerCallDetails, details))
    assert handler is not None and handler.unary_unary is not None
    with caplog.at_level(logging.INFO, logger="csi_local.csi.server"):
        handler.unary_unary(pb.ProbeRequest(), NO_CONTEXT)
    assert rendered == []
    with caplog.at_level(logging.DEBUG, logger="csi_local.csi.server"):
        handler.unary_unary(pb.ProbeRequest(), NO_CONTEXT)
    assert rendered == ["x"] and "Probe request: " in caplog.text


@pytest.mark.parametrize("command", ["status", "doctor"])
def test_status_and_doctor_take_a_configuration_file(
        command: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    for env in ("CSI_LOCAL_CONFIG", "CSI_LOCAL_VOLUME_GROUP", "CSI_LOCAL_THIN_POOL"):
        monkeypatch.delenv(env, raising=False)
    with pytest.raises(SystemExit):
        build_parser().parse_args([command, "--help"])
    out = capsys.readouterr().out
    for env in ("CSI_LOCAL_CONFIG", "CSI_LOCAL_VOLUME_GROUP", "CSI_LOCAL_THIN_POOL"):
        assert re.search(rf"\b{env}\b", out), env
    ns = build_parser().parse_args([command, "--config", "/etc/c.toml"])
    assert (ns.config, ns.volume_group, ns.thin_pool) == ("/etc/c.toml", None, None)
    ns = build_parser().parse_args([command, "--volume-group", "vg0", "--thin-pool", "p"])
    assert (ns.config, ns.volume_group, ns.thin_pool) == (None, "vg0", "p")
    for bad in (["--config", "/c", "--volume-group", "vg0"], ["--thin-pool", "p"], []):
        with pytest.raises(SystemExit) as info:
            build_parser().parse_args([command, *bad])
        assert info.value.code == 2
    assert "not both" in capsys.readouterr().err


# values no process may run with ------------------------------------------------


@pytest.mark.parametrize("bad", ["nan", "NaN", "inf", "-inf", "Infinity", "0", "-5"])
@pytest.mark.parametrize(("flag", "env"), [
    ("--command-timeout", "CSI_LOCAL_COMMAND_TIMEOUT"),
    ("--pool-monitor-interval", "CSI_LOCAL_POOL_MONITOR_INTERVAL"),
    ("--shutdown-grace", "CSI_LOCAL_SHUTDOWN_GRACE"),
])
def test_timeouts_and_intervals_are_finite_and_positive(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        flag: str, env: str, bad: str) -> None:
    """float() takes nan and inf: a command timeout of either never kills the
    command (nan compares false with everything), an interval of inf never
    wakes. Refused by flag and by environment, and serve exits 2 before it
    starts anything."""
    from csi_local.cli import main

    with pytest.raises(ConfigError, match="finite number of seconds above 0"):
        config_from_args(build_parser().parse_args([*BASE, f"{flag}={bad}"]))
    monkeypatch.setenv(env, bad)
    with pytest.raises(ConfigError, match="finite number of seconds above 0"):
        config_from_args(build_parser().parse_args(BASE))
    with pytest.raises(SystemExit) as exc:
        main(BASE)
    assert exc.value.code == 2
    assert "finite number of seconds above 0" in capsys.readouterr().err


SERVE = ["serve", "--endpoint", "unix:///run/x.sock", "--node-id", "n1",
         "--volume-group", "vg0", "--thin-pool", "pool"]
CHECKS = ["--volume-group", "vg0", "--thin-pool", "pool"]


def _refused(argv: list[str]) -> str | None:
    """The message serve, status or doctor refuses `argv` with, else None."""
    import contextlib
    import io

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            args = build_parser().parse_args(argv)
        if args.command == "serve":
            config_from_args(args)
    except SystemExit:
        return err.getvalue().strip().rsplit(": error: ", 1)[-1].split(": ", 1)[-1]
    except ConfigError as e:
        return str(e)
    return None


@pytest.mark.parametrize("path", ["locks", "./locks", "run/lock/csi-local", "", "/run/lock/ok",
                                  "/a/../b"])
def test_doctor_and_serve_take_one_rule_for_directories(path: str) -> None:
    """A relative --lock-dir or --state-dir, which serve refuses, is refused
    by doctor (and status) too, with the same words (config.absolute_path);
    what serve takes, they take."""
    serve_lock = _refused([*SERVE, "--state-dir", "/var/lib/x", "--lock-dir", path])
    doctor_lock = _refused(["doctor", *CHECKS, "--lock-dir", path])
    assert serve_lock == doctor_lock
    serve_state = _refused([*SERVE, "--state-dir", path])
    for command in ("doctor", "status"):
        assert _refused([command, *CHECKS, "--state-dir", path]) == serve_state, command
    if path.startswith("/"):
        assert serve_lock is None and serve_state is None
    else:
        assert serve_lock is not None and "absolute path" in serve_lock
        assert serve_state is not None and "absolute path" in serve_state


def test_doctor_takes_serves_rule_for_the_endpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    for endpoint in ("unix://run/x.sock", "tcp://1.2.3.4:5", "/run/x.sock"):
        assert _refused(["doctor", *CHECKS, "--endpoint", endpoint]) == (
            _refused([*SERVE, "--state-dir", "/s", "--endpoint", endpoint])), endpoint
        monkeypatch.setenv("CSI_ENDPOINT", endpoint)
        assert _refused(["doctor", *CHECKS]) is not None
        monkeypatch.delenv("CSI_ENDPOINT")
    assert _refused(["doctor", *CHECKS, "--endpoint", "unix:///run/x.sock"]) is None


class _Identity(csi_pb2_grpc.IdentityServicer):
    """A plugin's Identity service that answers Probe with `ready` (None:
    leaves it unset) or aborts with UNAVAILABLE."""

    def __init__(self, ready: bool | None, fail: bool = False) -> None:
        self.ready, self.fail = ready, fail

    def GetPluginInfo(self, request: pb.GetPluginInfoRequest,
                      context: grpc.ServicerContext) -> pb.GetPluginInfoResponse:
        raise AssertionError("probe asks nothing else")

    def GetPluginCapabilities(self, request: pb.GetPluginCapabilitiesRequest,
                              context: grpc.ServicerContext
                              ) -> pb.GetPluginCapabilitiesResponse:
        raise AssertionError("probe asks nothing else")

    def Probe(self, request: pb.ProbeRequest,
              context: grpc.ServicerContext) -> pb.ProbeResponse:
        if self.fail:
            context.abort(grpc.StatusCode.UNAVAILABLE, "not yet")
        if self.ready is None:
            return pb.ProbeResponse()
        return pb.ProbeResponse(ready=wrappers_pb2.BoolValue(value=self.ready))


@pytest.mark.parametrize(("identity", "printed", "code"), [
    pytest.param(_Identity(True), {"ready": True}, 0, id="ready"),
    pytest.param(_Identity(False), {"ready": False}, 0, id="not-ready"),
    pytest.param(_Identity(None), {"ready": True}, 0, id="unset-is-ready"),  # as the spec says
    pytest.param(_Identity(None, fail=True), {"error": "UNAVAILABLE: not yet"}, 1,
                 id="an-error"),
])
def test_probe_prints_what_the_plugin_answers(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                              identity: _Identity, printed: dict[str, Any],
                                              code: int) -> None:
    server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=1))
    csi_pb2_grpc.add_IdentityServicer_to_server(identity, server)
    endpoint = f"unix://{tmp_path}/csi.sock"
    server.add_insecure_port(endpoint)
    server.start()
    try:
        assert main(["probe", "--endpoint", endpoint, "--timeout", "10"]) == code
    finally:
        server.stop(None)
    assert json.loads(capsys.readouterr().out) == printed
