"""The earlier versions of csi-local that the upgrade tests run
(test_upgrades.py, test_upgrades_classes.py), and where each is installed.

One list, read by the tests and by scripts/earlier-versions, which installs
each into a venv of its own on the host (the test VM has no network): the
package built from the commit's tree with the dependencies that commit names.
Commits, not tags: a clone may hold the history without the tags.
"""

from __future__ import annotations

import os
from pathlib import Path

# The last release, v0.2.0 (RELEASING.md adds each release here), and three of
# CHANGELOG.md's "Pre-release milestones": the base of 0.2.0's round
# (encryption at rest, the warmed listing), the last main before encryption,
# and main before device classes, group snapshots, the lvm shell and the
# committed-metadata reads (every lvcreate a process of its own).
EARLIER = ["3cce9e1", "271635e", "87e5bdb", "667ac4e"]
LAST_RELEASE = "3cce9e1"  # v0.2.0
# Those that encrypt volumes (LUKS2); those of them that write and know the
# placeholder header (0.2.0 on); those that know device classes (`--config`).
ENCRYPTING = {"3cce9e1", "271635e"}
PLACEHOLDERS = {"3cce9e1"}
WITH_CLASSES = ["3cce9e1", "271635e", "87e5bdb"]

# Where scripts/earlier-versions puts the venvs (the VM sees the host's files).
VENVS = Path(os.environ.get("CSI_LOCAL_EARLIER") or "/var/lib/csi-local-vm/earlier")


def venv_of(commit: str) -> Path:
    return VENVS / commit


def python_of(commit: str) -> Path:
    return venv_of(commit) / "bin" / "python"


def installed(commit: str) -> bool:
    """Whether scripts/earlier-versions finished this commit's venv."""
    return (venv_of(commit) / ".csi-local-version").is_file()
