"""Validated, immutable configuration of a plugin process."""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass

from csi_local.host.filesystem_rules import SUPPORTED_FS
from csi_local.host.locks import DEFAULT_LOCK_DIR
from csi_local.storage.lvm import check_name
from csi_local.volumes.device_classes import DeviceClasses, single_class
from csi_local.volumes.freezes import DEFAULT_FREEZE_LIMIT as DEFAULT_FREEZE_LIMIT
from csi_local.volumes.pool import PoolPolicy
from csi_local.volumes.sizes import parse_size as _parse_size

DEFAULT_DRIVER_NAME = "lvm.csi-local.dev"
DEFAULT_ENDPOINT = "unix:///run/csi-local/csi.sock"
DEFAULT_STATE_DIR = "/var/lib/csi-local"
# Days before a certificate's expiry from which doctor warns (cert-manager
# renews 30 days before by default, so a warning means renewal is failing).
DEFAULT_CERT_WARNING_DAYS = 14
# spec.address of the SnapshotMetadataService the snapshot-metadata example
# ships (deploy/kubernetes/components/snapshot-metadata): where backup clients
# dial the sidecar, so the host its certificate must name.
DEFAULT_SNAPSHOT_METADATA_ADDRESS = "csi-local-snapshot-metadata.csi-local.svc:6443"
# Seconds the RPCs still running at SIGTERM get before the plugin stops. Below
# every shipped kill timeout, with time to spare for the rest of the stop (the
# metrics server, the lvm shell, the socket): Nomad's kill_timeout of 30 s
# (the most a client allows by default) and Kubernetes' 60 s
# (terminationGracePeriodSeconds). tests/deploy/test_plugin_flags.py holds
# the two apart.
DEFAULT_SHUTDOWN_GRACE = 20.0
_DRIVER_RE = re.compile(r"[a-z0-9]([a-z0-9-]*[a-z0-9])?(\.[a-z0-9]([a-z0-9-]*[a-z0-9])?)+")


class ConfigError(ValueError):
    pass


def parse_size(text: str) -> int:
    """Bytes from "512M", "1G", "1GiB", "4096" (sizes.parse_size); ConfigError."""
    try:
        return _parse_size(text)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def socket_path(endpoint: str) -> str:
    if not endpoint.startswith("unix://"):
        raise ConfigError(f"endpoint must be unix:///absolute/path, not {endpoint!r}")
    path = endpoint[len("unix://"):]
    if not path.startswith("/"):
        raise ConfigError(f"endpoint must be unix:///absolute/path, not {endpoint!r}")
    return path


def absolute_path(path: str, what: str) -> str:
    """`path`, which must be absolute: the rule of the state and lock
    directories for serve, status and doctor alike (a relative one would
    depend on where the process was started)."""
    if not path or "\0" in path or not os.path.isabs(path):
        raise ConfigError(f"{what} must be an absolute path, not {path!r}")
    return path


def seconds(value: float, what: str) -> float:
    """`value`, a finite number of seconds above 0: nan compares false with
    everything, and inf would never end a wait (a command never killed)."""
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(f"{what} must be a finite number of seconds above 0, not {value!r}")
    return value


def parse_listen_address(text: str) -> tuple[str, int]:
    """(host, port) from "host:port", "[v6]:port" or ":port" (host "": every
    IPv4 address); ConfigError on any other form."""
    host, sep, port = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if (not sep or not port.isascii() or not port.isdigit() or not 0 < int(port) < 65536
            or any(c.isspace() or c in "[]/" for c in host)):
        raise ConfigError(f"metrics address must be host:port or :port, not {text!r}")
    return host, int(port)


@dataclass(frozen=True)
class Config:
    endpoint: str
    node_id: str
    # One class by flags (--volume-group/--thin-pool), or device classes from
    # a file (--config, csi_local.volumes.device_classes): exactly one of the two.
    volume_group: str = ""
    thin_pool: str = ""
    device_classes: DeviceClasses | None = None
    state_dir: str = DEFAULT_STATE_DIR
    driver_name: str = DEFAULT_DRIVER_NAME
    overprovision_ratio: float = 1.0
    max_volumes_per_node: int = 0
    default_fs_type: str = "ext4"
    node_expansion_only: bool = False
    command_timeout: float = 120.0
    # Seconds any freeze window may keep file systems frozen (volumes/freezes.py):
    # a group snapshot's members, a snapshot's or clone's encrypted source.
    group_freeze_timeout: float = DEFAULT_FREEZE_LIMIT
    # LVM's changing commands in one `lvm` shell kept running (storage/lvm_shell.py).
    lvm_shell: bool = True
    lock_dir: str = DEFAULT_LOCK_DIR
    backing_file: str | None = None
    backing_size: int | None = None
    pool_data_limit_percent: float = 90.0
    pool_metadata_limit_percent: float = 90.0
    pool_autoextend_threshold_percent: float = 0.0
    pool_autoextend_percent: float = 20.0
    pool_monitor_interval: float = 10.0
    shutdown_grace: float = DEFAULT_SHUTDOWN_GRACE
    metrics_address: str = ""  # host:port or :port of the Prometheus endpoint; "": off
    # Kubernetes' central csi-resizer copy: ControllerModifyVolume validates
    # and records nothing; the node plugins converge (docs/qos.md).
    modify_validate_only: bool = False
    # Seconds between the node's rereads of its published volumes' IO limits:
    # the bound on how long a change takes to reach io.max (docs/qos.md).
    qos_reconcile_interval: float = 10.0
    cgroup_root: str = "/sys/fs/cgroup"  # where the cgroup v2 hierarchy is mounted

    def __post_init__(self) -> None:
        socket_path(self.endpoint)
        if not self.node_id or len(self.node_id) > 128:
            raise ConfigError("node id must be 1 to 128 characters")
        if self.device_classes is not None:
            if self.volume_group or self.thin_pool:
                raise ConfigError("give either a configuration file (--config) or "
                                  "--volume-group and --thin-pool, not both")
        else:
            if not self.volume_group or not self.thin_pool:
                raise ConfigError("--volume-group and --thin-pool are required (or a "
                                  "configuration file with device classes: --config)")
            try:
                check_name(self.volume_group)
                check_name(self.thin_pool)
            except ValueError as err:
                raise ConfigError(str(err)) from None
        if not _DRIVER_RE.fullmatch(self.driver_name) or len(self.driver_name) > 63:
            raise ConfigError(
                f"driver name {self.driver_name!r} must be a domain name of at most 63 characters"
            )
        if not self.overprovision_ratio >= 1.0 or not math.isfinite(self.overprovision_ratio):
            raise ConfigError("overprovision ratio must be >= 1.0")
        if self.max_volumes_per_node < 0:
            raise ConfigError("max volumes per node must be >= 0")
        if self.default_fs_type not in SUPPORTED_FS:
            raise ConfigError(f"unsupported default fs type {self.default_fs_type!r}")
        seconds(self.command_timeout, "the command timeout")
        seconds(self.group_freeze_timeout, "the group freeze timeout")
        absolute_path(self.state_dir, "the state directory")
        absolute_path(self.lock_dir, "the lock directory")
        if (self.backing_file is None) != (self.backing_size is None):
            raise ConfigError("--backing-file and --backing-size go together")
        if self.backing_file is not None and self.device_classes is not None:
            raise ConfigError("--backing-file makes one VG and pool for the flags' class; "
                              "it does not go with --config")
        if self.backing_file is not None and not os.path.isabs(self.backing_file):
            raise ConfigError("--backing-file must be an absolute path")
        try:
            self.pool_policy  # noqa: B018 - validates the pool flags together
        except ValueError as err:
            raise ConfigError(f"pool flags: {err}") from None
        seconds(self.pool_monitor_interval, "the pool monitor interval")
        seconds(self.shutdown_grace, "the shutdown grace")
        seconds(self.qos_reconcile_interval, "the QoS reconcile interval")
        absolute_path(self.cgroup_root, "the cgroup root")
        if self.metrics_address:
            parse_listen_address(self.metrics_address)

    @property
    def pool_policy(self) -> PoolPolicy:
        return PoolPolicy(
            data_limit=self.pool_data_limit_percent,
            metadata_limit=self.pool_metadata_limit_percent,
            autoextend_threshold=self.pool_autoextend_threshold_percent,
            autoextend_percent=self.pool_autoextend_percent,
        )

    @property
    def classes(self) -> DeviceClasses:
        """The node's device classes: the file's, or the one the flags define."""
        if self.device_classes is not None:
            return self.device_classes
        return single_class(self.volume_group, self.thin_pool,
                            overprovision_ratio=self.overprovision_ratio,
                            default_fs_type=self.default_fs_type)

    @property
    def socket(self) -> str:
        return socket_path(self.endpoint)

    @property
    def topology_key(self) -> str:
        return f"topology.{self.driver_name}/node"
