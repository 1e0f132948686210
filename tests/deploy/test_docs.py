"""The docs name only modules and files that exist: a rename that leaves a
stale name in README, CONTRIBUTING, RELEASING or docs/ fails here, naming
the file, the line and the name.

A reference is any `folder/name.py` or bare `name.py` in the text (and
`scripts/NAME`, `tests/...`, `benchmarks/...`, `deploy/...` paths): a path
must exist as written, under `src/`, or under `src/csi_local/`; a bare name
must be some file's of the repository; a glob (`csi/*_servicer.py`) must
match one. CHANGELOG.md is history, and names what was.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = sorted([REPO / "README.md", REPO / "CONTRIBUTING.md", REPO / "RELEASING.md",
               *(REPO / "docs").glob("*.md"), *(REPO / "deploy").rglob("*.md"),
               *(REPO / "sanity").rglob("*.md")])
TREES = ("src", "tests", "benchmarks", "scripts", "sanity", "deploy", ".ci", "proto")
# A Python file's path or name (a glob's * included), not inside a longer word,
# URL or path; and the repository's own folders' paths of other files.
PY_REF = re.compile(r"(?<![\w./*-])((?:[\w*-]+/)*[\w*-]+\.py)\b")
PATH_REF = re.compile(r"(?<![\w./-])((?:scripts|tests|benchmarks|deploy|sanity)/[\w./-]*[\w-])")


@functools.cache
def _files() -> list[Path]:
    return [p for tree in TREES for p in (REPO / tree).rglob("*")
            if p.is_file() and "__pycache__" not in p.parts]


@functools.cache
def _index(files: tuple[Path, ...]) -> tuple[frozenset[str], frozenset[str]]:
    return (frozenset(p.relative_to(REPO).as_posix() for p in files),
            frozenset(p.name for p in files))


def stale_names(text: str, files: list[Path]) -> list[str]:
    """The references of `text` that name nothing in `files`."""
    refs = [m.group(1) for m in PY_REF.finditer(text)] + \
        [m.group(1) for m in PATH_REF.finditer(text)]
    if not refs:
        return []
    rel, names = _index(tuple(files))
    stale = []
    for ref in refs:
        candidates = [ref, f"src/{ref}", f"src/csi_local/{ref}"]
        if "*" in ref:
            pattern = re.compile(re.escape(ref).replace(r"\*", "[^/]*"))
            found = any(pattern.fullmatch(r) or pattern.fullmatch(r.removeprefix("src/csi_local/"))
                        for r in rel) or ("/" not in ref and any(pattern.fullmatch(n)
                                                                 for n in names))
        elif "/" in ref:
            found = any(c in rel or any(r.startswith(c + "/") for r in rel) for c in candidates)
        else:
            found = ref in names
        if not found:
            stale.append(ref)
    return stale


def test_a_stale_name_is_caught() -> None:
    files = [REPO / "src" / "csi_local" / "volumes" / "known_vgs.py"]
    assert stale_names("`volumes/held_vgs.py` and held_vgs.py", files) == \
        ["volumes/held_vgs.py", "held_vgs.py"]
    assert stale_names("`volumes/known_vgs.py`, `volumes/*_vgs.py`", files) == []


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(REPO).as_posix())
def test_the_docs_name_only_what_exists(doc: Path) -> None:
    files = _files()
    lines = doc.read_text(encoding="utf-8").splitlines()
    problems = [f"{doc.relative_to(REPO)}:{i}: {ref}"
                for i, line in enumerate(lines, 1) for ref in stale_names(line, files)]
    assert not problems, "names of files that do not exist:\n" + "\n".join(problems)
