"""pytest plugin of the sanity suite: command-line options, fixtures and the final summary.

Load it with ``-p sanity.plugin`` (``python -m sanity`` does that for you).
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from sanity import csi_pb2
from sanity.csi import (
    Capabilities,
    Config,
    Stubs,
    Tracker,
    discover_capabilities,
    force_unmount_under,
    make_stubs,
    normalize_endpoint,
    parse_size,
    remove_tree,
)

DEFAULT_VOLUME_SIZE = "64M"
DEFAULT_CBT_GRANULARITY = "1M"


def pytest_addoption(parser: pytest.Parser) -> None:
    g = parser.getgroup("csi-sanity", "CSI sanity suite")
    g.addoption("--endpoint", help="CSI endpoint, e.g. unix:///run/csi.sock (REQUIRED)")
    g.addoption("--controller-endpoint", default="",
                help="separate endpoint for the Controller service (default: --endpoint)")
    g.addoption("--staging-dir", default="",
                help="directory for staging paths (default: a fresh temp dir, removed afterwards)")
    g.addoption("--mount-dir", default="",
                help="directory for target paths (default: a fresh temp dir, removed afterwards)")
    g.addoption("--volume-size", default=DEFAULT_VOLUME_SIZE,
                help="size of test volumes, bytes with K/M/G suffixes (default 64M)")
    g.addoption("--expand-size", default="",
                help="size to expand test volumes to (default: twice --volume-size)")
    g.addoption("--access-type", default="mount", choices=["mount", "block"],
                help="access type of test volumes (default mount)")
    g.addoption("--fs-type", default="ext4", help="fs_type for mount volumes (default ext4)")
    g.addoption("--volume-parameters", default="",
                help="YAML file with a mapping of CreateVolume parameters")
    g.addoption("--volume-mutable-parameters", default="",
                help="YAML file with a mapping of mutable parameters (CreateVolume's "
                     "mutable_parameters and ControllerModifyVolume)")
    g.addoption("--snapshot-parameters", default="",
                help="YAML file with a mapping of CreateSnapshot parameters")
    g.addoption("--idempotency-repeats", default=3, type=int,
                help="how many times each mutating call is repeated (default 3)")
    g.addoption("--rpc-timeout", default=120.0, type=float,
                help="deadline of each RPC in seconds (default 120)")
    g.addoption("--cbt-granularity", default=DEFAULT_CBT_GRANULARITY,
                help="how far (bytes, K/M/G suffixes) a range reported by GetMetadataAllocated "
                     "or GetMetadataDelta may reach beyond the bytes that changed: the "
                     "plugin's block or chunk size, or larger (default 1M)")


def _load_params(path: str, what: str) -> dict[str, str]:
    if not path:
        return {}
    with open(path, encoding="utf-8") as fh:
        data = yaml.safe_load(fh) or {}
    if not isinstance(data, dict):
        raise pytest.UsageError(f"{what} file {path} must contain a YAML mapping")
    return {str(k): str(v) for k, v in data.items()}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "access_type: stages or publishes volumes of --access-type, so its outcome depends on "
        "it; a second pass for the other type needs only these (-m access_type)")
    if not config.getoption("endpoint", default=None):
        raise pytest.UsageError("the CSI sanity suite needs --endpoint")
    repeats = config.getoption("idempotency_repeats")
    if repeats < 2:
        raise pytest.UsageError("--idempotency-repeats must be at least 2")


def cbt_granularity(text: str) -> int:
    """--cbt-granularity: a positive multiple of 4 KiB (the discard the suite issues is
    aligned to it, and block devices discard whole logical blocks)."""
    try:
        value = parse_size(text)
    except ValueError as err:
        raise pytest.UsageError(f"--cbt-granularity: {err}") from err
    if value <= 0 or value % 4096:
        raise pytest.UsageError(f"--cbt-granularity {text} must be a positive multiple of 4K")
    return value


@pytest.fixture(scope="session")
def cfg(pytestconfig: pytest.Config) -> Iterator[Config]:
    opt = pytestconfig.getoption
    owned: list[Path] = []

    def scratch(given: str, kind: str) -> Path:
        if given:
            p = Path(given)
            p.mkdir(parents=True, exist_ok=True)
            return p.resolve()
        p = Path(tempfile.mkdtemp(prefix=f"csi-sanity-{kind}-"))
        owned.append(p)
        return p

    try:
        size = parse_size(opt("volume_size"))
        expand = parse_size(opt("expand_size")) if opt("expand_size") else 2 * size
    except ValueError as err:
        raise pytest.UsageError(str(err)) from err
    if expand <= size:
        raise pytest.UsageError("--expand-size must be larger than --volume-size")
    granularity = cbt_granularity(opt("cbt_granularity"))
    endpoint = normalize_endpoint(opt("endpoint"))
    config = Config(
        endpoint=endpoint,
        controller_endpoint=normalize_endpoint(opt("controller_endpoint") or endpoint),
        staging_dir=scratch(opt("staging_dir"), "staging"),
        mount_dir=scratch(opt("mount_dir"), "mount"),
        volume_size=size,
        expand_size=expand,
        access_type=opt("access_type"),
        fs_type=opt("fs_type"),
        volume_parameters=_load_params(opt("volume_parameters"), "--volume-parameters"),
        snapshot_parameters=_load_params(opt("snapshot_parameters"), "--snapshot-parameters"),
        mutable_parameters=_load_params(opt("volume_mutable_parameters"),
                                        "--volume-mutable-parameters"),
        repeats=opt("idempotency_repeats"),
        timeout=opt("rpc_timeout"),
        cbt_granularity=granularity,
    )
    yield config
    for d in (config.staging_dir, config.mount_dir):
        leaked = force_unmount_under(d)
        if leaked:
            print(f"\ncsi-sanity: force-unmounted leftover mounts under {d}: {leaked}")
    for d in owned:
        remove_tree(d)


@pytest.fixture(scope="session")
def stubs(cfg: Config) -> Iterator[Stubs]:
    channels = [grpc.insecure_channel(cfg.endpoint)]
    if cfg.controller_endpoint != cfg.endpoint:
        channels.append(grpc.insecure_channel(cfg.controller_endpoint))
    wait = min(30.0, cfg.timeout)
    try:
        for ch in channels:
            try:
                grpc.channel_ready_future(ch).result(timeout=wait)
            except grpc.FutureTimeoutError:
                pytest.fail(f"cannot connect to the CSI endpoint within {wait:g}s", pytrace=False)
        yield make_stubs(channels[0], channels[-1], cfg.timeout)
    finally:
        for ch in channels:
            ch.close()


@pytest.fixture(scope="session")
def caps(stubs: Stubs, cfg: Config) -> Capabilities:
    return discover_capabilities(stubs, cfg.controller_endpoint != cfg.endpoint)


@pytest.fixture(scope="session")
def node_id(stubs: Stubs) -> str:
    return str(stubs.node.NodeGetInfo(csi_pb2.NodeGetInfoRequest()).node_id)


@pytest.fixture
def controller(caps: Capabilities) -> Capabilities:
    """Capabilities, after skipping unless the plugin has the Controller service."""
    caps.require_plugin("CONTROLLER_SERVICE")
    return caps


@pytest.fixture
def tracker(cfg: Config, stubs: Stubs, caps: Capabilities, node_id: str) -> Iterator[Tracker]:
    t = Tracker(cfg, stubs, caps, node_id)
    yield t
    errors = t.cleanup()
    if errors:
        pytest.fail("teardown failed:\n  " + "\n  ".join(errors), pytrace=False)


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    stats = terminalreporter.stats
    passed = [r for r in stats.get("passed", []) if r.when == "call"]
    failed = stats.get("failed", [])
    errors = stats.get("error", [])
    skipped = stats.get("skipped", [])
    tr = terminalreporter
    tr.section("CSI sanity summary")
    tr.write_line(
        f"passed: {len(passed)}  failed: {len(failed)}  errors: {len(errors)}  "
        f"skipped: {len(skipped)}"
    )
    for rep in failed:
        tr.write_line(f"FAILED  {rep.nodeid}")
    for rep in errors:
        tr.write_line(f"ERROR   {rep.nodeid} ({rep.when})")
    for rep in skipped:
        reason = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
        reason = reason.removeprefix("Skipped: ")
        tr.write_line(f"SKIPPED {rep.nodeid}: {reason}")
