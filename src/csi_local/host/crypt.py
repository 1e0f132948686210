"""LUKS2 encryption with cryptsetup: format, open, verify, close, resize, through the Runner.

Knows nothing of volumes: a device path, a device-mapper name and a key.

The key never reaches a process's argv or environment, a log line or an
error: cryptsetup reads it from its standard input (`--key-file -`, a pipe
the Runner writes and closes), every byte of it up to the end, so a key is
exactly the bytes given, newlines included (a key file's, whatever they
are; a secret's text as UTF-8). The Runner logs argv only, and
a CommandError carries argv, the exit code and cryptsetup's own output,
which never echoes a key. A `Key` hides its value from repr() and str(), so
that a traceback's locals or a logged object cannot show it either.

cryptsetup's exit codes (cryptsetup(8), "RETURN CODES"), as the calls here
take them: 0 done; 1 wrong parameters (also: "not a valid LUKS device" for
open); 2 no permission (a wrong passphrase: "No key available with this
passphrase"); 3 out of memory; 4 wrong device specified (close of a device
that is not active, isLuks of a device it cannot read); 5 device already
exists or is busy.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import secrets
import stat
from collections.abc import Callable
from dataclasses import dataclass
from typing import NoReturn

from csi_local.errors import CommandError, KeyMissing, KeyRefused
from csi_local.host import derivations
from csi_local.host.derivations import DerivationSlots
from csi_local.host.runner import Runner

log = logging.getLogger(__name__)

MAPPER_DIR = "/dev/mapper"
# LUKS2's default header, keyslots included. The data starts at least this far
# into the device, aligned to the device's I/O size (data_offset_for), so an
# encrypted device is that much smaller than its LV.
HEADER_BYTES = 16 << 20
# cryptsetup's default alignment of the data (DEFAULT_DISK_ALIGNMENT).
DEFAULT_ALIGNMENT = 1 << 20
# A key longer than this is refused before cryptsetup sees it: cryptsetup's
# own limit for a key file is 8 MiB, and a CO's secret is never that big.
MAX_KEY_BYTES = 64 << 10


class Key:
    """A passphrase, kept out of every repr, str, log line and error: bytes,
    as cryptsetup reads them (a key file's, byte for byte; a secret's text
    as UTF-8)."""

    __slots__ = ("_value",)

    def __init__(self, value: str | bytes) -> None:
        if isinstance(value, str):
            try:
                value = value.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError("an encryption key given as text must be Unicode text "
                                 "(it holds a lone surrogate)") from None
        if not value:
            raise ValueError("an encryption key must not be empty")
        if len(value) > MAX_KEY_BYTES:
            raise ValueError(f"an encryption key must be at most {MAX_KEY_BYTES} bytes")
        self._value = value

    def reveal(self) -> bytes:
        """The passphrase itself: only for cryptsetup's standard input."""
        return self._value

    def __repr__(self) -> str:
        return "Key(<hidden>)"

    __str__ = __repr__

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Key) and other._value == self._value

    def __hash__(self) -> int:
        return hash(("Key", self._value))

    def __reduce__(self) -> NoReturn:  # never pickled (into a cache, a queue, a log)
        raise TypeError("a Key is not picklable")


def read_key_file(path: str) -> Key:
    """The key in a key file, every byte of it (as `cryptsetup --key-file
    PATH` reads it, so an operator opens the device by hand with the same
    file). Only a regular file, not through a symlink, of root's (or this
    process's user's), that no group or other may read or write: KeyMissing
    (naming the file, never its content) otherwise. Opened without blocking,
    so that a FIFO or a device at the path is refused at once rather than
    waited on."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as err:
        raise KeyMissing(f"key file {path}: {err.strerror or err}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise KeyMissing(f"key file {path} is not a regular file")
        if st.st_uid not in (0, os.geteuid()) or st.st_mode & 0o077:
            raise KeyMissing(f"key file {path} must be root's and readable by it alone "
                             "(chown root: and chmod 600 it)")
        data = os.read(fd, MAX_KEY_BYTES + 1)
    finally:
        os.close(fd)
    try:
        return Key(data)
    except ValueError as err:
        raise KeyMissing(f"key file {path}: {err}") from None


def forbid_core_dumps() -> None:
    """No core dump of this process, nor of any process it starts: a dump
    would write the keys it holds (and cryptsetup's, its child) to disk.
    RLIMIT_CORE 0, soft and hard, is inherited across fork and execve, and
    systemd-coredump and apport honour it when core_pattern pipes to them."""
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


@dataclass(frozen=True)
class LuksSettings:
    """How a new LUKS2 header is made (docs/encryption.md says why these).

    aes-xts-plain64 with a 512-bit key (AES-256 in XTS mode), dm-crypt's
    default and hardware-accelerated (AES-NI, ARMv8 crypto extensions) on
    any node; argon2id, memory-hard, as LUKS2's default PBKDF, but capped at
    64 MiB and one thread (cryptsetup's default takes up to 1 GiB and four
    threads at every open) and one second of work, so that a small node
    opening many volumes at a restart neither runs out of memory nor waits
    minutes. A slower node gets fewer iterations for the same second, never
    fewer than argon2's minimum of 4."""

    cipher: str = "aes-xts-plain64"
    key_size_bits: int = 512
    pbkdf: str = "argon2id"
    pbkdf_memory_kib: int = 65536
    pbkdf_parallel: int = 1
    iter_time_ms: int = 1000

    def argv(self) -> list[str]:
        return ["--type", "luks2", "--cipher", self.cipher,
                "--key-size", str(self.key_size_bits), "--pbkdf", self.pbkdf,
                "--pbkdf-memory", str(self.pbkdf_memory_kib),
                "--pbkdf-parallel", str(self.pbkdf_parallel),
                "--iter-time", str(self.iter_time_ms)]


# The placeholder header CreateVolume writes on a new encrypted volume (see
# Crypt.format_placeholder): its label names it for whoever lists the node's
# devices (lsblk -f, blkid); its one keyslot takes a random key that nobody
# keeps, so its KDF need not be costly: PBKDF2 at cryptsetup's minimum of 1000
# iterations, no argon2 memory. Small metadata and keyslot areas (a 512-bit
# key's keyslot takes 256,000 bytes) make luksFormat write 1 MiB, not 16.
PLACEHOLDER_LABEL = "csi-local-unstaged"
# What luksFormat writes of it: its metadata and keyslot areas, up to its
# data offset (1 MiB, the alignment).
PLACEHOLDER_BYTES = 1 << 20
PLACEHOLDER_ARGV = ("--type", "luks2", "--label", PLACEHOLDER_LABEL, "--pbkdf", "pbkdf2",
                    "--pbkdf-force-iterations", "1000", "--luks2-metadata-size", "16k",
                    "--luks2-keyslots-size", "256k")

# How every device is opened (Crypt.open says why), and the flag of these
# its LUKS2 header keeps (--persistent, when it lacks it).
OPEN_FLAGS = ("--allow-discards", "--disable-keyring")
PERSISTENT_FLAG = "allow-discards"
# A LUKS2 header on disk (cryptsetup's docs/on-disk-format-luks2.pdf): a
# 4 KiB binary part (magic, version, the header's size and its sequence
# number, big-endian), then its JSON up to that size; a second copy follows
# the first, and the one with the higher sequence number is current.
_LUKS2_MAGICS = (b"LUKS\xba\xbe", b"SKUL\xba\xbe")
_LUKS2_BINARY = 4096
_LUKS2_MAX_HEADER = 4 << 20
# What cryptsetup says when it has to ask for a passphrase and its standard
# input (/dev/null) gives none.
_NOTHING_ON_STDIN = "Nothing to read on input"


def data_offset_for(io_size: int) -> int:
    """The data offset luksFormat gives a LUKS2 header of the default size on
    a device whose optimal I/O size is `io_size` (0: unknown), as cryptsetup
    computes it (lib/utils_device.c, device_topology_alignment): the header
    aligned to 1 MiB, or to the I/O size when that does not divide 1 MiB. A
    thin volume's optimal I/O size is its pool's chunk size, so on a pool of
    192 KiB chunks the data starts at 16.125 MiB, on one of 32 MiB chunks at
    32 MiB. A header that exists says its own (Crypt.data_offset)."""
    align = DEFAULT_ALIGNMENT
    if io_size > 0 and DEFAULT_ALIGNMENT % io_size:
        align = io_size
    return -(-HEADER_BYTES // align) * align


def mapper_path(name: str) -> str:
    return f"{MAPPER_DIR}/{name}"


def _header_copy(f: int, offset: int) -> tuple[int, int, dict[str, object]] | None:
    """(sequence number, size, JSON) of the LUKS2 header copy at `offset`."""
    binary = os.pread(f, _LUKS2_BINARY, offset)
    if len(binary) < 24 or binary[:6] not in _LUKS2_MAGICS or binary[6:8] != b"\0\2":
        return None
    size = int.from_bytes(binary[8:16], "big")
    if not _LUKS2_BINARY < size <= _LUKS2_MAX_HEADER:
        return None
    text = os.pread(f, size - _LUKS2_BINARY, offset + _LUKS2_BINARY).split(b"\0", 1)[0]
    try:
        meta = json.loads(text)
    except ValueError:
        return None
    return (int.from_bytes(binary[16:24], "big"), size, meta) if isinstance(meta, dict) else None


def persistent_flags(device: str) -> frozenset[str] | None:
    """The activation flags `device`'s LUKS2 header keeps (`config.flags`),
    read from its current header copy without a process; None when that
    cannot be read (callers then assume none are kept)."""
    try:
        f = os.open(device, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        primary = _header_copy(f, 0)
        if primary is None:
            return None
        secondary = _header_copy(f, primary[1])
    except OSError:
        return None
    finally:
        os.close(f)
    meta = max((c for c in (primary, secondary) if c is not None), key=lambda c: c[0])[2]
    config = meta.get("config")
    flags = config.get("flags", []) if isinstance(config, dict) else []
    return frozenset(x for x in flags if isinstance(x, str)) if isinstance(flags, list) \
        else frozenset()


def header_label(device: str) -> str | None:
    """The label of `device`'s LUKS2 header (its binary part, bytes 24 to 72,
    NUL-padded), read without a process; None when it has no LUKS2 header or
    cannot be read."""
    try:
        f = os.open(device, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        binary = os.pread(f, 72, 0)
    except OSError:
        return None
    finally:
        os.close(f)
    if len(binary) < 72 or binary[:6] not in _LUKS2_MAGICS or binary[6:8] != b"\0\2":
        return None
    return binary[24:72].split(b"\0", 1)[0].decode("utf-8", "replace")


class Crypt:
    """cryptsetup's LUKS2 commands, each one process through the Runner.

    A command that derives a key from the passphrase (format, open, verify,
    a resize given the key) holds one of `slots` while it runs: the
    process's own (host/derivations.py) unless a test gives others, so that
    concurrent stages never hold more argon2id memory than the process may
    use. `header_flags` reads the flags a header keeps (persistent_flags
    unless a test gives another)."""

    def __init__(self, runner: Runner, settings: LuksSettings | None = None,
                 slots: DerivationSlots | None = None,
                 header_flags: Callable[[str], frozenset[str] | None] | None = None,
                 ) -> None:
        self.runner = runner
        self.settings = settings or LuksSettings()
        self._slots = slots
        self._header_flags = header_flags

    def _derive(self, argv: list[str], key: Key) -> None:
        """Run a cryptsetup command that derives a key from `key`, in a slot."""
        slots = self._slots if self._slots is not None else derivations.shared()
        with slots.hold():
            self.runner.run(argv, input=key.reveal())

    def is_luks(self, device: str) -> bool:
        """Whether `device` starts with a LUKS2 header. A device cryptsetup
        cannot read (exit 4) is a CommandError, never "no header": a caller
        would take that for a device it may format."""
        res = self.runner.run(["cryptsetup", "isLuks", "--type", "luks2", device],
                              ok_codes=(0, 1))
        return res.returncode == 0

    def format(self, device: str, key: Key) -> None:
        """luksFormat: a new LUKS2 header and volume key on `device`, its one
        keyslot opened by `key`. Destroys what the device held: callers
        prove first that it held nothing (volumes/lifecycle.py)."""
        self._derive(["cryptsetup", "luksFormat", "--batch-mode", *self.settings.argv(),
                      "--key-file", "-", device], key)

    def format_placeholder(self, device: str) -> None:
        """A LUKS2 header on the new, never staged `device` that no key
        opens (its one keyslot's key is random and kept nowhere): what an
        encrypted volume holds from CreateVolume until its first stage
        formats it for real. It is there for csi-local versions that predate
        encryption (a rollback): they take an encrypted volume for a plain
        one, and would run mkfs on its bare LV, writing its data in
        plaintext; every version refuses to format a device with a
        signature. Destroys what the device held: callers prove first that
        it held nothing (its thin device maps no block)."""
        self.runner.run(["cryptsetup", "luksFormat", "--batch-mode", *PLACEHOLDER_ARGV,
                         "--key-file", "-", device], input=secrets.token_bytes(32))

    def open(self, device: str, name: str, key: Key) -> str:
        """Open `device` as /dev/mapper/`name`; returns that path. KeyRefused
        when no keyslot takes `key` (nothing is changed on the device).

        Discards pass through (--allow-discards), so that what a file system
        frees goes back to the thin pool (fstrim); --persistent stores the
        flag in the LUKS2 header, so that an open by hand (cryptsetup open,
        systemd-cryptsetup) has it too: only at an open of a header that
        lacks it (one made before), since cryptsetup rewrites the header at
        every --persistent open. It shows which blocks hold data, which thin
        provisioning shows anyway (docs/encryption.md, the threat model).

        --disable-keyring keeps the volume key in the dm-crypt table, where
        a later `resize` finds it without the passphrase; in the kernel's
        keyring (LUKS2's default) it is dropped once the table holds a
        reference to it, and every resize must derive it again from the
        passphrase, which Nomad's NodeExpandVolume does not carry. Root on
        the node reads it there (`dmsetup table --showkeys`), as root reads
        the plaintext anyway (the threat model)."""
        kept = (self._header_flags or persistent_flags)(device) or frozenset()
        persist = [] if PERSISTENT_FLAG in kept else ["--persistent"]
        try:
            self._derive(["cryptsetup", "open", "--type", "luks2", *OPEN_FLAGS, *persist,
                          "--key-file", "-", device, name], key)
        except CommandError as err:
            if err.returncode == 2:
                raise KeyRefused(f"the key given does not open the LUKS2 header of {device}: "
                                 "no keyslot takes it (the data is left untouched)") from None
            raise
        return mapper_path(name)

    def verify(self, device: str, key: Key) -> None:
        """Whether a keyslot of `device`'s LUKS2 header takes `key`, without
        opening anything (`open --test-passphrase`: the same key derivation
        as an open, and it works while the device is open). KeyRefused when
        none does. An open dm-crypt device says nothing of a key: a stage
        that reuses one asks the header first."""
        try:
            self._derive(["cryptsetup", "open", "--test-passphrase", "--type", "luks2",
                          "--key-file", "-", device], key)
        except CommandError as err:
            if err.returncode == 2:
                raise KeyRefused(f"the key given does not open the LUKS2 header of {device}: "
                                 "no keyslot takes it (its open dm-crypt device is left as "
                                 "it was)") from None
            raise

    def close(self, name: str) -> None:
        """Close /dev/mapper/`name`. Busy (a file system still mounted on it):
        CommandError, exit 5."""
        self.runner.run(["cryptsetup", "close", name])

    def resize(self, name: str, key: Key | None) -> None:
        """Grow the open device to the whole of its (grown) backing device.

        A device this plugin opened holds its volume key in its dm-crypt
        table (`open`): cryptsetup reloads the table with it, no passphrase
        needed, and reads no `key`. A device whose volume key is in the
        kernel's keyring (opened by an older version of the plugin, or by
        hand) needs the passphrase again: `key`, or KeyMissing without one.
        cryptsetup runs without a terminal and with /dev/null as standard
        input (--batch-mode), so it cannot wait at a prompt."""
        if key is None:
            try:
                self.runner.run(["cryptsetup", "resize", "--batch-mode", name])
            except CommandError as err:
                if _NOTHING_ON_STDIN in err.stderr or err.returncode == 2:
                    raise KeyMissing(
                        f"{mapper_path(name)} keeps its volume key in the kernel's keyring "
                        "(it was opened by an older version of the plugin, or by hand): "
                        "growing it needs the passphrase, which this request does not "
                        "carry; unstage and stage the volume (its next open keeps the key "
                        "in its dm-crypt table), or pass the key") from None
                raise
            return
        try:
            self._derive(["cryptsetup", "resize", "--batch-mode", "--key-file", "-", name],
                         key)
        except CommandError as err:
            if err.returncode == 2:
                raise KeyRefused(f"the key given does not open the LUKS2 header under "
                                 f"{mapper_path(name)}: not resized") from None
            raise

    def data_offset(self, device: str) -> int:
        """Where the data of `device`'s LUKS2 header starts, in bytes: the
        offset of its data segment, as the header records it (cryptsetup
        chose it at luksFormat: the header aligned to the device's I/O
        size). CommandError when cryptsetup cannot read the header."""
        out = self.runner.run(["cryptsetup", "luksDump", "--dump-json-metadata", device]).stdout
        try:
            segments = json.loads(out)["segments"]
            return min(int(seg["offset"]) for seg in segments.values())
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise CommandError(("cryptsetup", "luksDump", device), 0, out,
                               f"no data segment in the LUKS2 metadata ({err})") from None
