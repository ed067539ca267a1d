"""Mutation check: swap each strategy's fusion for the lazy answer and list the tests that fail.

A test suite that a stub passes proves nothing. For every strategy of ``fedfusion.strategies``
this script replaces the one method the strategy overrides to fuse (``fuse``; FedProx's server
is FedAvg's, so there its constructor's ``prox-mu``) by a lazy implementation, runs the tests
listed for that strategy below, and reports which of them fail. Every strategy must have at
least one failing test per mutant; a mutant no test catches ("survived") is a gap in the suite.

The mutants:

* ``fedavg``: ``fuse`` returns FedAvg of the same uploads (``FedAvg.fuse`` of a FedAvg that
  shares the strategy's context: the same members, sample-size weights);
* ``ensemble``: ``fuse`` returns the uniform ensemble of the uploaded members (the lazy
  answer of the strategies that combine or distil client models: FedBEns, AMS, DENSE);
* ``client0``: ``fuse`` returns the lowest client id's model(s), unfused (FedAvg's own lazy
  answer);
* ``no-prox``: FedProx sends no ``prox-mu``, so its clients train as FedAvg's.

The library is never edited: the same file is a pytest plugin (``-p mutation_check`` with
``scripts/`` on ``PYTHONPATH``) that patches the class in the test process when the
environment variable ``FEDFUSION_MUTANT=<strategy>:<mutant>`` is set. Tests that launch
``flwr run`` in another process are not listed (the patch would not reach them).

Usage (from the project root; one pytest process at a time, one torch thread)::

    PYTHONPATH=. .venv/bin/python scripts/mutation_check.py [--only regmean,otfusion]

prints a table and writes ``benchmarks/results/mutation.json``: per mutant, every listed test
with its outcome unmutated and mutated and the first line of the failure.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
ENV = "FEDFUSION_MUTANT"
RESULTS = ROOT / "benchmarks" / "results" / "mutation.json"

LIBRARY_FEDBENS = ("tests/test_library.py::"
                   "test_fedbens_regmean_and_ams_fuse_a_users_model_through_its_own_client_app")




def transformer_cells(strategy: str, families: Sequence[str] = ("vit", "token_transformer")
                      ) -> tuple[str, ...]:
    """The model-matrix cells of ``strategy`` on the zoo's transformers: each must predict
    otherwise than client 0's model and FedAvg of the same uploads."""
    return tuple(f"tests/strategies/test_model_matrix.py::test_every_strategy_on_the_transformers"
                 f"[{strategy}-{family}]" for family in families)


def family_cells(strategy: str) -> tuple[str, ...]:
    """The model-matrix cells of ``strategy`` on the CNN, ResNet and LayerNorm-MLP families:
    each must predict otherwise than client 0's model and (unless the strategy is FedAvg on
    the server) FedAvg of the same uploads; OTFusion's must undo a permutation FedAvg cannot."""
    return tuple(f"tests/strategies/test_model_matrix.py::test_every_strategy_on_every_model_family"
                 f"[{strategy}-{family}]"
                 for family in ("bn_cnn", "resnet_bn", "resnet_plain", "ln_mlp"))


@dataclass(frozen=True)
class Target:
    """A strategy (its registry name), the mutants applied to it, the tests that cover it."""

    strategy: str
    mutants: tuple[str, ...]
    tests: tuple[str, ...]


#: per strategy: the tests that must catch a lazy fusion (brute-force references on tiny
#: nets, and the real-data comparisons against FedAvg / the ensemble of the same uploads)
TARGETS: tuple[Target, ...] = (
    Target("fedbens", ("fedavg", "ensemble", "client0"), (
        "tests/strategies/test_fedbens.py::test_member_starts_climb_from_every_member_to_a_mode_each",
        "tests/strategies/test_fedbens.py::test_fedbens_and_selected_ensembles_on_real_fmnist_with_replay_and_client_removal",
        LIBRARY_FEDBENS, *family_cells("fedbens"), *transformer_cells("fedbens"))),
    Target("fedfisher", ("fedavg", "ensemble", "client0"), (
        "tests/strategies/test_fedfisher.py::test_kron_optimum_is_the_dense_minimiser",
        "tests/strategies/test_fedfisher.py::test_diag_optimum_is_the_closed_form_and_fisher_merge",
        "tests/strategies/test_fedfisher.py::test_fedfisher_on_real_fmnist",
        "tests/strategies/test_fedfisher.py::test_identical_clients_give_that_client",
        *family_cells("fedfisher"), *transformer_cells("fedfisher"))),
    Target("fisher-merge", ("fedavg", "ensemble", "client0"), (
        "tests/strategies/test_fedfisher.py::test_fisher_merge_matches_an_elementwise_loop",
        "tests/strategies/test_fedfisher.py::test_fisher_merge_on_real_fmnist",
        *family_cells("fisher-merge"), *transformer_cells("fisher-merge"))),
    Target("regmean", ("fedavg", "client0"), (
        "tests/strategies/test_regmean.py::test_alpha_one_is_least_squares_on_the_pooled_inputs",
        "tests/strategies/test_regmean.py::test_real_fmnist_federation",
        "tests/test_library.py::test_plain_python_upload_from_models_and_fuse",
        "tests/strategies/test_regmean.py::test_identical_clients_fuse_to_that_client",
        *family_cells("regmean"), *transformer_cells("regmean"))),
    Target("otfusion", ("fedavg", "client0"), (
        "tests/strategies/test_otfusion.py::test_a_permuted_copy_fuses_back_exactly",
        "tests/strategies/test_otfusion.py::test_fusion_is_the_weighted_average_of_the_aligned_clients",
        "tests/strategies/test_otfusion.py::test_identical_clients_fuse_to_that_client",
        "tests/strategies/test_otfusion.py::test_clients_from_different_inits_fuse_far_better_than_fedavg",
        "tests/strategies/test_otfusion.py::test_real_fmnist_federation_from_a_common_init_is_fedavg",
        *family_cells("otfusion"))),
    Target("dense", ("fedavg", "ensemble", "client0"), (
        "tests/strategies/test_dense.py::test_distillation_is_deterministic_given_the_seed",
        "tests/strategies/test_dense.py::"
        "test_one_client_is_distilled_into_a_random_student_that_agrees_on_real_images",
        "tests/strategies/test_dense.py::test_fmnist_federation_beats_the_fedavg_student_it_starts_from",
        *family_cells("dense"), *transformer_cells("dense", ("vit",)))),
    Target("co-boosting", ("fedavg", "ensemble", "client0"), (
        "tests/strategies/test_co_boosting.py::"
        "test_distillation_is_deterministic_given_the_seed_and_leaves_the_global_rng",
        "tests/strategies/test_co_boosting.py::test_fmnist_federation_beats_the_fedavg_of_the_same_uploads",
        *family_cells("co-boosting"), *transformer_cells("co-boosting", ("vit",)))),
    Target("fens", ("fedavg", "ensemble", "client0"), (
        "tests/strategies/test_fens.py::test_federated_rounds_match_brute_force_on_a_tiny_net",
        "tests/strategies/test_fens.py::test_real_fmnist_fens_beats_the_ensemble_fedavg_and_one_client",
        *family_cells("fens"), *transformer_cells("fens"))),
    Target("swa", ("fedavg", "client0"), (
        "tests/strategies/test_swa.py::test_hand_built_two_clients_hos",
        "tests/strategies/test_swa.py::test_one_shot_swa_and_its_replay",
        "tests/strategies/test_swa.py::test_multi_round_swa_improves_on_real_fmnist",
        "tests/strategies/test_swa.py::test_identical_clients_fuse_to_that_client",
        *family_cells("swa"), *transformer_cells("swa"))),
    Target("ams", ("fedavg", "ensemble", "client0"), (
        "tests/strategies/test_ams.py::test_top1_picks_the_highest_max_logit_not_the_most_confident_softmax",
        "tests/strategies/test_ams.py::test_top_k_matches_a_per_sample_brute_force",
        "tests/strategies/test_ams.py::test_cross_architecture_ams_runs_end_to_end",
        "tests/strategies/test_ams.py::test_replay_reproduces_ams_and_feeds_ams_full_and_the_ensemble",
        "tests/strategies/test_ams.py::test_calibrated_ams_on_real_fmnist_is_its_rule_and_beats_raw_ams",
        LIBRARY_FEDBENS, *family_cells("ams"), *transformer_cells("ams"))),
    Target("pfnm", ("fedavg", "client0"), (
        "tests/strategies/test_pfnm.py::test_a_model_matched_with_its_permuted_copy_is_the_model",
        "tests/strategies/test_pfnm.py::test_the_global_neurons_are_the_posterior_means",
        "tests/strategies/test_pfnm.py::test_pfnm_beats_fedavg_on_hetero_label_fmnist")),
    Target("ensemble", ("fedavg", "client0"), (
        "tests/strategies/test_strategies.py::test_ensemble_holds_every_member_of_every_client",
        "tests/strategies/test_strategies.py::"
        "test_replay_reproduces_the_live_result_and_feeds_other_strategies",
        *family_cells("ensemble"), *transformer_cells("ensemble"))),
    Target("fedavg", ("client0",), (
        "tests/strategies/test_strategies.py::test_fedavg_is_the_sample_weighted_mean",
        "tests/strategies/test_strategies.py::"
        "test_replay_reproduces_the_live_result_and_feeds_other_strategies",
        "tests/strategies/test_strategies.py::test_fedavg_of_identical_clients_is_that_client",
        "tests/strategies/test_strategies.py::test_multi_round_fedavg_improves",
        *family_cells("fedavg"), *transformer_cells("fedavg"))),
    Target("fedprox", ("no-prox",), (
        "tests/training/test_local_objectives.py::"
        "test_fedprox_mu_zero_is_fedavg_exactly_and_mu_reaches_the_clients",
        "tests/training/test_local_objectives.py::test_fedprox_sends_mu_in_the_train_config")),
)

MUTANTS = {
    "fedavg": "fuse() returns FedAvg of the same uploads",
    "ensemble": "fuse() returns the uniform ensemble of the uploaded members",
    "client0": "fuse() returns the lowest client id's model(s), unfused",
    "no-prox": "FedProx sends no prox-mu (its clients train as FedAvg's)",
}


# ------------------------------------------------------------------------ the pytest plugin
def _fedavg_fuse() -> Callable[[Any, Sequence[Any]], Any]:
    from fedfusion.strategies import FedAvg

    original = FedAvg.fuse  # captured before any patch

    def fuse(self: Any, uploads: Sequence[Any]) -> Any:
        fedavg = FedAvg(self.context.model_spec)
        fedavg.context = self.context  # the same spec, device, validation set and seed
        return original(fedavg, uploads)

    return fuse


def _ensemble_fuse() -> Callable[[Any, Sequence[Any]], Any]:
    from fedfusion.strategies import UniformEnsemble

    original = UniformEnsemble.fuse

    def fuse(self: Any, uploads: Sequence[Any]) -> Any:
        ensemble = UniformEnsemble(self.context.model_spec)  # every member: size 0
        ensemble.context = self.context  # the same spec, device, validation set and seed
        return original(ensemble, uploads)

    return fuse


def _client0_fuse(self: Any, uploads: Sequence[Any]) -> Any:
    from fedfusion.core.predictors import Ensemble

    first = min(uploads, key=lambda u: u.client_id)
    spec = self.context.spec_for(first)
    return Ensemble([spec.build(first.weights(m)) for m in range(first.num_members)],
                    [spec] * first.num_members)


def apply_mutant(value: str) -> str:
    """Patch the strategy named in ``value`` (``"<strategy>:<mutant>"``) in this process;
    return what was done."""
    from fedfusion.strategies import STRATEGIES, FedProx

    strategy, _, mutant = value.partition(":")
    if strategy not in STRATEGIES or mutant not in MUTANTS:
        raise ValueError(f"{ENV}={value!r}: need <strategy>:<mutant> with a strategy of "
                         f"{sorted(STRATEGIES)} and a mutant of {sorted(MUTANTS)}")
    cls = STRATEGIES[strategy]
    if mutant == "no-prox":
        if not issubclass(cls, FedProx):
            raise ValueError(f"{ENV}={value!r}: no-prox applies to fedprox only")
        init = FedProx.__init__

        def no_prox(self: Any, *args: Any, **kwargs: Any) -> None:
            init(self, *args, **kwargs)
            self.client_config.pop("prox-mu", None)

        FedProx.__init__ = no_prox  # type: ignore[method-assign]
    else:
        fuse = {"fedavg": _fedavg_fuse, "ensemble": _ensemble_fuse,
                "client0": lambda: _client0_fuse}[mutant]()
        cls.fuse = fuse  # type: ignore[method-assign]
    return f"{cls.__name__}: {MUTANTS[mutant]}"


_APPLIED: list[str] = []


def pytest_configure(config: Any) -> None:
    value = os.environ.get(ENV, "")
    if value:
        _APPLIED.append(apply_mutant(value))


def pytest_report_header(config: Any) -> str:
    return f"mutant: {os.environ.get(ENV, '')} ({_APPLIED[0]})" if _APPLIED else "mutant: none"


# ------------------------------------------------------------------------------- the runner
def run_tests(tests: Sequence[str], mutant: str | None, report: Path) -> dict[str, dict]:
    """Run ``tests`` in one pytest process (with ``mutant`` applied if given); per test its
    outcome ("passed", "failed", "error", "skipped", "missing") and failure's first line."""
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "scripts")])}
    env.pop(ENV, None)
    if mutant is not None:
        env[ENV] = mutant
    report.unlink(missing_ok=True)
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "mutation_check",
                    "-p", "no:cacheprovider", f"--junitxml={report}", *tests],
                   cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   check=False)
    outcomes = {test: {"outcome": "missing", "message": ""} for test in tests}
    if not report.is_file():
        return outcomes
    seen: dict[str, list[tuple[str, str]]] = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        path = case.get("classname", "").replace(".", "/") + ".py"
        # a listed test covers all its parameters; one listed with "[params]" only that case
        name, _, params = case.get("name", "").partition("[")
        if f"{path}::{name}[{params}" in outcomes:
            name = f"{name}[{params}"
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            found = case.find(tag)
            if found is not None:
                outcome = "failed" if tag == "failure" else tag
                # where in the tests it failed (the last test-file frame), and the message
                frames = re.findall(r"^(tests/\S+\.py:\d+): ", found.text or "", re.M)
                text = " ".join((found.get("message") or "").split())
                param = case.get("name", "").partition("[")[2]
                message = (f"[{param} " if param else "") + (f"{frames[-1]}: " if frames
                                                              else "") + text
                message = message[:240]
                break
        seen.setdefault(f"{path}::{name}", []).append((outcome, message))
    for test, cases in seen.items():
        if test in outcomes:
            bad = [c for c in cases if c[0] in ("failed", "error")]
            outcome = bad[0][0] if bad else ("passed" if any(c[0] == "passed" for c in cases)
                                             else cases[0][0])
            outcomes[test] = {"outcome": outcome, "message": bad[0][1] if bad else "",
                              "cases": len(cases), "cases_failing": len(bad)}
    return outcomes


def git_state() -> dict[str, Any]:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                              check=False).stdout.strip()

    return {"commit": git("rev-parse", "HEAD"),
            "dirty_files": len(git("status", "--porcelain", "--untracked-files=no")
                               .splitlines())}


def table(entries: Sequence[dict[str, Any]]) -> str:
    lines = ["| strategy | mutant | tests failing / listed | failing tests |",
             "|---|---|---|---|"]
    for entry in entries:
        killed = ", ".join(f"`{t.split('::')[-1]}`" for t in entry["killed_by"]) or "**none**"
        lines.append(f"| {entry['strategy']} | {entry['mutant']} | {len(entry['killed_by'])} / "
                     f"{len(entry['tests'])} | {killed} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="", help="comma list of strategies (default: all)")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    only = {s for s in args.only.split(",") if s}
    targets = [t for t in TARGETS if not only or t.strategy in only]
    if not targets:
        parser.error(f"no strategy in --only {args.only!r}")
    report = Path(tempfile.mkdtemp(prefix="fedfusion-mutation-")) / "junit.xml"
    start = time.perf_counter()
    listed = list(dict.fromkeys(test for t in targets for test in t.tests))
    print(f"baseline: {len(listed)} test(s), unmutated", flush=True)
    baseline = run_tests(listed, None, report)
    broken = [t for t, r in baseline.items() if r["outcome"] != "passed"]
    for test in broken:
        print(f"  NOT PASSING UNMUTATED: {test}: {baseline[test]}", flush=True)
    entries = []
    for target in targets:
        for mutant in target.mutants:
            value = f"{target.strategy}:{mutant}"
            began = time.perf_counter()
            outcomes = run_tests(target.tests, value, report)
            killed = [t for t in target.tests if baseline[t]["outcome"] == "passed"
                      and outcomes[t]["outcome"] in ("failed", "error")]
            entries.append({
                "strategy": target.strategy, "mutant": mutant, "description": MUTANTS[mutant],
                "tests": {t: {"unmutated": baseline[t]["outcome"], **outcomes[t]}
                          for t in target.tests},
                "killed_by": killed, "survived": not killed,
                "seconds": round(time.perf_counter() - began, 1)})
            print(f"{value:<22} {len(killed)}/{len(target.tests)} failing"
                  f"{'  SURVIVED' if not killed else ''}  ({entries[-1]['seconds']} s)",
                  flush=True)
            for test in target.tests:
                result = outcomes[test]
                print(f"    {result['outcome']:<7} {test.split('::')[-1]}: "
                      f"{result['message'][:110]}", flush=True)
    report.unlink(missing_ok=True)
    report.parent.rmdir()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "what": "each strategy's fusion swapped for a lazy answer (scripts/mutation_check.py); "
                "killed_by: listed tests that pass unmutated and fail mutated",
        **git_state(), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "seconds": round(time.perf_counter() - start, 1),
        "baseline_not_passing": broken, "mutants": entries}, indent=1) + "\n")
    print("\n" + table(entries) + f"\n\nwritten: {out}")
    return 1 if broken or any(e["survived"] for e in entries) else 0


if __name__ == "__main__":
    sys.exit(main())
