"""Host-side unit tests of the sanity suite's helpers and command line (no plugin needed)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO))

from sanity import csi  # noqa: E402
from sanity.__main__ import build_parser, pytest_args  # noqa: E402


@pytest.mark.parametrize(("text", "expected"), [
    ("1024", 1024), ("64M", 64 << 20), ("1G", 1 << 30), ("512K", 512 << 10),
    ("2Gi", 2 << 30), ("3MiB", 3 << 20), ("1t", 1 << 40),
])
def test_parse_size(text: str, expected: int) -> None:
    assert csi.parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "M", "1.5G", "-1", "10X"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        csi.parse_size(text)


def test_normalize_endpoint() -> None:
    assert csi.normalize_endpoint("/run/csi.sock") == "unix:///run/csi.sock"
    assert csi.normalize_endpoint("unix:///run/x.sock") == "unix:///run/x.sock"
    assert csi.normalize_endpoint("localhost:10000") == "localhost:10000"


def test_mountinfo_unescape() -> None:
    assert csi._unescape(r"/mnt/a\040b\011c") == "/mnt/a b\tc"


def test_root_is_a_mount_point_and_tmp_file_is_not(tmp_path: Path) -> None:
    assert csi.is_mount_point("/")
    assert not csi.is_mount_point(tmp_path)
    assert csi.mounts_under(tmp_path) == []


def test_volume_capability_access_types() -> None:
    block = csi.volume_capability("block")
    mount = csi.volume_capability("mount", "xfs", "SINGLE_NODE_SINGLE_WRITER")
    assert block.HasField("block") and not block.HasField("mount")
    assert mount.mount.fs_type == "xfs"
    assert mount.access_mode.mode == mount.access_mode.SINGLE_NODE_SINGLE_WRITER


def test_pytest_args_isolate_the_suite() -> None:
    ns, extra = build_parser().parse_known_args([
        "--endpoint", "unix:///x.sock", "--controller-endpoint", "unix:///c.sock",
        "--junit-xml", "out.xml", "--idempotency-repeats", "5", "--cbt-granularity", "4M",
        "-k", "identity"])
    args = pytest_args(ns, extra)
    assert args[args.index("-c") + 1] == "/dev/null"
    assert args[args.index("--confcutdir") + 1].endswith("sanity")
    assert "no:cacheprovider" in args
    assert args[args.index("--controller-endpoint") + 1] == "unix:///c.sock"
    assert args[args.index("--junit-xml") + 1] == "out.xml"
    assert args[args.index("--idempotency-repeats") + 1] == "5"
    assert args[args.index("--cbt-granularity") + 1] == "4M"
    assert args[-2:] == ["-k", "identity"]


def _sanity(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "src"), str(REPO)]))
    return subprocess.run([sys.executable, "-m", "sanity", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120, check=False)


def test_cli_requires_endpoint() -> None:
    proc = _sanity()
    assert proc.returncode != 0
    assert "--endpoint" in proc.stderr


def test_cli_unreachable_endpoint_fails(tmp_path: Path) -> None:
    proc = _sanity("--endpoint", f"unix://{tmp_path}/none.sock", "--rpc-timeout", "2",
                   "-k", "test_probe", "--junit-xml", str(tmp_path / "j.xml"))
    assert proc.returncode != 0, proc.stdout
    assert (tmp_path / "j.xml").exists()
    assert "CSI sanity summary" in proc.stdout


def test_cli_rejects_bad_sizes() -> None:
    proc = _sanity("--endpoint", "unix:///x.sock", "--volume-size", "lots")
    assert proc.returncode == 2 and "invalid size" in proc.stderr


def test_extents_set_operations() -> None:
    from sanity import extents as x
    assert x.normalize([(5, 9), (0, 2), (2, 3), (8, 12), (20, 20)]) == [(0, 3), (5, 12)]
    assert x.subtract([(0, 10), (20, 30)], [(2, 4), (8, 22)]) == [(0, 2), (4, 8), (22, 30)]
    assert x.subtract([(0, 10)], []) == [(0, 10)]
    assert x.intersect([(0, 10), (20, 30)], [(5, 25)]) == [(5, 10), (20, 25)]
    assert x.dilate([(10, 20), (100, 101)], 15, 0, 110) == [(0, 35), (85, 110)]
    assert x.total([(0, 10), (5, 15)]) == 15
    assert x.describe([]) == "nothing"


@pytest.mark.parametrize("g", [4096, 64 << 10, 1 << 20])
def test_snapshot_metadata_layout_keeps_unchanged_data_far_from_changes(g: int) -> None:
    from sanity import extents as x
    from sanity.tests.test_snapshot_metadata import MIN_GRANULES, layout
    capacity = MIN_GRANULES * g
    pattern1, pattern2, discard = layout(capacity, g)
    everything = [*pattern1, *pattern2, discard]
    assert all(0 <= s < e <= capacity for s, e in everything)
    assert discard[0] % g == 0 and discard[1] % g == 0
    assert max(e for _, e in pattern1) == capacity  # one region reaches the last byte
    assert any(s % 2 for s, _ in pattern1) and any(s % 2 for s, _ in pattern2)
    # Pattern 1 data left alone, far from every change, is what a delta must not report.
    near_changes = x.dilate([*pattern2, discard], g, 0, capacity)
    untouched = x.subtract(pattern1, near_changes)
    assert x.total(untouched) > 3000 + 777  # the first and third regions at least
    assert x.subtract(pattern2, pattern1) != []  # pattern 2 also writes new regions


def test_cbt_granularity_option() -> None:
    from sanity.plugin import cbt_granularity
    assert cbt_granularity("1M") == 1 << 20
    assert cbt_granularity("64K") == 64 << 10
    for bad in ("0", "1000", "lots"):
        with pytest.raises(pytest.UsageError):
            cbt_granularity(bad)


# What puts a test's outcome in the hands of --access-type: it stages or publishes
# a volume of that type, or writes and reads its data through the node.
_NODE_DATA_PATH = {"make_available", "write_data", "read_data", "NodePublishVolume"}


def _marked_access_type(decorators: list[ast.expr]) -> bool:
    return any(isinstance(d, ast.Attribute) and d.attr == "access_type" for d in decorators)


def test_every_test_through_the_node_is_marked_access_type() -> None:
    """The block pass runs only ``-m access_type``: a data-path test left unmarked
    would never run with block volumes."""
    from sanity import TESTS_DIR

    unmarked, marked = [], 0
    for path in sorted(Path(TESTS_DIR).glob("test_*.py")):
        tree = ast.parse(path.read_text())
        module_marked = any(
            isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "pytestmark"
                                              for t in n.targets)
            and isinstance(n.value, ast.Attribute) and n.value.attr == "access_type"
            for n in tree.body)
        for fn in tree.body:
            if not (isinstance(fn, ast.FunctionDef) and fn.name.startswith("test_")):
                continue
            called = {n.attr if isinstance(n, ast.Attribute) else n.id
                      for n in ast.walk(fn) if isinstance(n, (ast.Attribute, ast.Name))}
            if module_marked or _marked_access_type(fn.decorator_list):
                marked += 1
            elif called & _NODE_DATA_PATH:
                unmarked.append(f"{path.name}::{fn.name}")
    assert not unmarked, f"node data-path tests not marked access_type: {unmarked}"
    assert marked >= 15
