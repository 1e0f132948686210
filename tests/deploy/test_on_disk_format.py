"""docs/on-disk-format.md names everything the code leaves on a node that
another version may meet: each LV tag, LV name prefix and file name the code
defines, and each field of the state file, as the code has them (its
constants and its own rendering of a record), never a list kept here. A tag
or field added to the code without its row fails this.
"""

from __future__ import annotations

import ast
import importlib
import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from csi_local.nodestate import state_file
from csi_local.volumes import host_volume_names, naming
from csi_local.volumes.node_records import AccessType, Publish, Staging, VolumeRecord
from tests.deploy._deploy import REPO

DOC = REPO / "docs" / "on-disk-format.md"
SRC = REPO / "src" / "csi_local"
# The names of the constants that hold what the code writes on the node: LV
# tags (TAG_*), LV name and file name prefixes (*_PREFIX) and file names (*_FILE).
ON_DISK_NAME = re.compile(r"TAG_\w+|\w+_PREFIX|\w+_FILE")


def _text() -> str:
    return DOC.read_text()


def _constants() -> Iterator[tuple[str, str, str]]:
    """(module, constant, value) of every module-level string constant of the
    package whose name says it is written on the node."""
    for path in sorted(SRC.rglob("*.py")):
        if "_gen" in path.parts:
            continue
        names = []
        for node in ast.parse(path.read_text()).body:
            targets = (node.targets if isinstance(node, ast.Assign)
                       else [node.target] if isinstance(node, ast.AnnAssign) else [])
            names += [t.id for t in targets
                      if isinstance(t, ast.Name) and ON_DISK_NAME.fullmatch(t.id)]
        if not names:
            continue
        parts = path.relative_to(SRC.parent).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        loaded = importlib.import_module(module)
        for name in names:
            value = getattr(loaded, name)
            if isinstance(value, str):
                yield module, name, value


CONSTANTS = list(_constants())


def test_the_scan_finds_the_constants() -> None:
    """The scan sees the places it guards (one that found nothing would pass)."""
    found = {(m, n) for m, n, _ in CONSTANTS}
    assert ("csi_local.volumes.naming", "TAG_KIND") in found
    assert ("csi_local.volumes.host_volume_names", "TAG_FORMAT") in found
    assert ("csi_local.nodestate.state_file", "STATE_FILE") in found
    assert ("csi_local.storage.lvm_shell", "PROFILE_FILE") in found
    assert len(CONSTANTS) >= 40, CONSTANTS


@pytest.mark.parametrize(("module", "name", "value"), CONSTANTS,
                         ids=[f"{m.rsplit('.', 1)[-1]}.{n}" for m, n, _ in CONSTANTS])
def test_every_on_disk_name_is_documented(module: str, name: str, value: str) -> None:
    """Each tag, prefix and file name, in backquotes (a prefix may go on:
    `csi-v-<32 hex>`, `formatting.<lv_uuid>`)."""
    assert f"`{value}" in _text(), f"{module}.{name} = {value!r} is not in {DOC.name}"


def _fields(value: object) -> Iterator[str]:
    """Every key of every JSON object in `value`, at any depth."""
    if isinstance(value, dict):
        for key, inner in value.items():
            yield str(key)
            yield from _fields(inner)
    elif isinstance(value, list):
        for inner in value:
            yield from _fields(inner)


VOLUME_ID, TARGET, TARGET_FLAGS = "csi-v-x", "/target-a", "/target-b"


def _state_fields() -> set[str]:
    """The field names of a state file that holds every kind of record, as the
    code renders it: the volume's ID and the publish targets are data."""
    record = VolumeRecord(
        VOLUME_ID, Staging("/stage", AccessType.MOUNT, "ext4", ("noatime",), 1, True),
        {TARGET: Publish(readonly=True, access_mode=1, flags_known=False),
         TARGET_FLAGS: Publish(readonly=False, access_mode=1, mount_flags=("ro",))})
    rendered = json.loads(state_file.render({VOLUME_ID: record}))
    return set(_fields(rendered)) - {VOLUME_ID, TARGET, TARGET_FLAGS}


def test_the_state_fields_are_found() -> None:
    assert {"version", "volumes", "staging", "publishes", "flags_known",
            "mount_flags"} <= _state_fields()


@pytest.mark.parametrize("field", sorted(_state_fields()))
def test_every_state_field_is_documented(field: str) -> None:
    """Each field has its row in the table of state.json's fields."""
    section = _text().split("### `state.json`", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith(f"| `{field}` |")]
    assert len(rows) == 1, f"state.json's field {field!r} has no row in {DOC.name}"


def _format_cell(key: str) -> str:
    """The "This version's" cell of the format table's row naming `key`."""
    section = _text().split("## Format versions", 1)[1].split("\n## ", 1)[0]
    (row,) = [line for line in section.splitlines() if line.startswith("|")
              and f"`{key}`" in line.split("|")[2]]
    return row.split("|")[3].strip()


@pytest.mark.parametrize(("key", "current"), [
    (naming.TAG_FORMAT, naming.FORMAT),
    (host_volume_names.TAG_FORMAT, host_volume_names.FORMAT),
    ("version", state_file.VERSION),
])
def test_the_format_table_states_this_versions_formats(key: str, current: int) -> None:
    """A raised format is raised in the doc too."""
    assert _format_cell(key) == str(current)


def test_the_doc_names_the_code_it_speaks_of() -> None:
    """The doc's pointers to the code's homes of the formats still point."""
    for path in ("src/csi_local/volumes/naming.py", "src/csi_local/volumes/host_volume_names.py",
                 "src/csi_local/nodestate/state_file.py"):
        assert f"`{path}`" in _text() and Path(REPO, path).exists(), path
