"""Run the FedBEns authors' Kron script unchanged, with timers around its phases.

Their code (github jacopot96/FedBEns, commit b2c9813) is fetched beside the repo, never
copied into it; ``--code`` names its ``One_shot_FL`` folder. This runs its
``main_FedBEns_kron.py`` in this process, as ``python main_FedBEns_kron.py`` would, after
wrapping four of its functions with timers (their behaviour untouched):

* ``train_model_kron.fl_setting_training``: the client phase (every client's members trained
  one after another, their Kron Laplace fits, and the code's own train-accuracy check);
* ``laplace``'s ``fit``: the Kron fits alone, inside the client phase;
* ``MixtureModel_kron_nb.__init__`` and ``.optimize``: the server (the mixture's set-up and
  the 300 Adam steps from each of the M starts, with validation every 30);
* ``test_img_ensemble``: the accuracy and NLL of the ensemble of the modes, as it prints them.

Their setting: FMNIST, bias-free LeNet, C = 5, M = 5, T = 0.1, validation at the server, their
own Dirichlet split (numpy seed 3, whatever ``--seed``). The script reads FMNIST through
torchvision from ``./data/fashionmnist`` under ``--work`` (``FashionMNIST/raw`` holding the
four unpacked IDX files: nothing is downloaded) and writes ``results/*.csv`` there.

Their code asks for CUDA by name. ``--cpu`` replaces that one word in memory (the CPU
setting of ``../shared/notes/fedbens-reference-run.md``), for a dry run without a GPU.

    python benchmarks/authors_code.py --code DIR/One_shot_FL --work DIR --alpha 0.1 --seed 0 \\
        --json out.json [--epochs 20] [--cpu]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

#: their script, and the one word of it that ``--cpu`` changes
SCRIPT = "main_FedBEns_kron.py"
CUDA_SETTING = "\"device\": 'cuda'"
#: the start of the line printed as a timed call ends: the phase, its seconds so far
PHASE_LINE = "authors_code phase:"


class PhaseClock:
    """Seconds spent inside each wrapped function, summed over its calls."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.returned: dict[str, Any] = {}
        self.open: set[str] = set()  # a call inside a timed call of its phase counts once

    def wrap(self, phase: str, function: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(function)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if phase in self.open:
                return function(*args, **kwargs)
            self.open.add(phase)
            start = time.perf_counter()
            try:
                value = function(*args, **kwargs)
            finally:
                self.open.discard(phase)
                self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - start
                # as each call ends: a run stopped later still tells what it finished
                print(f"{PHASE_LINE} {phase} {self.seconds[phase]:.3f}", flush=True)
            self.returned[phase] = value
            return value
        return timed


def run(code: Path, alpha: float, seed: int, epochs: int, cpu: bool) -> dict[str, Any]:
    """Their script at (alpha, seed) in this process; its phases' seconds and its scores."""
    sys.path.insert(0, str(code))
    import algs.ultils_mixtures_kron as mixture
    import torch
    import train_model_kron
    import utils.compute_accuracy as accuracy
    from laplace.baselaplace import BaseLaplace

    clock = PhaseClock()
    train_model_kron.fl_setting_training = clock.wrap(
        "client", train_model_kron.fl_setting_training)
    mixture.MixtureModel_kron_nb.__init__ = clock.wrap(
        "server", mixture.MixtureModel_kron_nb.__init__)
    mixture.MixtureModel_kron_nb.optimize = clock.wrap(
        "server", mixture.MixtureModel_kron_nb.optimize)
    accuracy.test_img_ensemble = clock.wrap("ensemble_test", accuracy.test_img_ensemble)
    fits = [cls for cls in _subclasses(BaseLaplace) if "fit" in vars(cls)]
    for cls in fits:
        cls.fit = clock.wrap("kron_fit", cls.fit)

    source = (code / SCRIPT).read_text()
    if cpu:
        if CUDA_SETTING not in source:
            raise SystemExit(f"{SCRIPT} no longer says {CUDA_SETTING}: cannot run it on the CPU")
        source = source.replace(CUDA_SETTING, "\"device\": 'cpu'")
    sys.argv = [SCRIPT, "--dataset", "FashionMNIST", "--model", "LeNet", "--seed", str(seed),
                "--local_epochs", str(epochs), f"--alpha={alpha:g}", "--temperature", "0.1",
                "--num_clients", "5", "--n_mixtures", "5", "--weights", "False",
                "--local_ens", "1", "--val_at_server", "True"]
    Path("results").mkdir(exist_ok=True)
    start = time.perf_counter()
    exec(compile(source, str(code / SCRIPT), "exec"), {"__name__": "__main__"})
    wall = time.perf_counter() - start
    acc, nll, _, _ = clock.returned["ensemble_test"]
    return {
        "accuracy": float(acc) / 100.0, "nll": float(nll), "wall_s": wall,
        "client_s": clock.seconds["client"], "client_fit_s": clock.seconds.get("kron_fit", 0.0),
        "server_s": clock.seconds["server"], "device": "cpu" if cpu else "cuda",
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "peak_gpu_gb": torch.cuda.max_memory_allocated() / 2**30
        if torch.cuda.is_available() else 0.0,
    }


def _subclasses(cls: type) -> list[type]:
    found = [cls]
    for sub in cls.__subclasses__():
        found += _subclasses(sub)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--code", type=Path, required=True, help="their One_shot_FL folder")
    parser.add_argument("--work", type=Path, required=True,
                        help="working folder holding data/fashionmnist/FashionMNIST/raw")
    parser.add_argument("--alpha", type=float, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--cpu", action="store_true", help="their 'cuda' replaced by 'cpu'")
    parser.add_argument("--json", type=Path, required=True, help="where the figures go")
    args = parser.parse_args()
    code, target = args.code.resolve(), args.json.resolve()
    os.chdir(args.work)
    figures = run(code, args.alpha, args.seed, args.epochs, args.cpu)
    target.write_text(json.dumps({"alpha": args.alpha, "seed": args.seed,
                                  "local_epochs": args.epochs, **figures}, indent=1))
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
