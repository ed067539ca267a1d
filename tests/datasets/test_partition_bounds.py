"""The partition reader bounded by the work a file implies.

A partition file under every byte cap can still declare far more rows than any training set
has: deflate packs a GB of zeros into a MB. Before this, an npz whose client declared 1e9 int8
rows (0.93 GiB declared, ~1 MB on disk) raised ``MemoryError: Unable to allocate 7.45 GiB``
(converted to int64 outside the reader's error handling), and 1e8 int64 rows (0.7 MiB on
disk) took 169 s and 2.27 GiB. The files here are real, deflated .npz archives built in
memory a chunk at a time (:func:`deflated_npz`), so nothing large is written or held to
make them; the reader must refuse them from their headers, in milliseconds and a few MB.
"""

from __future__ import annotations

import io
import json
import struct
import time
import tracemalloc
import zlib
from pathlib import Path

import numpy as np
import pytest
from helpers.fuzz import FUZZ
from hypothesis import given, settings
from hypothesis import strategies as st

from fedfusion.datasets import PartitionError
from fedfusion.datasets import partition_file as pf

#: a refusal from the headers takes milliseconds; this only catches inflating a GB (tens of
#: seconds) without making a loaded CI machine flaky
BOUND_S = 10.0
#: tracemalloc's peak while reading one hostile file (numpy and zipfile report to it)
BOUND_BYTES = 32 << 20
FMNIST_ROWS = 60_000
_CHUNK = 1 << 20


def npy_header(shape: tuple[int, ...], descr: str) -> bytes:
    buffer = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        buffer, {"descr": descr, "fortran_order": False, "shape": shape})
    return buffer.getvalue()


def _deflate_repeated(head: bytes, pattern: bytes, length: int, crc: bool
                      ) -> tuple[bytes, int, int]:
    """Raw deflate of ``head`` + ``length`` bytes cycling ``pattern``, built from ONE
    compressed 1 MiB chunk repeated (after a full flush a chunk references nothing before it);
    returns (compressed, CRC-32 or 0 when ``crc`` is false, uncompressed size)."""
    chunk = pattern * max(_CHUNK // len(pattern), 1)  # whole cycles: chunks join up
    whole, rest = divmod(length, len(chunk))
    compressor = zlib.compressobj(6, zlib.DEFLATED, -15)
    first = compressor.compress(head) + compressor.flush(zlib.Z_FULL_FLUSH)
    body = compressor.compress(chunk) + compressor.flush(zlib.Z_FULL_FLUSH) if whole else b""
    last = compressor.compress(chunk[:rest]) + compressor.flush()
    checksum = 0
    if crc:
        checksum = zlib.crc32(head)
        for _ in range(whole):
            checksum = zlib.crc32(chunk, checksum)
        checksum = zlib.crc32(chunk[:rest], checksum)
    return first + body * whole + last, checksum, len(head) + length


def deflated_npz(path: Path, members: dict[str, tuple[bytes, bytes, int]], crc: bool = True,
                 stored: bool = False) -> Path:
    """A zip of ``name -> (.npy header, data pattern, data length)`` members, deflated (or
    stored: then the data is written out, so keep it small), as np.savez lays one out. With
    ``crc`` false, members over 4 MiB carry CRC 0 (a reader that inflated them fails)."""
    out, directory = io.BytesIO(), io.BytesIO()
    for name, (head, pattern, length) in members.items():
        if stored:
            data = head + (pattern * (length // max(len(pattern), 1) + 1))[:length]
            packed, checksum, size, method = data, zlib.crc32(data), len(data), 0
        else:
            packed, checksum, size = _deflate_repeated(head, pattern or b"\0", length,
                                                       crc or length <= 4 * _CHUNK)
            method = 8
        raw = name.encode()
        offset = out.tell()
        out.write(struct.pack("<4s5H3L2H", b"PK\x03\x04", 20, 0, method, 0, 0x21, checksum,
                              len(packed), size, len(raw), 0) + raw + packed)
        directory.write(struct.pack("<4s6H3L5H2L", b"PK\x01\x02", 20, 20, 0, method, 0, 0x21,
                                    checksum, len(packed), size, len(raw), 0, 0, 0, 0, 0,
                                    offset) + raw)
    start, count = out.tell(), len(members)
    out.write(directory.getvalue())
    out.write(struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, count, count,
                          len(directory.getvalue()), start, 0))
    path.write_bytes(out.getvalue())
    return path


def rows_member(rows: np.ndarray) -> tuple[bytes, bytes, int]:
    """A member holding exactly ``rows`` (its bytes as the pattern, written once)."""
    data = np.ascontiguousarray(rows).tobytes()
    return npy_header(rows.shape, rows.dtype.str), data or b"\0", len(data)


def zeros_member(rows: int, descr: str) -> tuple[bytes, bytes, int]:
    """A member whose header declares ``rows`` rows of ``descr``, all zero."""
    return npy_header((rows,), descr), b"\0", rows * np.dtype(descr).itemsize


def bounded_read(path: Path, num_rows: int, num_clients: int
                 ) -> tuple[pf.PartitionFile | PartitionError, float, int]:
    """The reader's result or its PartitionError, the seconds and tracemalloc peak it took."""
    tracemalloc.start()
    start = time.perf_counter()
    try:
        result: pf.PartitionFile | PartitionError = pf.read_partition_file(
            path, num_rows=num_rows, num_clients=num_clients)
    except PartitionError as exc:
        result = exc
    finally:
        seconds = time.perf_counter() - start
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return result, seconds, peak


HOSTILE = {
    # 0.93 GiB declared (under the 1 GiB cap), ~1 MB deflated: must fail before allocating
    "1e9 int8 rows in one client": (
        {"client0.npy": zeros_member(10**9, "|i1"), "client1.npy": rows_member(np.arange(3))},
        "client 0: its .npy header declares 1000000000 rows, more than the training set's "
        "60000; not inflated"),
    # 0.75 GiB declared, 0.7 MiB on disk: must fail before reading it all
    "1e8 int64 rows in one client": (
        {"client0.npy": zeros_member(10**8, "<i8"), "client1.npy": rows_member(np.arange(3))},
        "client 0: its .npy header declares 100000000 rows, more than the training set's "
        "60000; not inflated"),
    "1e8 uint8 validation rows": (
        {"client0.npy": rows_member(np.arange(3)), "client1.npy": rows_member(np.arange(3, 5)),
         "val.npy": zeros_member(10**8, "|u1")},
        "val: its .npy header declares 100000000 rows, more than the training set's 60000"),
    "clients together over the training set": (
        {"client0.npy": zeros_member(40_000, "<i4"), "client1.npy": zeros_member(40_000, "<i4")},
        "its clients' .npy headers declare 80000 rows in all, more than the training set's "
        "60000 (a row belongs to one client); not inflated"),
    "1e9 bool rows": (
        {"client0.npy": zeros_member(10**9, "|b1"), "client1.npy": rows_member(np.arange(3))},
        "client 0 must be a 1-D integer array, got bool (1000000000,)"),
    "2-D int8 of 30000 x 30000": (
        {"client0.npy": (npy_header((30_000, 30_000), "|i1"), b"\0", 9 * 10**8),
         "client1.npy": rows_member(np.arange(3))},
        "client 0 must be a 1-D integer array, got int8 (30000, 30000)"),
}


@pytest.mark.parametrize("case", HOSTILE)
def test_hostile_row_counts_are_refused_from_the_headers(tmp_path, case):
    members, message = HOSTILE[case]
    path = deflated_npz(tmp_path / "p.npz", members)
    assert path.stat().st_size < 2 << 20  # a GB declared, a MB (or less) on disk
    result, seconds, peak = bounded_read(path, FMNIST_ROWS, 2)
    assert isinstance(result, PartitionError), result
    assert f"partition file {str(path)!r}" in str(result) and message in str(result)
    assert seconds < BOUND_S and peak < BOUND_BYTES, (seconds, peak)


def test_the_hostile_files_are_real_archives(tmp_path):
    """The builder writes what np.load reads (so 'refused' is not 'unreadable'): a small
    client of zeros built the same way loads, and a bound-sized honest file is accepted."""
    path = deflated_npz(tmp_path / "small.npz", {"client0.npy": zeros_member(3 * _CHUNK, "|i1"),
                                                 "client1.npy": rows_member(np.arange(2))})
    with np.load(path) as archive:
        assert archive["client0"].shape == (3 * _CHUNK,) and not archive["client0"].any()
    rows = np.random.default_rng(0).permutation(FMNIST_ROWS)
    path = deflated_npz(tmp_path / "full.npz", {
        "client0.npy": rows_member(rows[:59_990].astype(np.int32)),
        "client1.npy": rows_member(rows[59_990:].astype(np.uint16)),
        "val.npy": rows_member(rows[:FMNIST_ROWS])})
    part, seconds, _ = bounded_read(path, FMNIST_ROWS, 2)
    assert isinstance(part, pf.PartitionFile), part
    assert [len(c) for c in part.clients] == [59_990, 10] and len(part.val) == FMNIST_ROWS
    assert all(c.dtype == np.int64 for c in part.clients) and seconds < BOUND_S


def test_a_large_zip_directory_is_refused_before_it_is_parsed(tmp_path):
    """25,000 empty members (a 1.3 MB directory) are refused from the end record; zipfile
    would build one object per entry (16 MiB of them: ~8 s, ~200 MB)."""
    members = {f"x{i}": (b"", b"", 0) for i in range(25_000)}
    members["client0.npy"] = rows_member(np.arange(3))
    path = deflated_npz(tmp_path / "p.npz", members, stored=True)
    result, seconds, peak = bounded_read(path, FMNIST_ROWS, 1)
    assert isinstance(result, PartitionError)
    assert "its zip directory declares" in str(result) and "not parsed" in str(result)
    assert peak < BOUND_BYTES


@pytest.mark.parametrize("content, message", [
    ({"clients": [[0] * 61, [1]]}, "client 0 lists 61 rows, more than the training set's 60"),
    ({"clients": [list(range(40)), list(range(40, 80))]}, "its clients list 80 rows in all"),
    ({"clients": [[0], [1]], "val": [2] * 61}, "val lists 61 rows, more than the training"),
])
def test_json_row_counts_are_checked_before_conversion(tmp_path, content, message):
    path = tmp_path / "p.json"
    path.write_text(json.dumps(content))
    with pytest.raises(PartitionError) as info:
        pf.read_partition_file(path, num_rows=60, num_clients=2)
    assert message in str(info.value)


def test_a_uint64_row_above_int64_is_named_as_it_is(tmp_path):
    path = deflated_npz(tmp_path / "p.npz", {
        "client0.npy": rows_member(np.array([1, 2**63 + 5], dtype=np.uint64)),
        "client1.npy": rows_member(np.arange(2, 4))})
    with pytest.raises(PartitionError, match=f"client 0: row {2**63 + 5} is outside"):
        pf.read_partition_file(path, num_rows=10, num_clients=2)


def test_a_failed_allocation_while_checking_is_a_partition_error(tmp_path, monkeypatch):
    """Never converted outside the error handling: whatever a check missed surfaces as the
    reader's own error, naming the file."""
    path = deflated_npz(tmp_path / "p.npz", {"client0.npy": rows_member(np.arange(3)),
                                             "client1.npy": rows_member(np.arange(3, 5))})

    def no_memory(*args, **kwargs):
        raise MemoryError("Unable to allocate 7.45 GiB")

    monkeypatch.setattr(pf.np, "unique", no_memory)
    with pytest.raises(PartitionError, match="could not be checked: MemoryError: Unable"):
        pf.read_partition_file(path, num_rows=10, num_clients=2)


_DESCRS = ["|i1", "|u1", "<i2", ">i2", "<u2", "<i4", ">u4", "<i8", ">i8", "<u8", "|b1", "<f4",
           "<f8", "<f2", "|O", "<U2", "|V4", "<c8"]
_SIZES = st.one_of(st.integers(0, 60), st.integers(0, 2**62),
                   st.sampled_from([10**6, 10**8, 10**9, 2**31, 2**32 - 1]))


@settings(FUZZ, max_examples=120)
@given(shape=st.one_of(st.tuples(st.integers(0, 6)), st.lists(_SIZES, max_size=3).map(tuple)),
       descr=st.one_of(st.sampled_from(["|u1", "|i1"]), st.sampled_from(_DESCRS)),
       # distinct small rows (a valid client, as u1/i1) or any bytes
       pattern=st.one_of(st.lists(st.integers(0, 39), min_size=1, max_size=16, unique=True)
                         .map(bytes), st.binary(min_size=1, max_size=16)),
       delta=st.sampled_from([0, 0, 0, 0, -1, 1, 7]), stored=st.booleans(),
       with_val=st.booleans(), val_rows=st.one_of(st.integers(1, 50), _SIZES))
def test_fuzz_compressed_headers_give_a_valid_partition_or_a_partition_error(
        tmp_path_factory, shape, descr, pattern, delta, stored, with_val, val_rows):
    """Deflated (or stored) members whose .npy headers declare any shape and dtype over data
    that really inflates to (about) the declared size, up to a GB: the reader's own error or a
    valid partition, in bounded time and memory."""
    itemsize = np.dtype(descr).itemsize
    declared = int(np.prod(shape, dtype=object)) * itemsize
    # the data really is the declared size (+ delta) up to 0.9 GB; beyond, the header lies
    length = max(declared + delta, 0) if declared <= 9 * 10**8 else len(pattern)
    if stored:
        length = min(length, 4096)
    members = {"client0.npy": (npy_header(shape, descr), pattern, length),
               "client1.npy": rows_member(np.array([40, 41]))}
    if with_val:
        members["val.npy"] = zeros_member(min(val_rows, 4096 if stored else 10**9), "|u1")
    path = deflated_npz(tmp_path_factory.mktemp("fuzz") / "p.npz", members, crc=False,
                        stored=stored)
    result, seconds, peak = bounded_read(path, 50, 2)
    assert seconds < BOUND_S and peak < BOUND_BYTES, (seconds, peak)
    if isinstance(result, PartitionError):
        assert f"partition file {str(path)!r}" in str(result)
        return
    assert result.clients[1].tolist() == [40, 41]  # accepted: the promised invariants hold
    rows = np.concatenate(result.clients)
    assert all(c.dtype == np.int64 and c.size for c in result.clients)
    assert len(np.unique(rows)) == len(rows) and rows.min() >= 0 and rows.max() < 50
    assert result.val is None or (result.val.dtype == np.int64 and result.val.max() < 50)
