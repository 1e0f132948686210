"""What an encrypted volume is, for both plugins: the parameter that asks for
one, the secret that holds its key, its tag, and the name of its dm-crypt
device (docs/encryption.md).

A volume is encrypted when its LV carries its plugin's encryption tag
(StepTags.encrypted), set when it is made and carried to its snapshots and
clones, whose data (the LUKS2 header at its start included) is a copy of
the source's: LVM, not the request, says whether a volume is encrypted, at
every stage, restart and restore. Its dm-crypt device is named after the LV
(`mapper_name`), so that it is found again without a record: after a plugin
restart, by `status`, and by an unstage whose stage was killed before its
state write. The steps that open, format, grow and close it are
VolumeSteps' (volumes/lifecycle.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

from csi_local.errors import SourceMismatch
from csi_local.host.crypt import Key, data_offset_for, mapper_path
from csi_local.host.kernel import Kernel
from csi_local.storage.lvm import LogicalVolume
from csi_local.volumes import host_volume_names as hvn
from csi_local.volumes import naming

# The StorageClass / Nomad volume parameter, and its one value.
PARAMETER = "encryption"
LUKS2 = "luks2"
# The key's name in the CSI secrets (node-stage and node-expand secrets on
# Kubernetes, the volume's `secrets` on Nomad). Unique across the plugin's
# calls, as the spec asks: a CO may pass the same secrets to every call.
SECRET_KEY = "encryptionKey"  # noqa: S105 (the name of a secret, not one)
# Every dm-crypt device this plugin opens: the prefix, then the LV's name
# (the CSI volume ID, or the host volume's LV name), which is unique on the
# node and at most 40 bytes: well under device-mapper's 127.
MAPPER_PREFIX = "csi-local-luks-"


def overhead(chunk_size: int) -> int:
    """What encryption costs a new volume's room in a thin pool of
    `chunk_size`-byte chunks (0: unknown): where the data starts behind the
    LUKS2 header that its first stage writes, as cryptsetup will align it
    (host/crypt.py, data_offset_for). A volume of this size and no more holds
    no data at all."""
    return data_offset_for(chunk_size)


def asked(parameters: Mapping[str, str], default: bool = False) -> bool:
    """Whether parameters ask for an encrypted volume: `encryption: luks2`;
    "none" or "" turn a class's default off. ValueError for any other value."""
    value = parameters.get(PARAMETER)
    if value is None:
        return default
    if value == LUKS2:
        return True
    if value in ("", "none"):
        return False
    raise ValueError(f"parameter {PARAMETER!r} must be {LUKS2!r} or 'none', not {value!r}")


def new_volume_tags(asked_for: bool | None, default: bool, tag: str,
                    source: LogicalVolume | None) -> list[str]:
    """The encryption tag of a new volume: [tag] when the request (`asked_for`,
    None when it does not say) or the class's `default` asks for encryption.
    A copy of `source` (a restore or a clone) is what its source is, its
    LUKS2 header and all: the clone step carries the tag ([] here), and a
    request that names another encryption than the source's is
    SourceMismatch (a copy cannot be encrypted or decrypted on the way)."""
    if source is None:
        return [tag] if (default if asked_for is None else asked_for) else []
    if asked_for is not None and asked_for != (tag in source.tags):
        what = "is" if tag in source.tags else "is not"
        raise SourceMismatch(f"the content source {what} encrypted, and a restore or clone is "
                             f"what its source is; parameter {PARAMETER!r} asks otherwise")
    return []


def key_from(secrets: Mapping[str, str]) -> Key | None:
    """The key in a request's secrets, None when there is none. ValueError
    (naming the secret, never its value) for one that cannot be a key."""
    value = secrets.get(SECRET_KEY)
    if value is None:
        return None
    try:
        return Key(value)
    except ValueError as err:
        raise ValueError(f"secret {SECRET_KEY!r}: {err}") from None


def mapper_name(lv_name: str) -> str:
    return MAPPER_PREFIX + lv_name


class TopDevice(NamedTuple):
    """The device a volume's file system or block user sees: its open dm-crypt
    device, or the LV itself. Numbers -1 when neither is there."""

    path: str
    major: int
    minor: int
    encrypted: bool  # it is the dm-crypt device


def is_encrypted(lv: LogicalVolume) -> bool:
    """Whether either plugin made `lv` encrypted (its tag)."""
    return naming.TAG_ENCRYPTED in lv.tags or hvn.TAG_ENCRYPTED in lv.tags


def top_device(host: Kernel, lv: LogicalVolume) -> TopDevice:
    """An encrypted volume's open dm-crypt device when there is one (one stat
    of its node: the name says whose it is), else the LV."""
    if not is_encrypted(lv):
        return TopDevice(lv.path, lv.kernel_major, lv.kernel_minor, False)
    path = mapper_path(mapper_name(lv.name))
    numbers = host.device_numbers(path)
    if numbers is not None:
        return TopDevice(path, numbers[0], numbers[1], True)
    return TopDevice(lv.path, lv.kernel_major, lv.kernel_minor, False)
