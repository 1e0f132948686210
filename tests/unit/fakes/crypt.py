"""The fake dm-crypt: cryptsetup's LUKS2 commands as the plugin runs them
(isLuks, luksFormat, open, open --test-passphrase, close, resize), with cryptsetup's exit codes, and
the dm-crypt devices they make, /dev/mapper/NAME over an LV.

A LUKS2-formatted LV's content is a header (blkid: crypto_LUKS) holding the
one key it takes, and the data area's own content, which is what the
dm-crypt device shows: a snapshot of the LV copies both. The key must come
on standard input (`--key-file -`); one in argv is an AssertionError."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tests.unit.fakes.common import DM_MAJOR, MiB, _Fail, _one, _options
from tests.unit.fakes.devices import Content, _Dev

if TYPE_CHECKING:
    from tests.unit.fakes.lvm import FakeLv

HEADER = 16 * MiB
FIRST_MINOR = 1000  # dm-crypt devices' minors: clear of the LVs'


@dataclass
class Luks:
    """A LUKS2 header's one key, and the content of the data area behind it."""

    key: bytes  # as cryptsetup read it
    data: Content = field(default_factory=Content)
    flags: set[str] = field(default_factory=set)  # persistent activation flags (--persistent)
    offset: int = HEADER  # where the data area starts
    label: str = ""  # --label


@dataclass
class FakeMapper:
    lv: FakeLv
    minor: int
    size: int  # the data area's size when opened or last resized: a grown LV does not grow it
    discards: bool = False  # opened with --allow-discards (or the header's persistent flag)
    # Its volume key is in the kernel's keyring (LUKS2's default open), not in
    # its table (--disable-keyring): a resize then needs the passphrase.
    keyring: bool = False

    @property
    def node(self) -> str:
        return f"/dev/dm-{self.minor}"


class FakeCrypt:
    """cryptsetup and its dm-crypt devices (a FakeHost part)."""

    mappers: dict[str, FakeMapper]
    crypt_inputs: list[bytes | None]  # each cryptsetup call's standard input, as read

    if TYPE_CHECKING:  # what it uses of the other parts (fakehost.FakeHost has all)
        def _device(self, path: str) -> _Dev | None: ...
        def _need_device(self, path: str, rc: int, message: str) -> _Dev: ...
        def _active_lv(self, path: str) -> FakeLv | None: ...
        def _is_open(self, dev_node: str) -> bool: ...
        def _follow(self, path: str) -> str: ...
        def _pool_of(self, lv: FakeLv) -> FakeLv: ...

    def _chunk_of(self, lv: FakeLv) -> int:
        return self._pool_of(lv).chunk_size if lv.pool else 0

    def luks_label(self, path: str) -> str | None:
        dev = self._device(self._follow(path))
        luks = dev.content.luks if dev is not None else None
        return luks.label if luks is not None else None

    def optimal_io_size(self, path: str) -> int:
        """A thin LV's is its pool's chunk size, as dm-thin sets it."""
        lv = self._active_lv(self._follow(path))
        return self._chunk_of(lv) if lv is not None else 0

    def _active(self, name: str) -> FakeMapper:
        m = self.mappers.get(name)
        if m is None:
            raise _Fail(4, f"Device {name} is not active.\n")
        return m

    def _mapper_device(self, path: str) -> _Dev | None:
        """A dm-crypt device by /dev/mapper/NAME or /dev/dm-N."""
        for name, m in self.mappers.items():
            if path in (f"/dev/mapper/{name}", m.node):
                luks = m.lv.content.luks
                assert luks is not None
                return _Dev(m.node, (DM_MAJOR, m.minor), f"/dev/mapper/{name}",
                            m.size, luks.data, False)
        return None

    def underlying(self, major: int, minor: int) -> list[tuple[int, int]]:
        for m in self.mappers.values():
            if (major, minor) == (DM_MAJOR, m.minor):
                return [(DM_MAJOR, m.lv.minor)]
        return []

    def luks_flags(self, path: str) -> frozenset[str] | None:
        """The activation flags the LUKS2 header on `path` keeps, as
        host/crypt.py's persistent_flags reads them off a real device."""
        dev = self._device(self._follow(path))
        if dev is None or dev.content.luks is None:
            return None
        return frozenset(dev.content.luks.flags)

    def _crypt_holds(self, lv: FakeLv) -> bool:
        return any(m.lv is lv for m in self.mappers.values())

    def open_luks(self, lv: FakeLv, name: str, keyring: bool = False) -> str:
        """A dm-crypt device over `lv`, as if opened before (a test's setup);
        `keyring`: opened with its volume key in the kernel's keyring."""
        minor = max((m.minor for m in self.mappers.values()), default=FIRST_MINOR - 1) + 1
        luks = lv.content.luks
        self.mappers[name] = FakeMapper(lv, minor, lv.size - (luks.offset if luks else HEADER),
                                        keyring=keyring)
        return f"/dev/mapper/{name}"

    def _cryptsetup(self, argv: Sequence[str], given: str | bytes | None) -> str:
        # What cryptsetup reads: the bytes given, or the text's UTF-8 (the Runner's).
        stdin = given.encode() if isinstance(given, str) else given
        self.crypt_inputs.append(stdin)
        sub = argv[1]
        opts, pos = _options(argv[1:], {"--type", "--cipher", "--key-size", "--pbkdf",
                                        "--pbkdf-memory", "--pbkdf-parallel", "--iter-time",
                                        "--key-file", "--label", "--pbkdf-force-iterations",
                                        "--luks2-metadata-size", "--luks2-keyslots-size"},
                                       {"--batch-mode", "--test-passphrase",
                                                        "--allow-discards", "--persistent",
                                                        "--disable-keyring",
                                                        "--dump-json-metadata"})
        if "--key-file" in opts:
            assert opts["--key-file"] == ["-"], f"FakeHost: a key file other than stdin {argv}"
            assert stdin is not None, f"FakeHost: --key-file - without input {argv}"
        if sub == "isLuks":
            dev = self._need_device(_one(pos, argv)[0], 4, "Device {d} does not exist or "
                                                           "access denied.")
            if dev.content.unreadable:
                raise _Fail(4, f"Device {pos[0]} cannot be read.\n")
            if dev.content.luks is None:
                raise _Fail(1, "")
            return ""
        if sub == "luksFormat":
            assert "--batch-mode" in opts and stdin, f"FakeHost: {argv!r}"
            path = _one(pos, argv)[0]
            lv = self._active_lv(self._follow(path))
            if lv is None:
                raise _Fail(4, f"Device {path} does not exist or access denied.\n")
            if self._is_open(f"/dev/dm-{lv.minor}") or self._crypt_holds(lv):
                raise _Fail(5, f"Cannot format device {path} in use.\n")
            lv.content = Content("crypto_LUKS", f"luks-{lv.name}", 0, written=True,
                                 luks=Luks(stdin, offset=luks_offset(self._chunk_of(lv)),
                                           label=opts.get("--label", [""])[0]))
            return ""
        if sub == "open" and "--test-passphrase" in opts:
            # Only the keyslots are asked: nothing is opened, and an open
            # dm-crypt device over the LV does not stand in the way.
            path = _one(pos, argv)[0]
            dev = self._need_device(path, 4, "Device {d} does not exist or access denied.")
            if dev.content.luks is None:
                raise _Fail(1, f"Device {path} is not a valid LUKS device.\n")
            if dev.content.luks.key != stdin:
                raise _Fail(2, "No key available with this passphrase.\n")
            return ""
        if sub == "open":
            path, name = _one(pos, argv, 2)
            lv = self._active_lv(self._follow(path))
            if lv is None:
                raise _Fail(4, f"Device {path} does not exist or access denied.\n")
            if name in self.mappers or self._crypt_holds(lv):
                raise _Fail(5, f"Device {name} already exists.\n")
            luks = lv.content.luks
            if luks is None:
                raise _Fail(1, f"Device {path} is not a valid LUKS device.\n")
            if luks.key != stdin:
                raise _Fail(2, "No key available with this passphrase.\n")
            if lv.size <= luks.offset:
                raise _Fail(1, f"Requested offset is beyond real size of device {path}.\n")
            self.open_luks(lv, name, keyring="--disable-keyring" not in opts)
            asked = {"allow-discards"} if "--allow-discards" in opts else set()
            self.mappers[name].discards = bool((asked | luks.flags) & {"allow-discards"})
            if "--persistent" in opts:  # the header keeps exactly what this open asked
                luks.flags = asked
            return ""
        if sub == "luksDump":
            assert "--dump-json-metadata" in opts, f"FakeHost: {argv!r}"
            dev = self._need_device(_one(pos, argv)[0], 4, "Device {d} does not exist or "
                                                           "access denied.")
            if dev.content.luks is None:
                raise _Fail(1, f"Device {pos[0]} is not a valid LUKS device.\n")
            return json.dumps({"segments": {"0": {
                "type": "crypt", "offset": str(dev.content.luks.offset), "size": "dynamic",
                "iv_tweak": "0", "encryption": "aes-xts-plain64", "sector_size": 512}}}) + "\n"
        if sub == "close":
            (name,) = _one(pos, argv)
            m = self._active(name)
            if self._is_open(m.node):
                raise _Fail(5, f"Device {name} is still in use.\n")
            del self.mappers[name]
            return ""
        if sub == "resize":
            (name,) = _one(pos, argv)
            m = self._active(name)
            luks = m.lv.content.luks
            assert luks is not None and "--batch-mode" in opts, f"FakeHost: {argv!r}"
            if m.keyring:  # the volume key must be derived again: the passphrase
                if stdin is None:  # /dev/null, no terminal
                    raise _Fail(1, "Nothing to read on input.\n")
                if luks.key != stdin:
                    raise _Fail(2, "No key available with this passphrase.\n")
            # Else the key is in the table: cryptsetup reads no passphrase at all.
            m.size = m.lv.size - luks.offset  # grows to its (grown) LV, as dm-crypt does
            return ""
        raise AssertionError(f"FakeHost does not simulate {argv!r}")


def luks_offset(chunk_size: int) -> int:
    """Where cryptsetup's luksFormat starts the data on a thin volume of a
    pool of `chunk_size`-byte chunks (its optimal I/O size): the 16 MiB
    header aligned to 1 MiB, or to the chunk when that does not divide
    1 MiB (cryptsetup's device_topology_alignment)."""
    align = chunk_size if chunk_size and (MiB % chunk_size) else MiB
    return -(-HEADER // align) * align


def mapper_minor(node: str) -> int | None:
    m = re.fullmatch(r"/dev/dm-(\d+)", node)
    return int(m.group(1)) if m else None
