"""The docs name modules that exist. README.md, CONTRIBUTING.md and docs/*.md
point readers at files and modules (`host/kernel.py`, `src/csi_local/_gen/`,
`tests/unit/table.py`, `csi_local._gen.csi_pb2_grpc`, `volumes/sizes.minimum_size`);
a module moved or deleted leaves a doc that sends them nowhere. Every such
name must resolve: a path to a file or folder of the repository, a module
of the package, a module's top-level name."""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "src" / "csi_local"
DOCS = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]
FOLDERS = "|".join(sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()))
_EDGE = r"(?<![\w./-])"
# A path from the repository's root: a file, or a folder (ending in "/").
REPO_PATH = re.compile(_EDGE + r"((?:src|tests|benchmarks|sanity|scripts|deploy|docs)"
                       r"/[\w./-]*?(?:\.py|/))(?![\w/-])")
# A path in the package, from one of its folders: `storage/lvm.py`.
PACKAGE_PATH = re.compile(_EDGE + rf"((?:{FOLDERS})(?:/\w+)*\.py)\b")
# A module of the package and a name in it: `storage/lvm_shell.use_lvm_shell`.
PACKAGE_NAME = re.compile(_EDGE + rf"((?:{FOLDERS})(?:/\w+)+)\.(?!py\b)([A-Za-z_]\w*)")
# A dotted module, perhaps with a name in it: `csi_local.storage.vg_text`.
DOTTED = re.compile(r"\bcsi_local((?:\.\w+)+)")


def _module(parts: list[str]) -> Path | None:
    """The file of the package's module `parts` (a package's __init__), or None."""
    path = PACKAGE.joinpath(*parts)
    for found in (path.with_suffix(".py"), path / "__init__.py"):
        if found.is_file():
            return found
    return None


@functools.cache
def _top_level(module: Path) -> frozenset[str]:
    names: set[str] = set()
    for node in ast.parse(module.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.ImportFrom | ast.Import):
            names |= {a.asname or a.name.split(".")[0] for a in node.names}
    return frozenset(names)


def stale_names(text: str) -> list[str]:
    """The file and module names in `text` that do not resolve."""
    stale = [m.group(1) for m in REPO_PATH.finditer(text) if not (ROOT / m.group(1)).exists()]
    stale += [m.group(1) for m in PACKAGE_PATH.finditer(text)
              if not (PACKAGE / m.group(1)).is_file()]
    for m in PACKAGE_NAME.finditer(text):
        module = _module(m.group(1).split("/"))
        if module is None or m.group(2) not in _top_level(module):
            stale.append(m.group(0))
    for m in DOTTED.finditer(text):
        parts = m.group(1).lstrip(".").split(".")
        if _module(parts) is not None:
            continue
        module = _module(parts[:-1])  # a module, and a name in it
        if module is None or parts[-1] not in _top_level(module):
            stale.append(m.group(0))
    return stale


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_module_a_doc_names_exists(doc: Path) -> None:
    assert stale_names(doc.read_text()) == []


def test_a_stale_name_of_each_form_is_found() -> None:
    text = ("`src/csi_local/host/kernel.py`, `host/kernel.py`, `tests/unit/fakes/`, "
            "`storage/lvm_shell.use_lvm_shell`, `csi_local.storage.vg_text.read_copies` "
            "and `csi_local._gen.csi_pb2_grpc` are there; "
            "`src/csi_local/host/gone.py`, `host/gone.py`, `tests/unit/gone/`, "
            "`storage/lvm_shell.gone`, `csi_local.storage.gone` and "
            "`csi_local.storage.vg_text.gone` are not.")
    assert stale_names(text) == [
        "src/csi_local/host/gone.py", "tests/unit/gone/", "host/gone.py",
        "storage/lvm_shell.gone", "csi_local.storage.gone", "csi_local.storage.vg_text.gone"]
