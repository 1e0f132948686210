"""The read of thin_dump and thin_delta XML: streamed, it gives exactly the
runs the whole-document parse it replaced gave (kept in
benchmarks/cbt_parse.py), hands each run on as soon as its element has been
read, and holds memory for the merged runs only, never for the document."""

from __future__ import annotations

import contextlib
import io
import os
import random
import threading
import tracemalloc
import xml.etree.ElementTree as ET
from collections.abc import Iterator, Sequence
from typing import Any

import pytest

from benchmarks.cbt_parse import old_parse
from csi_local.errors import StorageError
from csi_local.host.kernel import Kernel
from csi_local.host.runner import Output, Result
from csi_local.storage import thin_mappings
from csi_local.storage.thin_mappings import (
    ThinMetadata,
    delta_runs,
    dump_runs,
    merged,
    read_mapping,
)

KINDS = ("same", "different", "left_only", "right_only")
HEAD = '<superblock uuid="" time="1" transaction="7" flags="0" version="2" ' \
       'data_block_size="{bs}" nr_data_blocks="0">\n'


def dump_document(rng: random.Random, dev_id: int) -> str:
    """thin_dump's shape with what the parse must get right: other devices
    (before and after), singles and ranges, runs that touch, overlap, repeat
    or come out of order, empty ones, and elements it must ignore."""
    parts = [HEAD.format(bs=rng.choice((128, 256, 2048)))]
    ids = rng.sample([dev_id, dev_id + 1, dev_id + 2], k=rng.randint(1, 3))
    if dev_id not in ids:
        ids.append(dev_id)
    for dev in ids:
        parts.append(f'  <device dev_id="{dev}" mapped_blocks="0" transaction="1">\n')
        block = rng.randint(0, 5)
        for _ in range(rng.randint(0, 60)):
            r = rng.random()
            if r < 0.05:
                block = max(0, block - rng.randint(1, 20))  # out of order, overlapping
            elif r < 0.1:
                parts.append('    <unknown origin_block="3"/>\n')
                continue
            if rng.random() < 0.5:
                parts.append(f'    <single_mapping origin_block="{block}" data_block="9" '
                             'time="0"/>\n')
                block += rng.choice((1, 1, 2, 3))
            else:
                n = rng.choice((0, 1, 2, 5, 17))
                parts.append(f'    <range_mapping origin_begin="{block}" data_begin="9" '
                             f'length="{n}" time="0"/>\n')
                block += n + rng.choice((0, 0, 1, 4))
        parts.append("  </device>\n")
    parts.append("</superblock>\n")
    return "".join(parts)


def delta_document(rng: random.Random) -> str:
    """thin_delta's shape: one diff or several, the four kinds of run,
    touching, apart, empty, and runs outside a diff (not changes)."""
    parts = [HEAD.format(bs=rng.choice((128, 1024)))]
    parts.append('  <different begin="1" length="4"/>\n')  # not in a <diff>: ignored
    for _ in range(rng.randint(1, 3)):
        parts.append('  <diff left="1" right="2">\n')
        block = rng.randint(0, 50)
        for _ in range(rng.randint(0, 60)):
            n = rng.choice((0, 1, 3, 8))
            parts.append(f'    <{rng.choice(KINDS)} begin="{block}" length="{n}"/>\n')
            block += n + rng.choice((0, 0, 2))
        parts.append("  </diff>\n")
    parts.append("</superblock>\n")
    return "".join(parts)


def new_parse(xml: str, tool: str, dev_id: int) -> tuple[int, list[tuple[int, int]]]:
    out = io.BytesIO(xml.encode())
    mapping = read_mapping(dump_runs(out, dev_id) if tool == "thin_dump" else delta_runs(out))
    return mapping.chunk_size, list(mapping.runs.pairs())


@pytest.mark.parametrize("read_size", [7, 1 << 16])  # elements cut anywhere, or whole
@pytest.mark.parametrize("tool", ["thin_dump", "thin_delta"])
def test_the_streamed_parse_gives_what_the_whole_document_parse_gave(
        tool: str, read_size: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(thin_mappings, "READ_SIZE", read_size)
    rng = random.Random(42)
    for _ in range(150):
        dev_id = rng.randint(1, 20)
        xml = dump_document(rng, dev_id) if tool == "thin_dump" else delta_document(rng)
        assert new_parse(xml, tool, dev_id) == old_parse(xml, tool, dev_id), xml


def test_merge_joins_touching_and_overlapping_runs_in_any_order() -> None:
    assert list(merged([(5, 2), (7, 1), (20, 3), (21, 1), (30, 0)]).pairs()) == [
        (5, 3), (20, 3)]
    assert list(merged([(10, 2), (3, 1), (11, 5), (4, 2), (0, 1)]).pairs()) == [
        (0, 1), (3, 3), (10, 6)]
    assert list(merged([]).pairs()) == []


ERRORS = [
    ("<superblock", "printed what is not its XML: "),
    ("", "printed what is not its XML: no element found"),
    ('<device dev_id="7"/>', "printed <device>, not <superblock>"),
    ('<superblock><device dev_id="7"/></superblock>', "no data_block_size in its superblock"),
    ('<superblock data_block_size="128"><device dev_id="7"><single_mapping origin_block="1"/>'
     "</device></superblock>trailing", "printed what is not its XML: junk after document"),
]


@pytest.mark.parametrize(("xml", "says"), ERRORS)
def test_what_is_not_the_tools_xml_is_an_error_as_before(xml: str, says: str) -> None:
    for tool in ("thin_dump", "thin_delta"):
        with pytest.raises(StorageError) as new:
            new_parse(xml, tool, 7)
        with pytest.raises((ValueError, ET.ParseError)) as old:
            old_parse(xml, tool, 7)
        assert says in str(new.value)
        assert str(new.value).endswith(str(old.value))  # the old message, or expat's words


def test_a_device_not_in_the_dump_is_an_error() -> None:
    xml = '<superblock data_block_size="128"><device dev_id="8"/></superblock>'
    with pytest.raises(StorageError, match="thin device 7 is not in the pool's metadata"):
        new_parse(xml, "thin_dump", 7)


def test_each_run_is_handed_on_before_the_tool_has_finished_printing() -> None:
    """The tool prints its first mapping and then waits until the reader has
    that run: a parse that waits for the whole document never gets it."""
    r, w = os.pipe()
    got_first = threading.Event()
    waited: list[bool] = []

    def tool() -> None:
        with open(w, "wb", buffering=0) as out:
            out.write((HEAD.format(bs=128) + '<device dev_id="7">\n'
                       '<range_mapping origin_begin="4" data_begin="0" length="3"/>\n').encode())
            waited.append(got_first.wait(timeout=10))
            out.write(b'<single_mapping origin_block="9" data_block="5"/>\n'
                      b"</device></superblock>\n")

    printer = threading.Thread(target=tool)
    printer.start()
    try:
        with open(r, "rb", buffering=0) as out:
            runs = iter(dump_runs(out, 7))
            first = next(runs)
            got_first.set()
            rest = list(runs)
    finally:
        got_first.set()
        printer.join()
    assert waited == [True], "the first run came only after the tool had finished"
    assert (first, rest) == ((4, 3), [(9, 1)])


class LazyTool:
    """A Runner whose thin_dump prints `n` mappings two chunks apart (none
    merge), made as they are read: the document is never whole in memory
    unless the reader holds it."""

    def __init__(self, n: int) -> None:
        self.n = n

    def lines(self) -> Iterator[bytes]:
        yield (HEAD.format(bs=128) + '<device dev_id="7">\n').encode()
        for i in range(self.n):
            yield f'<single_mapping origin_block="{2 * i}" data_block="{i}" time="0"/>\n' \
                .encode()
        yield b"</device></superblock>\n"

    def run(self, argv: Sequence[str], *, ok_codes: Sequence[int] = (0,),
            input: str | bytes | None = None, timeout: float | None = None) -> Result:
        return Result(tuple(argv), 0, b"".join(self.lines()).decode(), "")

    @contextlib.contextmanager
    def stream(self, argv: Sequence[str], *, timeout: float | None = None
               ) -> Iterator[Output]:
        yield _Reader(self.lines())


class _Reader:
    def __init__(self, lines: Iterator[bytes]) -> None:
        self.lines = lines
        self.left = b""

    def read(self, size: int = -1, /) -> bytes:
        while len(self.left) < size:
            line = next(self.lines, None)
            if line is None:
                break
            self.left += line
        out, self.left = self.left[:size], self.left[size:]
        return out


def test_memory_is_the_merged_runs_not_the_document(tmp_path: Any) -> None:
    """20,000 mappings, 1.4 MB of XML: the whole-document parse held the text
    and a tree of it (13 MB); the stream holds 16 bytes a merged run."""
    n = 20_000
    meta = ThinMetadata(LazyTool(n), Kernel(), "vg", "pool", str(tmp_path))
    tracemalloc.start()
    try:
        mapping = meta.allocated(7)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(mapping.runs) == n
    assert peak < 16 * n + 1_000_000, f"peak {peak} bytes for {n} runs"
