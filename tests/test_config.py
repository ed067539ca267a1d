import tomllib
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from conftest import initial_models

from fedfusion.app.client_round import member_seed
from fedfusion.app.config import ConfigError, Settings
from fedfusion.app.federation import federated_split
from fedfusion.predictors import ModelSpec

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


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
    ({"labels-per-client": "6,3"}, "labels-per-client"),
    ({"server-device": "tpu"}, "server-device"),
    ({"server-threads": -1}, "'server-threads' must be >= 0"),
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
