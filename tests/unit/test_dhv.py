"""The Nomad host volume plugin's pure logic: Nomad's environment, parameters,
configuration, names, tags and sizes. No processes (the unit guard forbids them)."""

from __future__ import annotations

import ast
import io
import json
import os
import sys
from pathlib import Path

import pytest

from csi_local import dhv, dhv_spec
from csi_local.dhv_spec import DhvError

VOL_ID = "e715fdf0-f8b7-a4bd-4565-f17e15b85f09"
MIB = 1 << 20
EXTENT = 4 * MIB


def create_env(**extra: str) -> dict[str, str]:
    env = {
        "DHV_OPERATION": "create",
        "DHV_VOLUMES_DIR": "/opt/nomad/data/host_volumes",
        "DHV_PLUGIN_DIR": "/opt/nomad/data/host_volume_plugins",
        "DHV_NODE_POOL": "default",
        "DHV_NAMESPACE": "default",
        "DHV_VOLUME_NAME": "scratch",
        "DHV_VOLUME_ID": VOL_ID,
        "DHV_NODE_ID": "node-1",
        "DHV_CAPACITY_MIN_BYTES": str(100 * MIB),
        "DHV_CAPACITY_MAX_BYTES": str(200 * MIB),
        "DHV_PARAMETERS": '{"fs_type":"xfs","mount_options":"noatime,nodev"}',
    }
    env.update(extra)
    return env


# --- the request ------------------------------------------------------------------


def test_create_request_from_nomads_environment() -> None:
    req = dhv_spec.parse_request("create", create_env())
    assert req.volume_id == VOL_ID
    assert req.path == f"/opt/nomad/data/host_volumes/{VOL_ID}"
    assert req.capacity_min == 100 * MIB and req.capacity_max == 200 * MIB
    assert req.parameters == dhv_spec.Parameters("xfs", ("noatime", "nodev"))
    assert req.lv_name.startswith("dhv-") and dhv_spec.is_dhv_lv_name(req.lv_name)


def test_delete_request_needs_no_capacity_and_ignores_parameters() -> None:
    env = create_env(DHV_OPERATION="delete", DHV_PARAMETERS='{"whatever":"x"}',
                     DHV_CREATED_PATH=f"/opt/nomad/data/host_volumes/{VOL_ID}")
    del env["DHV_CAPACITY_MIN_BYTES"], env["DHV_CAPACITY_MAX_BYTES"]
    req = dhv_spec.parse_request("delete", env)
    assert req.parameters is None
    assert req.created_path.endswith(VOL_ID)
    assert req.lv_name == dhv_spec.parse_request("create", create_env()).lv_name


@pytest.mark.parametrize("bad_id", ["", "../etc", "a/b", "-x", "a b", "x" * 129, "a..b", "é"])
def test_volume_ids_that_could_escape_are_refused(bad_id: str) -> None:
    with pytest.raises(DhvError, match="DHV_VOLUME_ID"):
        dhv_spec.parse_request("create", create_env(DHV_VOLUME_ID=bad_id))


def test_lv_name_is_a_hash_of_the_id_not_the_id() -> None:
    name = dhv_spec.lv_name_for(VOL_ID)
    assert VOL_ID not in name and len(name) == len("dhv-") + 32
    assert name != dhv_spec.lv_name_for(VOL_ID.upper())
    assert not name.startswith("csi-")


@pytest.mark.parametrize("key,value", [
    ("DHV_VOLUMES_DIR", "relative/dir"),
    ("DHV_VOLUMES_DIR", "/"),
    ("DHV_VOLUMES_DIR", ""),
    ("DHV_PLUGIN_DIR", "plugins"),
    ("DHV_CAPACITY_MIN_BYTES", "1GiB"),
    ("DHV_CAPACITY_MAX_BYTES", "-1"),
])
def test_bad_environment_values(key: str, value: str) -> None:
    with pytest.raises(DhvError, match=key):
        dhv_spec.parse_request("create", create_env(**{key: value}))


def test_min_above_max_is_refused() -> None:
    with pytest.raises(DhvError, match="exceeds"):
        dhv_spec.parse_request("create", create_env(DHV_CAPACITY_MIN_BYTES=str(300 * MIB)))


def test_operation_argument_and_variable_must_agree() -> None:
    with pytest.raises(DhvError, match="disagree"):
        dhv_spec.parse_request("delete", create_env())
    with pytest.raises(DhvError, match="unknown operation"):
        dhv_spec.parse_request("resize", create_env(DHV_OPERATION=""))


def test_plugin_dir_falls_back_to_the_executables_directory() -> None:
    env = create_env()
    del env["DHV_PLUGIN_DIR"]
    req = dhv_spec.parse_request("create", env, "/plugins/csi-local-dhv")
    assert req.plugin_dir == "/plugins"
    with pytest.raises(DhvError, match="DHV_PLUGIN_DIR"):
        dhv_spec.parse_request("create", env, "csi-local-dhv")


# --- parameters -------------------------------------------------------------------


@pytest.mark.parametrize("raw", ["", "null", "{}"])
def test_no_parameters(raw: str) -> None:
    assert dhv_spec.parse_parameters(raw) == dhv_spec.Parameters(None, ())


@pytest.mark.parametrize("raw,message", [
    ('{"size":"1G"}', "unknown parameter.*'size'"),
    ('{"fs_type":"ntfs"}', "unsupported fs_type 'ntfs'"),
    ('{"fs_type":4}', "must be a string"),
    ('["ext4"]', "JSON object"),
    ("{not json", "not JSON"),
    ('{"mount_options":"noatime,remount"}', "not allowed"),
    ('{"mount_options":"bind"}', "not allowed"),
    ('{"mount_options":"-o x"}', "invalid mount option"),
    ('{"mount_options":"a;b"}', "invalid mount option"),
])
def test_bad_parameters(raw: str, message: str) -> None:
    with pytest.raises(DhvError, match=message):
        dhv_spec.parse_parameters(raw)


def test_mount_options_split_and_trimmed() -> None:
    params = dhv_spec.parse_parameters('{"mount_options":" noatime , ,discard "}')
    assert params.mount_options == ("noatime", "discard")


# --- configuration ----------------------------------------------------------------


def test_config_defaults() -> None:
    cfg = dhv_spec.parse_config('{"volume_group":"vg0","thin_pool":"pool"}')
    assert cfg.fs_type == "ext4"
    assert cfg.lock_dir == "/run/lock/csi-local"  # the CSI plugin's: shared locks
    assert cfg.overprovision_ratio == 1.0 and cfg.default_size == 1 << 30
    assert cfg.timeout_seconds < 60  # Nomad kills create/delete at 60 s


def test_config_full_and_sizes() -> None:
    cfg = dhv_spec.parse_config(json.dumps({
        "volume_group": "vg0", "thin_pool": "pool", "fs_type": "xfs",
        "lock_dir": "/run/lock/x", "overprovision_ratio": 2, "default_size": "512M",
        "timeout_seconds": 30,
    }))
    assert cfg.default_size == 512 * MIB and cfg.fs_type == "xfs"
    assert dhv_spec.parse_config(json.dumps(cfg.to_json())) == cfg


@pytest.mark.parametrize("data,message", [
    ({"volume_group": "vg0"}, "missing thin_pool"),
    ({"volume_group": "vg0", "thin_pool": "p", "colour": "red"}, "unknown key.*colour"),
    ({"volume_group": "-vg", "thin_pool": "p"}, "not an LVM name"),
    ({"volume_group": "vg/x", "thin_pool": "p"}, "not an LVM name"),
    ({"volume_group": "vg", "thin_pool": "p", "fs_type": "zfs"}, "unsupported fs_type"),
    ({"volume_group": "vg", "thin_pool": "p", "lock_dir": "locks"}, "absolute"),
    ({"volume_group": "vg", "thin_pool": "p", "overprovision_ratio": 0.5}, ">= 1.0"),
    ({"volume_group": "vg", "thin_pool": "p", "overprovision_ratio": "2"}, ">= 1.0"),
    ({"volume_group": "vg", "thin_pool": "p", "default_size": "lots"}, "invalid size"),
    ({"volume_group": "vg", "thin_pool": "p", "timeout_seconds": 0}, "timeout_seconds"),
])
def test_bad_config(data: dict[str, object], message: str) -> None:
    with pytest.raises(DhvError, match=message):
        dhv_spec.parse_config(json.dumps(data), "/plugins/csi-local-dhv.json")


def test_config_file_is_named_after_the_plugin_id(tmp_path: Path) -> None:
    (tmp_path / "csi-local-dhv.json").write_text('{"volume_group":"a","thin_pool":"p"}')
    (tmp_path / "fast-pool.json").write_text('{"volume_group":"b","thin_pool":"p"}')
    assert dhv_spec.load_config(str(tmp_path), str(tmp_path / "fast-pool")).volume_group == "b"
    assert dhv_spec.load_config(str(tmp_path), str(tmp_path / "csi-local-dhv")).volume_group \
        == "a"
    # another name without its own file falls back to csi-local-dhv.json
    assert dhv_spec.load_config(str(tmp_path), str(tmp_path / "other")).volume_group == "a"


def test_missing_config_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(DhvError, match=r"no configuration at .*csi-local-dhv\.json"):
        dhv_spec.load_config(str(tmp_path), str(tmp_path / "csi-local-dhv"))


# --- tags and sizes ------------------------------------------------------------------


def test_tags_are_in_their_own_namespace() -> None:
    req = dhv_spec.parse_request("create", create_env(DHV_VOLUME_NAME="my vol/ü"))
    tags = dhv_spec.volume_tags(req, "xfs")
    assert all(t.startswith("csi-local-dhv.") for t in tags)
    assert not any(t.startswith("csi-local.") for t in tags)
    assert f"csi-local-dhv.id={VOL_ID}" in tags and "csi-local-dhv.fs=xfs" in tags
    name_tag = next(t for t in tags if t.startswith("csi-local-dhv.name="))
    assert dhv_spec.decode_hex_tag(name_tag.split("=", 1)[1]) == "my vol/ü"
    from csi_local.lvm import check_tag

    for tag in tags:
        check_tag(tag)  # every tag is one LVM accepts


def test_size_for_new_volume() -> None:
    assert dhv_spec.size_for_new(100 * MIB + 1, 0, EXTENT, default=1 << 30) == 104 * MIB
    assert dhv_spec.size_for_new(0, 0, EXTENT, default=1 << 30) == 1 << 30
    assert dhv_spec.size_for_new(0, 200 * MIB, EXTENT, default=1 << 30) == 200 * MIB
    assert dhv_spec.size_for_new(10 * MIB, 0, EXTENT, default=1 << 30,
                                 minimum=300 * MIB) == 300 * MIB
    with pytest.raises(DhvError, match="no size between"):
        dhv_spec.size_for_new(10 * MIB, 100 * MIB, EXTENT, default=1 << 30, minimum=300 * MIB)
    with pytest.raises(DhvError, match="whole extents"):
        dhv_spec.size_for_new(MIB, 2 * MIB, EXTENT, default=1 << 30)


def test_resize_target() -> None:
    cur = 400 * MIB
    assert dhv_spec.resize_target(cur, 100 * MIB, 0, EXTENT) == cur
    assert dhv_spec.resize_target(cur, cur, cur, EXTENT) == cur
    assert dhv_spec.resize_target(cur, 500 * MIB + 1, 0, EXTENT) == 504 * MIB
    with pytest.raises(DhvError, match="shrinking a volume is not supported"):
        dhv_spec.resize_target(cur, 100 * MIB, 200 * MIB, EXTENT)
    with pytest.raises(DhvError, match="within capacity_max"):
        dhv_spec.resize_target(cur, 500 * MIB + 1, 502 * MIB, EXTENT)


# --- the executable's entry point ---------------------------------------------------


def run_main(argv: list[str], monkeypatch: pytest.MonkeyPatch,
             env: dict[str, str] | None = None) -> tuple[int, str]:
    out = io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    monkeypatch.setattr(os, "environ", dict(env or {}))
    return dhv.main(argv), out.getvalue()


def test_fingerprint_prints_a_version(monkeypatch: pytest.MonkeyPatch) -> None:
    rc, out = run_main(["/plugins/csi-local-dhv", "fingerprint"], monkeypatch,
                       {"DHV_OPERATION": "fingerprint"})
    assert rc == 0
    version = json.loads(out)["version"]
    assert [int(x) for x in version.split(".")]  # go-version accepts it


def test_fingerprint_path_does_not_load_the_heavy_modules() -> None:
    # Module-level imports run before fingerprint answers: stdlib and the version only;
    # grpc, protobuf, pyudev and sh come in with create/delete.
    tree = ast.parse(Path(dhv.__file__).read_text())
    top_level = sorted(
        alias.name if isinstance(node, ast.Import) else f"{node.module}.{alias.name}"
        for node in tree.body if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
    )
    assert top_level == ["__future__.annotations", "csi_local.__version__", "os", "sys"]


def test_unknown_parameter_fails_with_json_before_any_work(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / "csi-local-dhv.json").write_text('{"volume_group":"vg","thin_pool":"p"}')
    env = create_env(DHV_PLUGIN_DIR=str(tmp_path), DHV_PARAMETERS='{"colour":"red"}')
    rc, out = run_main([str(tmp_path / "csi-local-dhv"), "create"], monkeypatch, env)
    assert rc == 1
    assert "unknown parameter" in json.loads(out)["error"]


def test_unknown_operation(monkeypatch: pytest.MonkeyPatch) -> None:
    rc, out = run_main(["csi-local-dhv", "resize"], monkeypatch)
    assert rc == 1 and "unknown operation" in json.loads(out)["error"]


def test_install_writes_shim_and_config(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    rc, out = run_main(["csi-local-dhv", "install", "--plugin-dir", str(tmp_path),
                        "--volume-group", "vg0", "--thin-pool", "pool", "--fs-type", "xfs",
                        "--python", "/usr/bin/python3"], monkeypatch)
    assert rc == 0, out
    shim = tmp_path / "csi-local-dhv"
    text = shim.read_text()
    assert text.startswith("#!/usr/bin/python3 -I\n")
    assert "from csi_local.dhv import main" in text
    assert os.stat(shim).st_mode & 0o777 == 0o755
    conf = tmp_path / "csi-local-dhv.json"
    assert os.stat(conf).st_mode & 0o111 == 0  # Nomad fingerprints every executable
    cfg = dhv_spec.load_config(str(tmp_path), str(shim))
    assert (cfg.volume_group, cfg.thin_pool, cfg.fs_type) == ("vg0", "pool", "xfs")
    assert sorted(os.listdir(tmp_path)) == ["csi-local-dhv", "csi-local-dhv.json"]


def test_install_refuses_an_interpreter_a_shebang_cannot_hold() -> None:
    with pytest.raises(DhvError):
        dhv.shim_text("/opt/my python/bin/python3", "csi-local-dhv")
    with pytest.raises(DhvError):
        dhv.shim_text("python3", "csi-local-dhv")
