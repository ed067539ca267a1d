"""Readers of files a user or an attacker hands over, bounded in memory and time:
predictor files that expand on load (item 5), partition files (item 6), output folders with
symlinks in them (item 7) and replays whose clients add up (item 8)."""

from __future__ import annotations

import io
import subprocess
import sys
import textwrap
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.uploads import kron_upload

from fedfusion import upload_store
from fedfusion.app.config import Settings
from fedfusion.app.output import output_folder
from fedfusion.core.architecture import ModelSpec
from fedfusion.core.predictors import Ensemble, save_predictor
from fedfusion.datasets import PartitionError
from fedfusion.datasets import partition_file as pf
from fedfusion.strategies.predictors import load_predictor
from fedfusion.upload_store import UploadStoreError, load_uploads, open_no_follow, save_uploads

ROOT = Path(__file__).resolve().parents[2]
SMALL = ModelSpec("mlp", (1, 4, 4), 3, {"hidden_layers": 1, "hidden": 6})


#: a hostile file costs at most this long here; honest-but-slow would be minutes (or never end),
#: and a loaded CI machine must not make a bound meant for that flaky
BOUND_S = 30.0


def run_python(code: str, *args: str) -> tuple[str, float]:
    """Run ``code`` in a fresh interpreter; return its stdout and ITS OWN peak RSS in MB.

    The child reads ``VmHWM`` (the high-water mark of its own address space). Neither
    ``RUSAGE_CHILDREN`` (the largest child this test process ever had, Ray included) nor the
    child's ``RUSAGE_SELF`` will do: Linux carries ``ru_maxrss`` across ``exec``, and
    ``subprocess`` may ``vfork``, so the child would report this pytest process's own peak.
    """
    probe = ("\nimport re as _re\n"
             "print('PEAK-KB', _re.search(r'VmHWM:\\s*(\\d+)', "
             "open('/proc/self/status').read()).group(1))\n")
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code) + probe, *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    peak = float(lines[-1].split()[1]) / 1024
    return "\n".join(lines[:-1]) + ("\n" if lines[:-1] else ""), peak


# ------------------------------------------------------------------ item 5: predictor.pt

def _shapes(spec: ModelSpec) -> dict[str, torch.Size]:
    with torch.device("meta"):
        return {k: v.shape for k, v in spec.build().state_dict().items()}


def _save_states(path: Path, states: list[dict[str, torch.Tensor]], spec: ModelSpec) -> Path:
    torch.save({"kind": "ensemble", "specs": [spec.to_dict()] * len(states),
                "states": states}, path)
    return path


def _expanded(spec: ModelSpec) -> list[dict[str, torch.Tensor]]:
    return [{k: torch.zeros(1).expand(s) for k, s in _shapes(spec).items()}]


def _overlapping(spec: ModelSpec) -> list[dict[str, torch.Tensor]]:
    state = {}
    for k, s in _shapes(spec).items():  # rows that all start at element 0 of one row
        storage = torch.zeros(s[-1])
        state[k] = torch.as_strided(storage, s, (0,) * (len(s) - 1) + (1,))
    return [state]


def _shared_between_members(spec: ModelSpec) -> list[dict[str, torch.Tensor]]:
    state = {k: torch.zeros(s) for k, s in _shapes(spec).items()}
    return [state] * 5  # five members, one storage each tensor


PREDICTOR_EXPANSIONS = {
    "stride 0": (_expanded, r"states\[0\]\['net.1.weight'\] declares \(6, 16\) \(384 bytes\) "
                            r"over 4 bytes of storage \(strides \(0, 0\)\)"),
    "overlapping rows": (_overlapping, r"states\[0\]\['net.1.weight'\] declares \(6, 16\) "
                                       r"\(384 bytes\) over 64 bytes of storage"),
    "shared between members": (_shared_between_members,
                               r"the states declare \d+ bytes of tensors over \d+ bytes of "
                               "storage: tensors shared between members"),
}


@pytest.mark.parametrize("case", PREDICTOR_EXPANSIONS)
def test_load_predictor_refuses_tensors_larger_than_their_storage(tmp_path, case):
    build, expected = PREDICTOR_EXPANSIONS[case]
    path = _save_states(tmp_path / "p.pt", build(SMALL), SMALL)
    with pytest.raises(ValueError, match=expected):
        load_predictor(path)


def test_load_predictor_keeps_honest_files_and_tied_weights(tmp_path):
    model = SMALL.build()
    loaded = load_predictor(save_predictor(Ensemble([model], [SMALL]), tmp_path / "p.pt"))
    x = torch.randn(2, 1, 4, 4)
    torch.testing.assert_close(loaded(x), Ensemble([model], [SMALL])(x))
    state = dict(model.state_dict())
    state["net.3.weight"] = state["net.3.weight"].t().contiguous().t()  # non-contiguous view
    loaded = load_predictor(_save_states(tmp_path / "t.pt", [state], SMALL))
    torch.testing.assert_close(loaded(x), Ensemble([model], [SMALL])(x))


def test_an_expanded_predictor_of_16_gb_is_refused_in_bounded_memory(tmp_path):
    """A 2 KB file: a 2 x 65536 MLP whose tensors are each one float (16 GB materialised)."""
    code = """
        import resource, sys, time, torch
        from fedfusion.core.architecture import ModelSpec
        from fedfusion.strategies.predictors import load_predictor
        spec = ModelSpec("mlp", (1, 4, 4), 3, {"hidden_layers": 2, "hidden": 65536})
        with torch.device("meta"):
            shapes = {k: v.shape for k, v in spec.build().state_dict().items()}
        torch.save({"kind": "ensemble", "specs": [spec.to_dict()],
                    "states": [{k: torch.zeros(1).expand(s) for k, s in shapes.items()}]},
                   sys.argv[1])
        start = time.perf_counter()
        try:
            load_predictor(sys.argv[1])
        except ValueError as exc:
            print("refused", time.perf_counter() - start, exc)
    """
    out, peak = run_python(code, str(tmp_path / "big.pt"))
    assert out.startswith("refused") and "over 4 bytes of storage" in out
    assert (tmp_path / "big.pt").stat().st_size < 4096
    assert float(out.split()[1]) < BOUND_S
    assert peak < 2048, f"peak RSS {peak:.0f} MB"  # torch alone ~0.7 GB; the claims: GB-TB


# ------------------------------------------------------------------ item 6: partition files

def npy_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


def npy_header(shape: tuple[int, ...], descr: str = "<i8") -> bytes:
    buffer = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        buffer, {"descr": descr, "fortran_order": False, "shape": shape})
    return buffer.getvalue()


def write_zip(path: Path, members: dict[str, bytes],
              compression: int = zipfile.ZIP_DEFLATED) -> Path:
    with zipfile.ZipFile(path, "w", compression) as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return path


def claim_uncompressed_size(path: Path, size: int) -> None:
    """Patch every central-directory entry of a zip to claim ``size`` uncompressed bytes."""
    data = bytearray(path.read_bytes())
    at = data.find(b"PK\x01\x02")
    while at >= 0:
        data[at + 24:at + 28] = size.to_bytes(4, "little")
        at = data.find(b"PK\x01\x02", at + 4)
    path.write_bytes(bytes(data))


ROWS = npy_bytes(np.arange(3, dtype=np.int64))
PARTITION_DEFECTS = {
    "deep json": (lambda p: p.with_suffix(".json").write_text(
        '{"clients": ' + "[" * 100_000 + "]" * 100_000 + "}"),
        ".json", "nests 100001 levels deep, the limit is 8"),
    "deep json under a key": (lambda p: p.with_suffix(".json").write_text(
        '{"k": {"clients": [[0], [1' + "[" * 9 + "]" * 9 + "]]}}"),
        ".json", "nests 13 levels deep"),
    "big json": (lambda p: p.with_suffix(".json").write_bytes(
        b" " * (pf.MAX_PARTITION_JSON_BYTES + 1)),
        ".json", f"over the {16 << 20} byte limit of a .json partition"),
    "npy header claims 8 TiB": (lambda p: write_zip(p, {
        "client0.npy": npy_header((2**40,)) + b"\0" * 8, "client1.npy": ROWS}),
        ".npz", "array 'client0' holds 8 data bytes; its shape (1099511627776,) and dtype "
                "<i8 need 8796093022208"),
    "zip header claims 4 GiB": (lambda p: claim_uncompressed_size(write_zip(p, {
        "client0.npy": ROWS, "client1.npy": ROWS}), 2**32 - 16),
        ".npz", "its arrays declare 8589934560 uncompressed bytes in the zip headers, over "
                "the 1073741824 byte limit; not inflated"),
    "npy header claims too few": (lambda p: write_zip(p, {
        "client0.npy": npy_header((2,)) + b"\0" * 24, "client1.npy": ROWS}),
        ".npz", "array 'client0' holds 24 data bytes; its shape (2,) and dtype <i8 need 16"),
    "object array": (lambda p: write_zip(p, {
        "client0.npy": npy_header((2,), "|O") + b"\0" * 16, "client1.npy": ROWS}),
        ".npz", "array 'client0' has dtype object; expected one of"),
    "bzip2 member": (lambda p: write_zip(p, {"client0.npy": ROWS, "client1.npy": ROWS},
                                         zipfile.ZIP_BZIP2),
                     ".npz", "uses zip compression 12; np.savez writes stored or deflated"),
}


@pytest.mark.parametrize("case", PARTITION_DEFECTS)
def test_partition_file_defects_are_partition_errors_naming_the_file(tmp_path, case):
    write, suffix, message = PARTITION_DEFECTS[case]
    path = tmp_path / f"p{suffix}"
    write(path)
    start = time.perf_counter()
    with pytest.raises(PartitionError) as info:
        pf.read_partition_file(path, num_rows=10, num_clients=2, key="k" if "key" in case
                               else "")
    assert time.perf_counter() - start < BOUND_S
    assert f"partition file {str(path)!r}" in str(info.value)
    assert message in str(info.value)


def test_npz_partitions_of_stored_and_deflated_rows_still_load(tmp_path):
    for compression in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
        path = write_zip(tmp_path / "p.npz", {
            "g/client0.npy": npy_bytes(np.array([4, 0], dtype=np.int32)),
            "g/client1": npy_bytes(np.array([1], dtype=np.uint8)),
            "g/val.npy": npy_bytes(np.array([2, 2])), "other/client0.npy": b"junk"},
            compression)
        part = pf.read_partition_file(path, num_rows=10, num_clients=2, key="g")
        assert [c.tolist() for c in part.clients] == [[4, 0], [1]]
        assert part.val is not None and part.val.tolist() == [2, 2]


def test_hostile_partition_files_are_refused_in_bounded_memory(tmp_path):
    """The 8 TiB header and the deep and largest JSON, in a fresh interpreter."""
    for case in ("npy header claims 8 TiB", "deep json", "big json"):
        write, suffix, _ = PARTITION_DEFECTS[case]
        write(tmp_path / f"{case.replace(' ', '_')}{suffix}")
    code = """
        import sys, time
        from pathlib import Path
        from fedfusion.datasets import PartitionError
        from fedfusion.datasets.partition_file import read_partition_file
        for path in sorted(Path(sys.argv[1]).iterdir()):
            start = time.perf_counter()
            try:
                read_partition_file(path, num_rows=10, num_clients=2)
            except PartitionError:
                print(path.name, time.perf_counter() - start)
    """
    out, peak = run_python(code, str(tmp_path))
    times = {line.split()[0]: float(line.split()[1]) for line in out.splitlines()}
    assert len(times) == 3 and max(times.values()) < BOUND_S, times
    assert peak < 2048, f"peak RSS {peak:.0f} MB"  # torch alone ~0.7 GB; the claims: GB-TB


# ------------------------------------------------------------------ item 8: replay totals

def _kron_folder(folder: Path, clients: int = 3) -> Path:
    return save_uploads(folder, [kron_upload(c, weight=0.5, eigenvalue=1.0, seed=c)
                                 for c in range(clients)], {"strategy": "fedbens"})


def _declared(folder: Path) -> list[int]:
    return [sum(i.file_size for i in zipfile.ZipFile(p).infolist())
            for p in sorted(folder.glob("client_*.npz"))]


def test_load_uploads_caps_the_total_of_all_clients(tmp_path):
    folder = _kron_folder(tmp_path / "uploads")
    sizes = _declared(folder)
    _, uploads, failures = load_uploads(folder, max_total_bytes=sum(sizes))
    assert len(uploads) == 3 and not failures
    with pytest.raises(UploadStoreError) as info:
        load_uploads(folder, max_total_bytes=sum(sizes) - 1)
    text = str(info.value)
    assert str(folder) in text and f"its 3 clients declare {sum(sizes)} uncompressed bytes" in text
    assert f"client 0: {sizes[0]}, client 1: {sizes[1]}" in text
    assert f"above the cap on a replay ({sum(sizes) - 1} bytes, MAX_REPLAY_BYTES" in text
    assert upload_store.MAX_REPLAY_BYTES == 2 * 1024**3


def test_a_client_npz_of_many_entries_is_refused_before_its_directory_is_parsed(
        tmp_path, monkeypatch):
    """A zip directory of a million empty names took 10 s and 0.7 GB to parse; its size is
    read from the end record and capped first, for that client alone."""
    folder = _kron_folder(tmp_path / "uploads")
    honest = max(len(zipfile.ZipFile(p).infolist()) for p in folder.glob("client_*.npz"))
    with zipfile.ZipFile(folder / "client_1.npz", "a") as archive:
        for i in range(50 * honest):
            archive.writestr(f"m0/weights/pad{i}.npy", b"")
    with open(folder / "client_1.npz", "rb") as handle:
        directory = upload_store.zip_directory_bytes(handle)
    monkeypatch.setattr(upload_store, "MAX_NPZ_DIRECTORY_BYTES", directory - 1)
    _, uploads, failures = load_uploads(folder)
    assert [u.client_id for u in uploads] == [0, 2]
    assert failures == [("1", f"client_1.npz: its zip directory declares {directory} bytes, "
                               f"above the cap {directory - 1} (MAX_NPZ_DIRECTORY_BYTES); not "
                               "parsed")]


def test_the_upload_writer_says_when_the_reader_would_refuse_its_manifest(
        tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(upload_store, "MAX_MANIFEST_BYTES", 2000)
    uploads = [kron_upload(c, weight=0.5, eigenvalue=1.0, seed=c) for c in range(3)]
    uploads[2].metrics["curve"] = [0.5] * 300
    with caplog.at_level("ERROR", logger="fedfusion"):
        folder = save_uploads(tmp_path / "uploads", uploads, {})
    size = (folder / "manifest.json").stat().st_size
    assert size > 2000 and len(caplog.records) == 1
    assert caplog.records[0].getMessage() == (
        f"upload folder {folder}: its manifest is {size} bytes, above the 2000 that "
        "load_uploads reads (MAX_MANIFEST_BYTES); the clients with the largest metrics: "
        "[2, 0, 1]")
    with pytest.raises(UploadStoreError, match="above the cap 2000"):
        load_uploads(folder)


def _claim_array(path: Path, elements: int) -> None:
    """Rewrite a client's npz as one float32 array whose .npy and zip headers both declare
    ``elements`` values, holding none of them (what a deflated run of zeros costs on disk)."""
    header = npy_header((elements,), "<f4")
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("m0/weights/net.1.weight.npy", header)
    claim_uncompressed_size(path, len(header) + 4 * elements)


def test_declared_sizes_are_checked_before_any_array_is_read(tmp_path):
    """Three clients of 1.27 GB each (3.8 GB in all, under the per-client cap): refused from
    their headers, in bounded memory and time."""
    folder = _kron_folder(tmp_path / "uploads")
    for path in folder.glob("client_*.npz"):
        _claim_array(path, 317_000_000)
    assert sum(_declared(folder)) > 3.8e9
    code = """
        import sys, time
        from fedfusion.upload_store import UploadStoreError, load_uploads
        start = time.perf_counter()
        try:
            load_uploads(sys.argv[1])
        except UploadStoreError as exc:
            print(time.perf_counter() - start, exc)
    """
    out, peak = run_python(code, str(folder))
    assert "its 3 clients declare 3804000" in out and "nothing was read" in out, out
    assert float(out.split()[0]) < BOUND_S
    assert peak < 2048, f"peak RSS {peak:.0f} MB"  # torch alone ~0.7 GB; the claims: GB-TB


# ------------------------------------------------------------------ item 7: output folders

def _outside(tmp_path: Path) -> Path:
    """A folder outside the run with a file in it: what a symlink would send writes to."""
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "precious.txt").write_text("keep me")
    return target


def _untouched(target: Path) -> bool:
    return sorted(p.name for p in target.iterdir()) == ["precious.txt"] and (
        target / "precious.txt").read_text() == "keep me"


def _settings(tmp_path: Path) -> Settings:
    return Settings(output_dir=str(tmp_path / "out"), run_name="run")


OUTPUT_LINKS = {  # what the link is, where it points, the text of the refusal
    "run folder": ("out/run", "elsewhere", "exists as a symlink, not a folder"),
    "uploads": ("out/run/uploads", "elsewhere", "it is a symlink"),
    "results.json": ("out/run/results.json", "elsewhere/precious.txt", "it is a symlink"),
    "predictor.pt": ("out/run/predictor.pt", "elsewhere/precious.txt", "it is a symlink"),
    "dangling results.json": ("out/run/results.json", "elsewhere/new.json", "it is a symlink"),
}


@pytest.mark.parametrize("case", OUTPUT_LINKS)
def test_output_folder_refuses_links_to_anywhere(tmp_path, case):
    link, to, message = OUTPUT_LINKS[case]
    target = _outside(tmp_path)
    (tmp_path / link).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / link).symlink_to(tmp_path / to)
    with pytest.raises(OSError, match=message):
        output_folder(_settings(tmp_path))
    assert _untouched(target)


def test_writers_do_not_follow_links(tmp_path):
    target = _outside(tmp_path)
    upload = kron_upload(0, weight=0.5, eigenvalue=1.0)
    (tmp_path / "uploads").symlink_to(target)
    with pytest.raises(OSError, match="uploads: it exists as a symlink, not a folder"):
        save_uploads(tmp_path / "uploads", [upload], {})
    real = tmp_path / "real"
    real.mkdir()
    for name in ("client_0.npz", "manifest.json"):  # a link at any file it writes
        (real / name).symlink_to(target / "precious.txt")
        with pytest.raises(OSError, match=f"refusing to write {real / name}: it is a symlink"):
            save_uploads(real, [upload], {})
        (real / name).unlink()
    (tmp_path / "p.pt").symlink_to(target / "precious.txt")
    with pytest.raises(OSError, match="it is a symlink"):
        save_predictor(Ensemble([SMALL.build()], [SMALL]), tmp_path / "p.pt")
    with pytest.raises(OSError, match="it is a symlink"):
        open_no_follow(tmp_path / "p.pt")
    assert _untouched(target)
    # real folders and files, existing or not, are written (and files overwritten)
    (real / "manifest.json").write_text("old")
    assert load_uploads(save_uploads(real, [upload], {}))[1][0].client_id == 0
    folder = output_folder(_settings(tmp_path))
    assert folder == (tmp_path / "out" / "run").resolve() and output_folder(
        _settings(tmp_path)) == folder
