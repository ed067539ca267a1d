"""Run names that cannot leave output-dir.

Before this, ``run-name`` ``../escaped``, ``a/../../x``, an absolute path, ``..`` or
``link/r2`` (``link`` a symlink inside output-dir to a folder outside) had a run write its
results, predictor and uploads outside ``output-dir``, and a NUL byte raised ``ValueError:
embedded null byte`` mid-run. Now each is a ConfigError naming the key when the settings are
parsed, again in ``output_folder`` (for Settings built without ``validate()``) before anything
is created, and in the launcher before Flower starts.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from fedfusion.app.config import ConfigError, Settings
from fedfusion.app.launch import launch
from fedfusion.app.output import output_folder

HOSTILE_NAMES = {  # the run-name, the refusal
    "parent escape": ("../escaped", "holds '..'"),
    "nested parent escape": ("a/../../x", "holds '..'"),
    "absolute path": ("/tmp/fedfusion-escaped", "is an absolute path"),
    "dot dot": ("..", "holds '..'"),
    "through a symlink": ("link/r2", "holds a path separator"),
    "NUL byte": ("run\0x", "holds a NUL byte"),
    "backslash": ("a\\..\\..\\x", "holds '..'"),
    "backslash separator": ("a\\b", "holds a path separator"),
    "windows drive": ("C:x", "names a drive"),
    "dot": (".", "is '.'"),
    "a subfolder": ("runs/r1", "holds a path separator"),
}
#: names the launcher, the benchmarks and the tests use: dots, dashes, underscores stay valid
GOOD_NAMES = ["table1-C5_a0.1-s0-fedavg", "fedbens-k5", "replay-C10_a0.05", "r.1", "a_b",
              "20250101-120000-4242", "co_boosting-s0-co-boosting-epochs5", ".hidden", "x" * 200,
              "run name", ""]


def _outside(tmp_path: Path) -> Path:
    target = tmp_path / "elsewhere"
    target.mkdir()
    return target


@pytest.mark.parametrize("case", HOSTILE_NAMES)
def test_hostile_run_names_are_refused_at_configuration(case):
    name, problem = HOSTILE_NAMES[case]
    with pytest.raises(ConfigError) as info:
        Settings.from_mapping({"run-name": name, "output-dir": "/tmp/out"})
    text = str(info.value)
    assert "run-config 'run-name'" in text and problem in text, text


@pytest.mark.parametrize("case", HOSTILE_NAMES)
def test_hostile_run_names_are_refused_at_run_time_before_anything_is_created(tmp_path, case):
    """Settings built directly (no validate()): output_folder refuses the name, and nothing
    appears outside output-dir (or inside it)."""
    name, problem = HOSTILE_NAMES[case]
    outside = _outside(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    (out / "link").symlink_to(outside)
    with pytest.raises(ConfigError, match=f"'run-name'.*{problem}"):
        output_folder(Settings(output_dir=str(out), run_name=name))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["elsewhere", "out"]
    assert not any(outside.iterdir()) and [p.name for p in out.iterdir()] == ["link"]
    assert not Path("/tmp/fedfusion-escaped").exists()


def test_a_run_name_that_is_a_symlink_out_of_output_dir_is_refused(tmp_path):
    """``link`` inside output-dir pointing outside: refused (OSError naming run-name), nothing
    written there; a real folder of that name is used."""
    outside = _outside(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    (out / "link").symlink_to(outside)
    with pytest.raises(OSError, match="run-config 'run-name' 'link' in output-dir .*exists as "
                                      "a symlink, not a folder"):
        output_folder(Settings(output_dir=str(out), run_name="link"))
    assert not any(outside.iterdir())
    assert output_folder(Settings(output_dir=str(out), run_name="real")) == (
        out / "real").resolve()


def test_an_output_dir_through_a_symlink_keeps_the_run_inside_it(tmp_path):
    """output-dir itself may be a symlink (the operator's choice): the run folder is inside
    its resolved target."""
    real = tmp_path / "real-out"
    real.mkdir()
    (tmp_path / "out").symlink_to(real)
    folder = output_folder(Settings(output_dir=str(tmp_path / "out"), run_name="r1"))
    assert folder == real.resolve() / "r1" and folder.is_dir()


def test_generated_run_names_started_in_the_same_second_get_their_own_folders(tmp_path,
                                                                             monkeypatch):
    """Without run-name the folder is named by the second the run started: two runs in that
    second (a parallel sweep) get <name> and <name>-2, never one folder (their results and
    uploads mixed), while an explicit run-name is reused as given."""
    monkeypatch.setattr("fedfusion.app.output.time.strftime", lambda _format: "20261129-010230")
    settings = Settings(output_dir=str(tmp_path), strategy="fedavg")
    first, second = output_folder(settings), output_folder(settings.replace(lr=0.05))
    assert first != second and first.parent == second.parent == tmp_path
    assert second.name == f"{first.name}-2"
    named = settings.replace(run_name="mine")
    assert output_folder(named) == output_folder(named) == tmp_path / "mine"


@pytest.mark.parametrize("name", GOOD_NAMES)
def test_ordinary_run_names_stay_valid(tmp_path, name):
    settings = Settings.from_mapping({"run-name": name, "output-dir": str(tmp_path)})
    folder = output_folder(settings)
    assert folder.parent == tmp_path.resolve() and folder.is_dir()
    if name:
        assert folder.name == name


@pytest.mark.parametrize("key", ["output-dir", "partition-file", "data-dir", "data-path",
                                 "replay", "client-registry"])
def test_a_nul_byte_in_any_path_is_refused_by_name(key):
    with pytest.raises(ConfigError, match=f"run-config '{key}' holds a NUL byte"):
        Settings.from_mapping({key: "a\0b"})


def test_a_nul_byte_in_output_dir_is_refused_at_run_time(tmp_path):
    with pytest.raises(ConfigError, match="'output-dir' holds a NUL byte"):
        output_folder(Settings(output_dir=f"{tmp_path}/a\0b", run_name="r"))


@pytest.mark.parametrize("case", ["parent escape", "absolute path", "through a symlink"])
def test_the_launcher_refuses_before_flower_starts(tmp_path, case):
    name, problem = HOSTILE_NAMES[case]
    with pytest.raises(ConfigError, match=f"'run-name'.*{problem}"):
        launch(f"output-dir='{tmp_path}' run-name='{name}'", timeout=5)
    assert not any(tmp_path.iterdir())
