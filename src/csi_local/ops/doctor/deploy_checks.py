"""Doctor's checks of the deployment: the state and lock directories, the
CSI socket, the mount propagation kubelet needs, and the snapshot-metadata
sidecar's TLS certificate (its dates, and the host it is for).
"""

from __future__ import annotations

import os
import re
import stat
from datetime import datetime, timedelta

from csi_local import config as config_mod
from csi_local.ops.doctor.system import FAIL, OK, WARN, Check, System
from csi_local.ops.x509 import AltNames, CertificateError, pem_certificate

KUBELET_DIR = "/var/lib/kubelet"


def check_directory(system: System, label: str, path: str, flag: str) -> Check:
    """Exists (or can be made), a real directory, owned by root, not world-writable."""
    label = f"{label} {path}"
    st = system.lstat(path)
    if st is None:
        parent = os.path.dirname(path.rstrip("/")) or "/"
        while parent != "/" and system.lstat(parent) is None:
            parent = os.path.dirname(parent)
        pst = system.lstat(parent)
        if pst is not None and stat.S_ISDIR(pst.st_mode) and system.writable(parent):
            return Check(label, OK, "missing; the plugin makes it at start")
        return Check(label, FAIL, f"missing, and cannot be made under {parent}",
                     f"mkdir -p -m 0700 {path}, or choose another {flag}")
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        return Check(label, FAIL, "is not a directory (a symlink?)",
                     f"remove it, or choose another {flag}")
    problems = []
    if st.st_uid != system.root_uid:
        problems.append(f"owned by uid {st.st_uid}, not root")
    if st.st_mode & stat.S_IWOTH:
        problems.append(f"world-writable (mode {stat.S_IMODE(st.st_mode):04o})")
    if problems:
        return Check(label, FAIL, "; ".join(problems),
                     f"chown root:root {path} && chmod 0700 {path}")
    return Check(label, OK, f"mode {stat.S_IMODE(st.st_mode):04o}, owned by root")


def check_socket(system: System, endpoint: str) -> Check:
    label = "CSI socket"
    try:
        path = config_mod.socket_path(endpoint)
    except config_mod.ConfigError as err:
        return Check(label, FAIL, str(err), "give --endpoint unix:///absolute/path")
    st = system.lstat(path)
    if st is None:
        return Check(label, WARN, f"{path} does not exist: the plugin is not running",
                     "start the plugin (csi-local serve), or give --endpoint its socket")
    if not stat.S_ISSOCK(st.st_mode):
        return Check(label, FAIL, f"{path} is not a socket",
                     "remove it; the plugin makes its socket at start")
    refused = system.connect(path)
    if refused is not None:
        return Check(label, WARN, f"{path}: nothing answers ({refused}): the plugin is not "
                     "running (a stale socket is removed at its start)",
                     "start the plugin (csi-local serve)")
    return Check(label, OK, f"{path} answers")


_OCTAL = re.compile(r"\\([0-7]{3})")


def _unescape(field: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as \\ooo."""
    return _OCTAL.sub(lambda m: chr(int(m.group(1), 8)), field)


def parse_propagation(mountinfo: str) -> list[tuple[str, list[str]]]:
    """[(mount point, optional fields)] of /proc/self/mountinfo, in mount order."""
    rows = []
    for line in mountinfo.splitlines():
        left, sep, _ = line.partition(" - ")
        fields = left.split()
        if not sep or len(fields) < 6:
            continue
        rows.append((_unescape(fields[4]), fields[6:]))
    return rows


def _contains(mount_point: str, path: str) -> bool:
    return mount_point == "/" or path == mount_point or path.startswith(mount_point + "/")


def check_propagation(system: System, path: str = KUBELET_DIR) -> Check:
    label = f"mount propagation of {path}"
    if not system.exists(path):
        return Check(label, OK, f"no {path}: not a Kubernetes node, skipped")
    text = system.read("/proc/self/mountinfo")
    if text is None:
        return Check(label, WARN, "cannot read /proc/self/mountinfo", "mount /proc")
    rows = [r for r in parse_propagation(text) if _contains(r[0], path)]
    if not rows:
        return Check(label, WARN, "no mount contains it in /proc/self/mountinfo", "")
    longest = max(len(r[0]) for r in rows)
    point, optional = [r for r in rows if len(r[0]) == longest][-1]
    shared = [f for f in optional if f.startswith("shared:")]
    if shared:
        return Check(label, OK, f"on mount {point}, {' '.join(optional)}")
    kind = " ".join(optional) or "private"
    return Check(label, FAIL, f"on mount {point}, which is not shared ({kind}): mounts the "
                 "plugin makes there are invisible to kubelet",
                 "mount --make-rshared / on the host (systemd does by default), and mount "
                 f"{path} into the plugin's container with mountPropagation: Bidirectional")


# The Secret the snapshot-metadata overlay mounts (deploy/kubernetes/examples/
# snapshot-metadata), for the fixes; and how early an expiry is a warning.
SNAPSHOT_METADATA_SECRET = "csi-local-snapshot-metadata-tls"  # noqa: S105 - a name
CERT_WARNING_DAYS = config_mod.DEFAULT_CERT_WARNING_DAYS
SNAPSHOT_METADATA_ADDRESS = config_mod.DEFAULT_SNAPSHOT_METADATA_ADDRESS
_CERT_FIX = (f"create the kubernetes.io/tls Secret {SNAPSHOT_METADATA_SECRET} (namespace "
             "csi-local), best with the cert-manager Certificate of docs/snapshot-metadata.md "
             "(\"TLS with cert-manager\"), which renews it; kubelet then updates this file "
             "and the sidecar loads it")


def _date(when: datetime) -> str:
    return when.strftime("%Y-%m-%d %H:%M:%S UTC")


def _names(names: AltNames) -> str:
    shown = [f"DNS:{n}" for n in names.dns] + [f"IP:{a}" for a in names.ips]
    return ", ".join(shown) if shown else "none"


def check_tls_certificate(system: System, path: str, *,
                          warning_days: int = CERT_WARNING_DAYS,
                          address: str = SNAPSHOT_METADATA_ADDRESS) -> Check:
    """The snapshot-metadata sidecar's certificate (the Secret's tls.crt, as
    mounted where doctor runs): there, a certificate, naming the host of
    `address` (the SnapshotMetadataService's spec.address, host:port) among
    its subject alternative names, and not expired nor expiring within
    `warning_days`. Without it the sidecar does not start (changed-block
    tracking is down on the node); expired, or for another name, every
    client refuses it."""
    label = "snapshot-metadata TLS certificate"
    try:
        text = system.read_bytes(path).decode("ascii", errors="replace")
    except FileNotFoundError:
        return Check(label, FAIL, f"{path} does not exist: the Secret "
                     f"{SNAPSHOT_METADATA_SECRET} (key tls.crt) is missing, and the "
                     "snapshot-metadata sidecar cannot start", _CERT_FIX)
    except OSError as err:
        return Check(label, FAIL, f"{path} cannot be read: {err.strerror or err}",
                     "run doctor as root in the plugin's container")
    try:
        valid, names = pem_certificate(text)
    except CertificateError as err:
        return Check(label, FAIL, f"{path} is not a PEM certificate: {err}",
                     f"put the sidecar's certificate (PEM) into the Secret "
                     f"{SNAPSHOT_METADATA_SECRET} as tls.crt; {_CERT_FIX}")
    now = system.now()
    renew = ("renew it: cert-manager renews a Certificate before it expires (renewBefore); "
             "a certificate made with openssl: docs/snapshot-metadata.md, \"Renewal\"")
    if valid.not_after <= now:
        return Check(label, FAIL, f"{path} expired on {_date(valid.not_after)}: backup "
                     "clients refuse the sidecar", renew)
    host = config_mod.parse_listen_address(address)[0]
    if not names.covers(host):
        return Check(label, FAIL, f"{path} is not for {host}, the host of the snapshot "
                     f"metadata address {address}: its subject alternative names are "
                     f"{_names(names)}, and backup clients that dial the address refuse the "
                     "sidecar", f"issue it for {host} (the cert-manager Certificate's "
                     "dnsNames, or subjectAltName in the openssl commands of "
                     "docs/snapshot-metadata.md); or, when the SnapshotMetadataService's "
                     "spec.address is another, give doctor that (--snapshot-metadata-address)")
    if valid.not_before > now:
        return Check(label, WARN, f"{path} is not valid before {_date(valid.not_before)}: "
                     "clients refuse it until then (or this node's clock is behind)",
                     "check the node's clock (timedatectl), or the certificate's dates")
    days = (valid.not_after - now).days
    if valid.not_after - now < timedelta(days=warning_days):
        return Check(label, WARN, f"{path} expires on {_date(valid.not_after)}, in {days} "
                     f"day(s)", renew)
    return Check(label, OK, f"{path} for {host}, valid until {_date(valid.not_after)} "
                 f"({days} days)")
