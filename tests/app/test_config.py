import inspect
import math
import subprocess
import sys
import tomllib
from dataclasses import fields, replace
from pathlib import Path

import numpy as np
import pytest
from conftest import SmallCNN, initial_models

from fedfusion.app.client_round import member_seed
from fedfusion.app.config import (
    DATA_KEYS,
    FUSION_KEYS,
    NODE_OVERRIDES,
    PATH_KEYS,
    STRATEGY_KEYS,
    ConfigError,
    Settings,
    build_strategy,
    knob_of,
)
from fedfusion.app.federation import federated_split
from fedfusion.app.knobs import GROUPS
from fedfusion.app.local_objective import LocalObjective
from fedfusion.app.reference import BEGIN, END, key_table, pyproject_mismatches, with_key_table
from fedfusion.core.predictors import ModelSpec
from fedfusion.distillation import DistillOptions
from fedfusion.strategies import STRATEGIES, FedAvg, FedProx
from fedfusion.training import TrainConfig

REPO = Path(__file__).resolve().parents[2]
PYPROJECT = REPO / "pyproject.toml"
DOC = REPO / "docs" / "configuration.md"


def test_pyproject_defaults_are_the_settings_defaults():
    config = tomllib.loads(PYPROJECT.read_text())["tool"]["flwr"]["app"]["config"]
    assert Settings.from_mapping(config) == Settings()
    assert set(config) == set(Settings().to_mapping()), "every knob lives in pyproject"


def test_typo_is_rejected_with_a_hint():
    with pytest.raises(ConfigError, match="unknown run-config key 'num-client'.*num-clients"):
        Settings.from_mapping({"num-client": 3})


@pytest.mark.parametrize(("values", "message"), [
    ({"alpha": "0.1"}, "'alpha' must be float"),
    ({"num-clients": 0}, "'num-clients' must be >= 1"),
    ({"strategy": "fedsomething"}, "'strategy' is 'fedsomething'"),
    ({"dataset": "imagenet"}, "'dataset' is 'imagenet'"),
    ({"model-kwargs": "{bad"}, "'model-kwargs' is not JSON"),
    # hostile values are ConfigErrors naming the key, never RecursionError/ValueError/...
    ({"model-kwargs": "[" * 100_000 + "]" * 100_000}, "'model-kwargs' is not JSON: Recursion"),
    ({"client-models": "[" * 100_000 + "]" * 100_000}, "'client-models' is not JSON"),
    ({"model-kwargs": '{"hidden": ' + "9" * 5000 + "}"}, "'model-kwargs' is not JSON: .*digits"),
    ({"model-kwargs": '{"hidden": NaN}'}, "'model-kwargs' is not JSON: NaN is not a JSON num"),
    ({"screen-factor": 10**400}, "'screen-factor': .* is not a usable float"),
    ({"run-name": 10**5000}, "'run-name': <a int too large to show> is not a usable str"),
    ({"num-clients": "x" * 10**5}, r"'num-clients' must be int, got str 'xxx.*\.\.\."),
    ({"partitioner": "fractions", "fractions": "nan,inf", "num-clients": 2},
     "'fractions' must be positive numbers, got 'nan,inf'"),
    ({"labels-per-client": "6,3"}, "labels-per-client"),
    ({"server-device": "tpu"}, "server-device"),
    ({"server-threads": -1}, "'server-threads' must be 0 .* or an integer in 1..1024"),
    ({"server-threads": 10**5}, "'server-threads' must be 0 .* or an integer in 1..1024"),
    ({"client-threads": 10**5}, "'client-threads' must be an integer in 1..1024"),
    ({"seed": 2**63}, r"'seed' must be an integer in \[0, 2\*\*63\)"),
    ({"seed": -1}, r"'seed' must be an integer in \[0, 2\*\*63\)"),
    ({"split-seed": 2**63}, "'split-seed' must be -1"),
    ({"dataset": "digits", "client-data": "local"}, "client-data='local' needs an image"),
    ({"dataset": "digits", "input-mean": "0.5", "input-std": "0.2"}, "'digits' .* has none"),
    ({"server-steps-noval": -5}, "'server-steps-noval' must be >= 0"),
])
def test_bad_values_name_the_key(values, message):
    with pytest.raises(ConfigError, match=message):
        Settings.from_mapping(values)


def test_round_trip_and_int_to_float():
    settings = Settings.from_mapping({"alpha": 1, "strategy": "ensemble"})
    assert settings.alpha == 1.0 and isinstance(settings.alpha, float)
    assert Settings.from_mapping(settings.to_mapping()) == settings


def test_split_seed_fixes_the_split_while_seed_varies_the_inits(small_settings):
    """``split-seed`` pins holdout, training subset and partition (the FedBEns authors'
    protocol: their seeds vary only inits and batch order); -1 follows ``seed``."""
    def split(seed: int, split_seed: int = -1):
        return federated_split(replace(small_settings, seed=seed, split_seed=split_seed))

    def same(a, b) -> bool:
        return (all(np.array_equal(x, y) for x, y in zip(a.client_indices, b.client_indices,
                                                          strict=True))
                and np.array_equal(a.bundle.val_indices, b.bundle.val_indices))

    assert same(split(1, split_seed=0), split(0)) and same(split(2, split_seed=0), split(0))
    assert not same(split(1), split(0))
    pinned = [replace(small_settings, seed=s, split_seed=0) for s in (1, 2)]
    assert member_seed(pinned[0], 0, 0, 1) != member_seed(pinned[1], 0, 0, 1)
    spec = ModelSpec("lenet", (1, 28, 28), 10)
    first, second = (initial_models(spec, 1, s.seed)[0] for s in pinned)
    assert not all(np.array_equal(first[k], second[k]) for k in first)
    with pytest.raises(ConfigError, match="split-seed"):
        Settings.from_mapping({"split-seed": -2})


def test_the_docs_key_table_is_the_declarations():
    """docs/configuration.md's key table is exactly what the declarations render: every key
    once, in a row of its own, with its declared default, doc and valid range."""
    doc = DOC.read_text()
    assert with_key_table(doc) == doc, "stale: run python scripts/config_reference.py"
    rows = [line for line in key_table().splitlines() if line.startswith("| `")]
    assert [row.split("`")[1] for row in rows] == list(Settings().to_mapping())
    assert "| `prox-mu` | `0.01` |" in doc and "| `strategy` | `\"fedavg\"` |" in doc
    assert set(GROUPS) <= set(Settings().to_mapping())


def test_the_key_table_checker_sees_a_stale_or_missing_table():
    doc = DOC.read_text()
    stale = doc.replace("| `lr` | `0.01` |", "| `lr` | `0.1` |")
    assert stale != doc and with_key_table(stale) == doc
    with pytest.raises(ValueError, match="markers"):
        with_key_table(doc.replace(BEGIN, ""))
    assert doc.index(END) > doc.index(BEGIN)


def test_the_pyproject_checker_names_each_departure():
    config = tomllib.loads(PYPROJECT.read_text())["tool"]["flwr"]["app"]["config"]
    assert pyproject_mismatches(config) == []
    changed = {**config, "lr": 0.1, "round-timeout": 3600, "bogus-key": 1}
    del changed["alpha"]
    assert sorted(pyproject_mismatches(changed)) == sorted([
        "pyproject lacks the key 'alpha'", "pyproject has the undeclared key 'bogus-key'",
        "pyproject sets lr = 0.1, its declared default is 0.01",
        "pyproject sets round-timeout = 3600, its declared default is 3600.0"])


def test_the_reference_script_checks_docs_and_pyproject():
    run = subprocess.run([sys.executable, str(REPO / "scripts" / "config_reference.py"),
                          "--check"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr


def test_the_role_tables_are_read_off_the_declarations():
    """STRATEGY_KEYS, FUSION_KEYS, DATA_KEYS, NODE_OVERRIDES and PATH_KEYS hold exactly the
    keys whose declarations say so, and every strategy argument named exists on that
    strategy (FUSION_KEYS' on every strategy)."""
    declared = {f.name.replace("_", "-"): knob_of(f) for f in fields(Settings)}
    assert set(DATA_KEYS) == {k for k, d in declared.items() if d.data}
    assert set(NODE_OVERRIDES) == {k for k, d in declared.items() if d.node}
    assert set(PATH_KEYS) == {k for k, d in declared.items() if d.path}
    assert {"dataset", "model", "num-members", "holdout-fraction"} <= set(DATA_KEYS)
    assert {"model", "num-members", "data-path"} <= set(NODE_OVERRIDES)
    assert STRATEGY_KEYS["fedprox"] == {"prox_mu": "prox-mu"}
    for name, arguments in STRATEGY_KEYS.items():
        assert name in STRATEGIES
        for argument, key in arguments.items():
            assert (name, argument) in declared[key].strategy
    assert {"screen_factor", "round_timeout", "distill"} <= set(FUSION_KEYS)
    for name, cls in STRATEGIES.items():
        takes = {a for klass in cls.__mro__ if "__init__" in vars(klass)
                 for a in inspect.signature(klass.__init__).parameters}
        assert set(FUSION_KEYS) | set(STRATEGY_KEYS.get(name, {})) <= takes, name


#: run-config key -> how to build the library object that checks the argument it feeds
LIBRARY_RULES = {
    "screen-factor": lambda v: FedAvg(SmallCNN, screen_factor=v),
    "curvature-screen-factor": lambda v: FedAvg(SmallCNN, curvature_screen_factor=v),
    "num-examples-cap": lambda v: FedAvg(SmallCNN, num_examples_cap=v),
    "init-perturbation": lambda v: FedAvg(SmallCNN, init_perturbation=v),
    "round-timeout": lambda v: FedAvg(SmallCNN, round_timeout=v),
    "node-wait-timeout": lambda v: FedAvg(SmallCNN, node_wait_timeout=v),
    "prox-mu": lambda v: FedProx(SmallCNN, prox_mu=v),
    "contrastive-weight": lambda v: LocalObjective(contrastive_weight=v),
    "contrastive-temperature": lambda v: LocalObjective(contrastive_temperature=v),
    "distill-lr": lambda v: DistillOptions(lr=v).check(),
    "distill-temperature": lambda v: DistillOptions(temperature=v).check(),
    "pfnm-sigma": lambda v: STRATEGIES["pfnm"](MLP, sigma=v),
    "pfnm-gamma": lambda v: STRATEGIES["pfnm"](MLP, gamma=v),
    "pfnm-sigma0": lambda v: STRATEGIES["pfnm"](MLP, sigma0=v),
    "temperature": lambda v: STRATEGIES["fedbens"](SmallCNN, temperature=v),
    "prior-var": lambda v: STRATEGIES["fedbens"](SmallCNN, prior_var=v),
    "server-lr": lambda v: STRATEGIES["fedbens"](SmallCNN, lr=v),
    "server-clip": lambda v: STRATEGIES["fedbens"](SmallCNN, clip=v),
    "lr": lambda v: TrainConfig(lr=v),
    "momentum": lambda v: TrainConfig(momentum=v),
}
#: the same for the int keys
LIBRARY_INT_RULES = {
    "num-members": lambda v: FedAvg(SmallCNN, num_members=v),
    "seed": lambda v: FedAvg(SmallCNN, seed=v),
    "min-valid-uploads": lambda v: FedAvg(SmallCNN, min_valid_uploads=v),
    "distill-epochs": lambda v: DistillOptions(epochs=v).check(),
    "server-patience": lambda v: STRATEGIES["fedbens"](SmallCNN, patience=v),
    "fedbens-num-starts": lambda v: STRATEGIES["fedbens"](SmallCNN, num_starts=v),
    "fedbens-modes": lambda v: STRATEGIES["fedbens"](SmallCNN, modes=v),
    "ams-top-k": lambda v: STRATEGIES["ams"](SmallCNN, top_k=v),
    "pfnm-iters": lambda v: STRATEGIES["pfnm"](MLP, iters=v),
}
MLP = ModelSpec("mlp", (1, 28, 28), 10)


def outcome(call) -> str | None:
    try:
        call()
    except ValueError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize(("key", "value"), [
    *((key, value) for key in sorted(LIBRARY_RULES)
      for value in (-1.0, 0.0, 0.5, 1.0, 10.0, math.inf, math.nan)),
    *((key, value) for key in sorted(LIBRARY_INT_RULES) for value in (-1, 0, 1, 3))])
def test_the_run_config_refuses_what_the_library_refuses(key, value):
    """One rule per knob: the run config refuses a value of a key exactly where the library
    object the key feeds refuses it, and both messages state the same rule."""
    library_error = outcome(lambda: {**LIBRARY_RULES, **LIBRARY_INT_RULES}[key](value))
    config_error = outcome(lambda: Settings.from_mapping({key: value}))
    assert (library_error is None) == (config_error is None), (library_error, config_error)
    if config_error is not None:
        assert config_error.startswith(f"run-config {key!r} must be ")
        assert config_error.split(" must be ")[1] == library_error.split(" must be ")[1]


@pytest.mark.parametrize(("strategy", "key", "value", "argument"), [
    ("fedfisher", "fedfisher-steps", -1, "steps"),
    ("fedfisher", "fedfisher-lr", -0.01, "lr"),
    ("fedfisher", "fedfisher-lr", math.inf, "lr"),
    ("fedfisher", "fedfisher-eval-every", 0, "eval_every"),
    ("dense", "dense-g-lr", -1.0, "g_lr"),
    ("co-boosting", "dense-s-lr", math.nan, "s_lr"),
    ("dense", "dense-adv-weight", -1.0, "adv_weight"),
    ("co-boosting", "dense-act-weight", math.inf, "act_weight"),
])
def test_start_checked_keys_are_refused_when_the_strategy_is_built(strategy, key, value,
                                                                    argument):
    """Keys marked [start]: the strategy's constructor refuses a bad value by name when the
    ServerApp builds it, before any client trains (FedFisher's learning rate and evaluation
    interval once failed only when the server fused, after every client had trained)."""
    settings = Settings.from_mapping({"strategy": strategy, key: value})
    with pytest.raises(ConfigError, match=f"strategy {strategy!r}: {argument} must be"):
        build_strategy(settings, ModelSpec("lenet", (1, 28, 28), 10))


@pytest.mark.parametrize(("values", "message"), [
    ({"strategy": "fens", "fens-hidden": 10**12}, "hidden must be at most 65536"),
    ({"strategy": "dense", "dense-latent-dim": 10**12}, r"latent_dim, generator_width <= 65536"),
    ({"strategy": "co-boosting", "dense-batch-size": 65_537}, r"batch_size, latent_dim"),
])
def test_absurd_sizes_are_refused_when_the_strategy_is_built(values, message):
    """A typo of a width or batch size is refused by name at start, not met with a
    MemoryError (or a machine swapping) once the clients have trained."""
    with pytest.raises(ConfigError, match=message):
        build_strategy(Settings.from_mapping(values), ModelSpec("lenet", (1, 28, 28), 10))


@pytest.mark.parametrize("key", ["fedbens-num-starts", "fedbens-modes"])
def test_run_counts_are_bounded(key):
    assert Settings.from_mapping({key: 10_000}).to_mapping()[key] == 10_000
    with pytest.raises(ConfigError, match=f"'{key}' must be in 0..10000"):
        Settings.from_mapping({key: 10**9})


def test_build_strategy_passes_the_declared_arguments():
    """The keys declared as every strategy's arguments reach the constructor, by name."""
    settings = Settings(strategy="fedprox", screen_factor=5.0, round_timeout=7.0, num_members=2,
                        distill_epochs=3, prox_mu=0.25, norm_stats="average")
    strategy = build_strategy(settings, ModelSpec("lenet", (1, 28, 28), 10))
    assert (strategy.screen_factor, strategy.round_timeout, strategy.num_members) == (5.0, 7.0, 2)
    assert strategy.distill_options.epochs == 3 and strategy.norm_stats == "average"
    assert strategy.client_config["prox-mu"] == 0.25
    with pytest.raises(ConfigError, match="strategy 'fedprox': num_examples_cap must be 0"):
        build_strategy(replace(settings, num_examples_cap=0.5),
                       ModelSpec("lenet", (1, 28, 28), 10))


def test_library_rules_take_numpy_scalars_and_integer_rules_refuse_floats_and_bools():
    """numpy scalars are numbers to every rule (np.float32 learning rates were
    refused once the rules were applied to TrainConfig); an integer rule refuses 1.5 and True
    instead of failing later in torch's seeding."""
    assert TrainConfig(lr=np.float32(0.01), momentum=np.float64(0.9)).lr == np.float32(0.01)
    assert FedAvg(SmallCNN, seed=np.int64(3), num_members=np.int64(2)).context.seed == 3
    for seed in (1.5, True):
        with pytest.raises(ValueError, match="seed must be an integer"):
            FedAvg(SmallCNN, seed=seed)
    with pytest.raises(ValueError, match="num_members must be an integer in 1..64"):
        FedAvg(SmallCNN, num_members=2.0)
