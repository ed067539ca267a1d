"""The simulation launcher's own work: the App copy ``flwr run`` packs, the run config,
and stopping everything it started when interrupted."""

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from conftest import FLOWER_PROCESSES
from flwr.cli.build import build_fab_from_disk

from fedfusion.app import launch as launch_module
from fedfusion.app.launch import APP_DIR, launch
from fedfusion.app.processes import command_line, processes_with_env
from fedfusion.app.staging import stage_app

pytestmark = FLOWER_PROCESSES  # run apart from the other tests (conftest.py)


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
    commands, homes = [], []

    def run_flwr(command, env, *_args, **_kwargs):
        commands.append(command)
        homes.append(Path(env["FLWR_HOME"]))
        assert homes[-1].is_dir()

    monkeypatch.setattr(launch_module, "run_flwr", run_flwr)
    example = APP_DIR / "examples" / "digits"
    for run_config, app_dir in (("", APP_DIR), ("largest-client-first=false", APP_DIR),
                                ("", example)):
        with pytest.raises(RuntimeError, match="wrote no"):
            launch(f"{run_config} output-dir='{tmp_path}'", app_dir=app_dir)
    flags = [[item for item in command if item.startswith("largest-client-first")]
             for command in commands]
    assert flags == [["largest-client-first=true"], ["largest-client-first=false"], []]
    assert homes and not any(home.exists() for home in homes)  # removed after failed launches


def test_the_clients_resources_can_be_overridden_per_launch(tmp_path, monkeypatch) -> None:
    """``federation`` overrides the App's simulation keys for one launch (a GPU share for
    the clients); an unknown key is refused before anything starts."""
    commands = []
    monkeypatch.setattr(launch_module, "run_flwr", lambda command, *_a, **_k:
                        commands.append(command))
    with pytest.raises(RuntimeError, match="wrote no"):
        launch(f"num-clients=3 output-dir='{tmp_path}'",
               federation={"client-resources-num-gpus": 0.25})
    config = commands[0][commands[0].index("--federation-config") + 1].split()
    assert "client-resources-num-gpus=0.25" in config and "num-supernodes=3" in config
    assert "client-resources-num-cpus=1" in config  # the App's own value, kept
    with pytest.raises(ValueError, match="unknown simulation keys.*num-gpu"):
        launch(f"output-dir='{tmp_path}'", federation={"num-gpu": 1})
    assert len(commands) == 1


@pytest.mark.parametrize(("signum", "exit_code", "group"), [
    # Ctrl-C in a terminal: to the launcher and `flwr run`
    pytest.param(signal.SIGINT, 130, True, id="ctrl-c"),
    # `kill <launcher>`, a CI timeout: to the launcher alone
    pytest.param(signal.SIGTERM, 143, False, id="sigterm"),
])
def test_an_interrupted_launch_stops_its_run_and_leaves_no_process(
        signum: int, exit_code: int, group: bool, tmp_path) -> None:
    """Interrupted once the clients have their messages, the launcher stops the run on the
    SuperLink (``flwr stop``), then every process it started, and exits 128 + the signal.
    Its processes are told apart from any other run on the machine by a marker in their
    environment, which all of them inherit (the SuperLink, the simulation, Ray's processes
    and workers)."""
    marker = uuid.uuid4().hex
    env = dict(os.environ, FEDFUSION_TEST_LAUNCH=marker, OMP_NUM_THREADS="1",
               PYTHONPATH=str(APP_DIR))
    log = tmp_path / "launch.log"
    # about 3.5 min of training at the stacked trainer's 15,000 samples/s, so the signal comes
    # while the clients train even when the test sees the Ray worker late (100 epochs, about
    # 70 s, ended first once, with the library tests on the other core).
    config = (f"num-clients=2 local-epochs=300 train-subset=20000 alpha=1.0 val-size=100 "
              f"output-dir='{tmp_path}' run-name=interrupted")
    # pid -> every command line seen (Ray workers retitle themselves "ray::ClientAppActor..."
    # once their actor starts: the worker is spotted by either title)
    seen: dict[int, set[str]] = {}

    def look() -> None:
        for pid in processes_with_env("FEDFUSION_TEST_LAUNCH", marker):
            seen.setdefault(pid, set()).add(command_line(pid))

    with log.open("wb") as out:
        launcher = subprocess.Popen(
            [sys.executable, "-m", "fedfusion.app.launch", "--run-config", config],
            cwd=APP_DIR, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not ("sending to 2 client(s)" in log.read_text(errors="replace") and any(
                "default_worker" in c or "ClientAppActor" in c
                for titles in seen.values() for c in titles)):
            assert launcher.poll() is None, log.read_text(errors="replace")[-3000:]
            assert time.monotonic() < deadline, "the run did not start within 300 s"
            look()
            time.sleep(0.5)
        time.sleep(2.0)
        look()
        (os.killpg if group else os.kill)(launcher.pid, signum)
        code = launcher.wait(timeout=120)
        left = {pid: command_line(pid) for pid in processes_with_env("FEDFUSION_TEST_LAUNCH",
                                                                       marker)}
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
        # a failed launcher leaves its SuperLink and Ray workers training: they must not
        # outlive the test (once they took both cores from the rest of a CI run)
        for pid in processes_with_env("FEDFUSION_TEST_LAUNCH", marker):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    text = log.read_text(errors="replace")
    assert code == exit_code, text[-3000:]
    assert "stopped on the SuperLink" in text
    titles = [c for cmdlines in seen.values() for c in cmdlines]
    for started in ("flower-superlink", "flwr-simulation", "raylet"):
        assert any(started in c for c in titles), (started, seen)
    assert any("default_worker" in c or "ClientAppActor" in c for c in titles), seen
    assert not left, f"processes left running after the interrupt: {left}"
