"""The simulation launcher's own work: the App copy ``flwr run`` packs, the run config."""

import pytest
from flwr.cli.build import build_fab_from_disk

from fedfusion.app import launch as launch_module
from fedfusion.app.launch import APP_DIR, launch, stage_app


@pytest.mark.parametrize("app_dir", [APP_DIR, APP_DIR / "examples" / "digits"])
def test_the_staged_copy_packs_into_the_same_fab(app_dir, tmp_path) -> None:
    """Flower builds the same FAB, byte for byte, from the staged copy as from the App
    folder itself (with its .venv, outputs and caches), and the copy leaves those out."""
    staged = stage_app(app_dir, tmp_path / "app")
    assert build_fab_from_disk(staged) == build_fab_from_disk(app_dir)
    assert (staged / "pyproject.toml").is_file()
    names = {p.name for p in staged.rglob("*")}
    assert not names & {".venv", ".git", "__pycache__", "outputs"}


def test_staging_takes_fab_files_that_gitignore_keeps_and_no_symlinks(tmp_path) -> None:
    app = tmp_path / "app"
    (app / "pkg" / "cache").mkdir(parents=True)
    (app / ".gitignore").write_text("cache/\n*.log\n")
    (app / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    (app / "pkg" / "a.py").write_text("A = 1\n")
    (app / "pkg" / "run.log").write_text("noise")
    (app / "pkg" / "data.bin").write_bytes(bytes(1000))  # not a kind of file a FAB holds
    (app / "pkg" / "cache" / "b.py").write_text("B = 2\n")
    (app / "pkg" / "link.py").symlink_to(app / "pkg" / "a.py")
    for excluded in (".venv/lib", "pkg/__pycache__"):  # Flower's own exclusions
        (app / excluded).mkdir(parents=True)
        (app / excluded / "c.py").write_text("C = 3\n")
    staged = stage_app(app, tmp_path / "staged")
    assert sorted(p.relative_to(staged).as_posix() for p in staged.rglob("*")
                  if p.is_file()) == [".gitignore", "pkg/a.py", "pyproject.toml"]


def test_the_launcher_sets_the_flag_only_for_apps_that_have_it(tmp_path, monkeypatch) -> None:
    """``launch`` runs simulations: it turns largest-client-first on unless the run config
    says otherwise, and leaves it out for an App whose run config lacks the key."""
    commands = []
    monkeypatch.setattr(launch_module.subprocess, "run",
                        lambda command, **_: commands.append(command))
    example = APP_DIR / "examples" / "digits"
    for run_config, app_dir in (("", APP_DIR), ("largest-client-first=false", APP_DIR),
                                ("", example)):
        with pytest.raises(RuntimeError, match="wrote no"):
            launch(f"{run_config} output-dir='{tmp_path}'", app_dir=app_dir)
    flags = [[item for item in command if item.startswith("largest-client-first")]
             for command in commands]
    assert flags == [["largest-client-first=true"], ["largest-client-first=false"], []]
