"""Every flag and environment variable that a manifest or Nomad job passes to
the plugin must be one `csi-local serve --help` documents; an environment
variable may instead be one of `csi-local doctor --help`, which an operator
runs in the plugin's container, where it finds that environment."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from functools import cache

import pytest

from tests.deploy._deploy import (
    REPO,
    PluginInvocation,
    generated_config_map,
    k8s_plugin_invocations,
    nomad_plugin_invocations,
)

# The command-line contract of `csi-local serve` (flag -> environment fallback).
CONTRACT = {
    "--endpoint": "CSI_ENDPOINT",
    "--node-id": "NODE_ID",
    "--volume-group": "CSI_LOCAL_VOLUME_GROUP",
    "--thin-pool": "CSI_LOCAL_THIN_POOL",
    "--config": "CSI_LOCAL_CONFIG",
    "--state-dir": "CSI_LOCAL_STATE_DIR",
    "--driver-name": "CSI_LOCAL_DRIVER_NAME",
    "--log-level": "CSI_LOCAL_LOG_LEVEL",
    "--log-format": "CSI_LOCAL_LOG_FORMAT",
    "--overprovision-ratio": "CSI_LOCAL_OVERPROVISION_RATIO",
    "--max-volumes-per-node": "CSI_LOCAL_MAX_VOLUMES_PER_NODE",
    "--default-fs-type": "CSI_LOCAL_DEFAULT_FS_TYPE",
    "--node-expansion-only": "CSI_LOCAL_NODE_EXPANSION_ONLY",
    "--command-timeout": "CSI_LOCAL_COMMAND_TIMEOUT",
    "--pool-data-limit-percent": "CSI_LOCAL_POOL_DATA_LIMIT_PERCENT",
    "--pool-metadata-limit-percent": "CSI_LOCAL_POOL_METADATA_LIMIT_PERCENT",
    "--pool-autoextend-threshold-percent": "CSI_LOCAL_POOL_AUTOEXTEND_THRESHOLD_PERCENT",
    "--pool-autoextend-percent": "CSI_LOCAL_POOL_AUTOEXTEND_PERCENT",
    "--pool-monitor-interval": "CSI_LOCAL_POOL_MONITOR_INTERVAL",
    "--metrics-address": "CSI_LOCAL_METRICS_ADDRESS",
    "--shutdown-grace": "CSI_LOCAL_SHUTDOWN_GRACE",
}

# Allowed literal values, where the contract restricts them.
VALUES = {
    "CSI_LOCAL_LOG_LEVEL": {"debug", "info", "warning", "error"},
    "CSI_LOCAL_LOG_FORMAT": {"text", "json"},
    "CSI_LOCAL_DEFAULT_FS_TYPE": {"ext4", "xfs", "btrfs"},
    "CSI_LOCAL_NODE_EXPANSION_ONLY": {"true", "false"},
}

_FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
_METAVAR = re.compile(r"(--[a-z][a-z0-9-]*)[ =]([A-Z][A-Z0-9_]*)")
_ENV = re.compile(r"\b[A-Z][A-Z0-9]*(?:_[A-Z0-9]+)+\b")


def serve_help() -> str:
    return command_help("serve")


@cache
def command_help(command: str) -> str:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO / "src"), env.get("PYTHONPATH")) if p)
    env["COLUMNS"] = "200"
    code = ("import sys; from csi_local.cli import main; "
            f"sys.argv = ['csi-local', {command!r}, '--help']; sys.exit(main())")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       timeout=60, check=False)
    assert r.returncode == 0, f"csi-local {command} --help failed:\n{r.stdout}\n{r.stderr}"
    assert "--volume-group" in r.stdout, r.stdout
    return r.stdout


def help_flags(text: str) -> set[str]:
    return set(_FLAG.findall(text))


def help_env(text: str) -> set[str]:
    # argparse metavars (--node-id NODE_ID) are not environment variables
    text = _METAVAR.sub(lambda m: m.group(1), text)
    return set(_ENV.findall(text))


def test_help_parsers() -> None:
    sample = ("  --node-id NODE_ID   node id (env NODE_ID)\n"
              "  --thin-pool POOL    pool [env: CSI_LOCAL_THIN_POOL]\n"
              "  --volume-group VOLUME_GROUP  vg\n")
    assert help_flags(sample) == {"--node-id", "--thin-pool", "--volume-group"}
    assert help_env(sample) == {"NODE_ID", "CSI_LOCAL_THIN_POOL"}


def test_help_lists_the_contract() -> None:
    text = serve_help()
    assert set(CONTRACT) <= help_flags(text), set(CONTRACT) - help_flags(text)
    assert set(CONTRACT.values()) <= help_env(text), set(CONTRACT.values()) - help_env(text)


def invocations() -> list[PluginInvocation]:
    return list(k8s_plugin_invocations()) + list(nomad_plugin_invocations())


def test_plugin_is_deployed_everywhere() -> None:
    where = [i.where for i in invocations()]
    assert any(w.startswith("node.yaml") for w in where), where
    assert any(w.startswith("resizer.yaml") for w in where), where
    assert any(w.startswith("csi-local.nomad.hcl") for w in where), where
    assert any(w.startswith("device-classes") for w in where), where


@pytest.mark.parametrize("inv", invocations(), ids=lambda i: i.where)
def test_flags_and_env_exist(inv: PluginInvocation) -> None:
    text = serve_help()
    flags, env = help_flags(text), help_env(text) | help_env(command_help("doctor"))
    assert inv.flags or inv.env, f"{inv.where}: passes nothing to the plugin"
    unknown_flags = set(inv.flags) - flags
    assert not unknown_flags, f"{inv.where}: not in serve --help: {sorted(unknown_flags)}"
    unknown_env = set(inv.env) - env
    assert not unknown_env, (f"{inv.where}: not in serve --help nor doctor --help: "
                             f"{sorted(unknown_env)}")


@pytest.mark.parametrize("inv", invocations(), ids=lambda i: i.where)
def test_literal_values_allowed(inv: PluginInvocation) -> None:
    for name, value in inv.env.items():
        if value is not None and name in VALUES:
            assert value in VALUES[name], f"{inv.where}: {name}={value}"
    # every plugin gets its required settings from a flag or the environment
    def given(flag: str) -> bool:
        return flag in inv.flags or CONTRACT[flag] in inv.env

    assert given("--node-id"), f"{inv.where}: no --node-id"
    # its pools: one class from --volume-group and --thin-pool, or the device
    # classes of --config (docs/device-classes.md)
    assert (given("--volume-group") and given("--thin-pool")) or given("--config"), (
        f"{inv.where}: neither --volume-group and --thin-pool nor --config")


def test_configmap_values_allowed() -> None:
    data = generated_config_map()["data"]
    assert data["default-fs-type"] in VALUES["CSI_LOCAL_DEFAULT_FS_TYPE"]
    assert data["log-level"] in VALUES["CSI_LOCAL_LOG_LEVEL"]
    assert float(data["overprovision-ratio"]) >= 1.0
    assert int(data["max-volumes-per-node"]) >= 0


# What the plugin still does after its grace before it exits (the metrics
# server, the lvm shell, the state, the socket), with room to spare on a
# loaded node: seconds a kill timeout must exceed the grace by.
STOP_MARGIN_SECONDS = 5.0


def _shutdown_grace(inv: PluginInvocation) -> tuple[float, str]:
    """The --shutdown-grace a shipped plugin runs with, and where it comes
    from: its flag, else its environment (a literal, or config.env through
    the generated ConfigMap), else the plugin's default."""
    from csi_local.config import DEFAULT_SHUTDOWN_GRACE

    env = CONTRACT["--shutdown-grace"]
    for i, arg in enumerate(inv.args):
        if arg.startswith("--shutdown-grace="):
            return float(arg.split("=", 1)[1]), "flag"
        if arg == "--shutdown-grace":
            return float(inv.args[i + 1]), "flag"
    if inv.env.get(env) is not None:
        return float(str(inv.env[env])), "env"
    if env in inv.config_keys:
        return float(generated_config_map()["data"][inv.config_keys[env]]), "config.env"
    assert env not in inv.env, f"{inv.where}: {env} from where?"
    return DEFAULT_SHUTDOWN_GRACE, "default"


@pytest.mark.parametrize("inv", invocations(), ids=lambda i: i.where)
def test_shutdown_grace_ends_before_the_kill(inv: PluginInvocation) -> None:
    """The plugin gives running RPCs its grace at SIGTERM, then stops: all of
    it must end before the CO's SIGKILL (Nomad's kill_timeout, a pod's
    terminationGracePeriodSeconds), or a grace that runs out kills the
    plugin part-way through its own stop."""
    grace, source = _shutdown_grace(inv)
    assert grace + STOP_MARGIN_SECONDS <= inv.kill_timeout, (
        f"{inv.where}: grace {grace:g} s ({source}) + {STOP_MARGIN_SECONDS:g} s to stop "
        f"exceeds the kill timeout {inv.kill_timeout:g} s")


def test_shutdown_grace_is_read_from_every_source() -> None:
    """_shutdown_grace finds a value wherever a manifest may set one."""
    from csi_local.config import DEFAULT_SHUTDOWN_GRACE

    base = PluginInvocation(where="x", kill_timeout=30)
    assert _shutdown_grace(base) == (DEFAULT_SHUTDOWN_GRACE, "default")
    assert _shutdown_grace(PluginInvocation(where="x", args=["--shutdown-grace=7"])) == (
        7.0, "flag")
    assert _shutdown_grace(PluginInvocation(where="x", args=["--shutdown-grace", "8"])) == (
        8.0, "flag")
    assert _shutdown_grace(PluginInvocation(
        where="x", env={"CSI_LOCAL_SHUTDOWN_GRACE": "9"})) == (9.0, "env")
    ratio = float(generated_config_map()["data"]["overprovision-ratio"])
    assert _shutdown_grace(PluginInvocation(  # any config.env key, read as the grace
        where="x", env={"CSI_LOCAL_SHUTDOWN_GRACE": None},
        config_keys={"CSI_LOCAL_SHUTDOWN_GRACE": "overprovision-ratio"})) == (
        ratio, "config.env")
