"""Readers of files a user or an attacker hands over, bounded in memory and time (issue 26):
predictor files that expand on load (item 5), partition files (item 6), output folders with
symlinks in them (item 7) and replays whose clients add up (item 8)."""

from __future__ import annotations

import resource
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from fedfusion.architecture import ModelSpec
from fedfusion.predictors import Ensemble, load_predictor, save_predictor

ROOT = Path(__file__).resolve().parents[1]
SMALL = ModelSpec("mlp", (1, 4, 4), 3, {"hidden_layers": 1, "hidden": 6})


def run_python(code: str, *args: str) -> tuple[str, float]:
    """Run ``code`` in a fresh interpreter; return its stdout and its peak RSS in MB."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=60,
                          env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    return done.stdout, peak


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
        from fedfusion.architecture import ModelSpec
        from fedfusion.predictors import load_predictor
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
    assert float(out.split()[1]) < 5
    assert peak < 1024, f"peak RSS {peak:.0f} MB"
