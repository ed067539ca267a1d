from pathlib import Path

import pytest
import tomllib

from fedfusion.config import ConfigError, Settings

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


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
