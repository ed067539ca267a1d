"""Run a fedfusion simulation through ``flwr run`` and judge it by its results file.

``python -m fedfusion.app.launch [--run-config "k=v ..."] [--num-supernodes N]``

Flower keeps connection and simulation options outside pyproject.toml and starts a
detached local SuperLink that outlives the run; ``flwr run`` also exits 0 when the run
fails. This launcher makes a run self-contained:

* a private ``FLWR_HOME`` and free ports, so it never reuses a stale SuperLink;
* ``flwr run`` reads a copy of the App's files
  (:func:`fedfusion.app.staging.stage_app`), not the checkout with its ``.venv``;
* ``largest-client-first=true`` where the App has that key and the run config does not set
  it (:func:`fedfusion.app.federation.client_for_partition`);
* ``FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1`` (the environment is already set up) and
  ``OPENBLAS_NUM_THREADS=1`` (see :func:`launch`);
* ``--federation-config`` from ``[tool.fedfusion.simulation]`` in pyproject.toml, with one
  SuperNode per client (``num-clients``);
* the SuperLink and everything it started are stopped afterwards, and also when the launcher
  is interrupted (Ctrl-C, SIGTERM) or times out: the run is stopped on the SuperLink
  (``flwr stop``), then every process the launch started is terminated
  (:class:`fedfusion.app.processes.ProcessTracker`, :func:`stop_launch`), so none is left
  behind;
* success is read from ``<output-dir>/<run-name>/results.json``; exit 1 if it is not "ok"
  (a file still saying "running", its ServerApp killed, is rewritten as failed first).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from collections.abc import Iterator, Mapping
from pathlib import Path

from fedfusion.app.paths import output_name_error
from fedfusion.app.processes import (
    ProcessTracker,
    processes_with_env,
    stop_process_trees,
    stop_superlink,
)
from fedfusion.app.staging import stage_app

APP_DIR = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


#: the simulation federation of an App whose pyproject.toml has no [tool.fedfusion.simulation]
DEFAULT_SIMULATION = {"num-supernodes": 5, "client-resources-num-cpus": 1,
                      "client-resources-num-gpus": 0.0}


#: run-config keys holding a path of this machine
PATH_KEYS = ("output-dir", "partition-file", "data-dir", "replay")


def absolute_paths(run_config: str, output_dir: Path | str) -> dict[str, str]:
    """The run config's non-empty :data:`PATH_KEYS` (``output-dir`` defaulting to
    ``output_dir``), made absolute against this process's folder: Flower's processes run in
    folders of their own."""
    given = {key: (run_config_value(run_config, key) or "").strip("'\"") for key in PATH_KEYS}
    given["output-dir"] = given["output-dir"] or str(output_dir)
    return {key: str(Path(value).expanduser().resolve()) for key, value in given.items()
            if value}


def simulation_defaults(app_dir: Path) -> tuple[dict[str, object], dict[str, object]]:
    """The App's simulation federation (:data:`DEFAULT_SIMULATION` where its pyproject.toml
    has no ``[tool.fedfusion.simulation]``) and its run config's defaults."""
    tool = tomllib.loads((app_dir / "pyproject.toml").read_text()).get("tool", {})
    return ({**DEFAULT_SIMULATION, **tool.get("fedfusion", {}).get("simulation", {})},
            tool.get("flwr", {}).get("app", {}).get("config", {}))


def run_config_value(run_config: str, key: str) -> str | None:
    for item in shlex.split(run_config):
        name, _, value = item.partition("=")
        if name == key:
            return value
    return None


def launch(run_config: str = "", num_supernodes: int | None = None, app_dir: Path = APP_DIR,
           timeout: float = 3 * 3600, *, tracker: ProcessTracker | None = None,
           federation: Mapping[str, float] | None = None) -> dict:
    """Run ``flwr run`` on a private local SuperLink; return the parsed results.json.

    ``federation`` overrides keys of the App's ``[tool.fedfusion.simulation]``, e.g.
    ``{"client-resources-num-gpus": 0.25}`` for four clients per GPU.

    Every process the launch starts (``flwr run``, the SuperLink, the simulation and its Ray
    cluster) is stopped before it returns or raises, also on Ctrl-C, SIGTERM and
    ``timeout``; then, and only then, the run is also stopped on the SuperLink
    (:func:`stop_launch`). ``tracker`` receives those processes (:class:`ProcessTracker`),
    e.g. for a test that none is left."""
    defaults, app_config = simulation_defaults(app_dir)
    unknown = set(federation or {}) - set(DEFAULT_SIMULATION)
    if unknown:
        raise ValueError(f"launch: unknown simulation keys {sorted(unknown)}; known: "
                         f"{sorted(DEFAULT_SIMULATION)}")
    simulation = {**defaults, **(federation or {})}
    clients = run_config_value(run_config, "num-clients")
    simulation["num-supernodes"] = num_supernodes or int(clients or simulation["num-supernodes"])
    if clients is None:
        run_config += f" num-clients={simulation['num-supernodes']}"
    if "largest-client-first" in app_config and run_config_value(
            run_config, "largest-client-first") is None:
        # a simulation: start the longest clients first (federation.client_for_partition)
        run_config += " largest-client-first=true"
    run_name = (run_config_value(run_config, "run-name") or "").strip("'\"") or (
        time.strftime("%Y%m%d-%H%M%S") + f"-{os.getpid()}")
    refused = output_name_error("run-name", run_name)
    if refused:  # before Flower starts (the server would refuse it only once it started)
        from fedfusion.app.config import ConfigError  # torch: only on this path

        raise ConfigError(refused)
    paths = absolute_paths(run_config, app_dir / "outputs")
    items = [toml_item(item) for item in shlex.split(run_config)
             if item.partition("=")[0] not in ("run-name", *paths)]
    items += [f"run-name='{run_name}'"] + [f"{key}='{value}'" for key, value in paths.items()]
    http_port, control_port = free_port(), free_port()
    flwr_home = Path(tempfile.mkdtemp(prefix="fedfusion-flwr-"))
    env = dict(os.environ, FLWR_HOME=str(flwr_home),
               FLWR_LOCAL_SUPERLINK_HTTP_API_PORT=str(http_port),
               FLWR_LOCAL_CONTROL_API_PORT=str(control_port),
               FLWR_DISABLE_UPDATE_CHECK="1")
    # the environment is installed up front (offline here); a caller who wants Flower >= 1.42
    # to install the App's dependencies at run time sets this to 0
    env.setdefault("FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION", "1")
    # numpy's OpenBLAS thread pool spun forever (100% of a core, >8 min) inside a 256 x 256
    # Cholesky in the ServerApp thread of flwr-simulation (Ray loaded), twice; the same replay
    # alone took 17 s. The server's numpy matrices are small: one BLAS thread is enough.
    env.setdefault("OPENBLAS_NUM_THREADS", "1")
    bin_dir = Path(sys.executable).parent
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    federation_config = " ".join(f"{k}={v}" for k, v in simulation.items())
    staged = stage_app(app_dir, flwr_home / "app")
    command = [str(bin_dir / "flwr"), "run", str(staged), "--stream",
               "--federation-config", federation_config]
    for item in items:  # one flag per key: values with spaces need no extra quoting
        command += ["--run-config", item]
    print("$", " ".join(shlex.quote(c) for c in command), flush=True)
    tracker = ProcessTracker() if tracker is None else tracker
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous_sigterm = signal.getsignal(signal.SIGTERM)
    if in_main_thread:
        # a SIGTERM (kill, CI timeout) must still run the `finally` that stops the run
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
    finished = False
    exit_code: int | None = None
    try:
        exit_code = run_flwr(command, env, timeout, tracker)
        finished = True
    finally:
        try:
            stop_launch(tracker, env, flwr_home, http_port, stop_run=not finished)
        finally:
            if in_main_thread:
                signal.signal(signal.SIGTERM, previous_sigterm)
            # the private Flower home (the staged App, the SuperLink's files: ~5 MB), also
            # after a failed or interrupted launch
            shutil.rmtree(flwr_home, ignore_errors=True)
    results_file = Path(paths["output-dir"]) / run_name / "results.json"
    if not results_file.is_file():
        raise RuntimeError(f"the run wrote no {results_file}: see the log above")
    results = close_unfinished(results_file, exit_code)
    if results.get("status") != "ok":
        raise RuntimeError(f"the run failed: {results.get('error')}")
    return results


def close_unfinished(results_file: Path, exit_code: int | None) -> dict:
    """The run's results; a results.json still saying "running" (its ServerApp died without
    finishing: killed for memory, or with a lost Ray node) is rewritten as failed, naming
    ``flwr run``'s exit code and the uploads saved beside it (a replay reuses them)."""
    try:
        results = json.loads(results_file.read_text())
    except (OSError, ValueError) as exc:
        raise RuntimeError(f"{results_file} is not readable JSON ({exc})") from exc
    if not isinstance(results, dict):
        raise RuntimeError(f"{results_file} holds no results object")
    if results.get("status") != "running":
        return results
    saved = sorted(p.name for p in (results_file.parent / "uploads").glob("*.npz"))
    results.update(status="failed", error=(
        f"the ServerApp ended without finishing (flwr run exit code {exit_code}; killed, e.g. "
        f"for memory or with a lost Ray node?); {len(saved)} upload(s) saved in "
        f"{results_file.parent / 'uploads'}" + (": replay them with replay=<that folder>"
                                               if saved else "")), uploads_saved=saved)
    # O_NOFOLLOW: never write through a symlink put in the file's place
    fd = os.open(results_file, os.O_WRONLY | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0))
    with os.fdopen(fd, "w") as handle:
        handle.write(json.dumps(results, indent=1) + "\n")
    return results


def _exit_on_sigterm(signum: int, frame: object) -> None:
    sys.exit(128 + signum)


#: what ``flwr run`` prints once the SuperLink accepted the run
_RUN_STARTED = re.compile(r"Successfully started run (\d+)")


def run_flwr(command: list[str], env: dict[str, str], timeout: float,
             tracker: ProcessTracker) -> int:
    """Run ``command`` (``flwr run ... --stream``) to its end and return its exit code,
    relaying its output line by line; ``tracker`` watches its process tree and learns the
    run id (:attr:`ProcessTracker.run_id`) from the output. An interrupt (KeyboardInterrupt,
    SystemExit) or ``subprocess.TimeoutExpired`` propagates with the processes running:
    :func:`stop_launch` stops them."""
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT)
    tracker.watch([process.pid])

    def relay() -> None:
        assert process.stdout is not None
        for raw in process.stdout:
            line = raw.decode(errors="replace")
            if tracker.run_id is None and (match := _RUN_STARTED.search(line)):
                tracker.run_id = int(match.group(1))
            sys.stdout.write(line)
            sys.stdout.flush()

    relay_thread = threading.Thread(target=relay, name="fedfusion-flwr-output", daemon=True)
    relay_thread.start()
    code = process.wait(timeout=timeout)
    relay_thread.join(timeout=10)
    return code


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """Ignore SIGINT and SIGTERM inside (main thread only): a second Ctrl-C must not cut
    the cleanup short and leave processes behind. The cleanup is bounded (timeouts)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def stop_launch(tracker: ProcessTracker, env: dict[str, str], flwr_home: Path, http_port: int,
                stop_run: bool = True, grace_s: float = 3.0, rounds: int = 5) -> None:
    """Leave nothing of a launch running.

    With ``stop_run`` (the launch was interrupted or timed out) the run is first stopped on
    its SuperLink (``flwr stop <run-id>``), so the SuperLink records it as stopped rather
    than losing it mid-round. Then every process the launch started is terminated (SIGTERM,
    SIGKILL after ``grace_s``): those ``tracker`` recorded and any still holding the launch's
    private ``FLWR_HOME`` in its environment (a process re-parented before the tracker saw
    it), repeated up to ``rounds`` times while a dying process spawns another. Each step
    is printed (stderr), so a log shows where a slow stop spends its time."""
    started = time.monotonic()

    def step(what: str) -> None:
        print(f"fedfusion.app.launch: {what} (+{time.monotonic() - started:.1f} s)",
              file=sys.stderr, flush=True)

    if stop_run:
        step("stopping the run and every process it started")
    tracker.stop_watching()
    with _signals_held():
        tracker.add_trees([])
        if stop_run and tracker.run_id is not None and any(
                "flower-superlink" in tracker.processes[pid][1] for pid in tracker.alive()):
            step(f"flwr stop {tracker.run_id}")
            _flwr_stop(tracker.run_id, env)
        for _ in range(rounds):
            found = {*tracker.alive(), *processes_with_env("FLWR_HOME", str(flwr_home))}
            pids = sorted(found - {os.getpid()})
            if not pids:
                break
            if stop_run:
                step(f"stopping {len(pids)} process(es)")
            tracker.add_trees(pids)
            stop_process_trees(pids, grace_s)
        stop_superlink(http_port)  # one started too late for the tracker to see
        if stop_run:
            step("stopped")


def _flwr_stop(run_id: int, env: dict[str, str], timeout: float = 30.0) -> None:
    """``flwr stop <run_id>`` on the launch's own SuperLink (its ``FLWR_HOME`` and ports)."""
    flwr = Path(sys.executable).parent / "flwr"
    try:
        done = subprocess.run([str(flwr), "stop", str(run_id)], env=env, timeout=timeout,
                              capture_output=True, text=True, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        print(f"fedfusion.app.launch: flwr stop {run_id} failed ({exc}); stopping the "
              "processes", file=sys.stderr, flush=True)
        return
    outcome = "stopped" if done.returncode == 0 else (
        f"not stopped (exit {done.returncode}: {(done.stdout + done.stderr).strip()[-300:]})")
    print(f"fedfusion.app.launch: run {run_id} {outcome} on the SuperLink", file=sys.stderr,
          flush=True)


def toml_item(item: str) -> str:
    """Quote a bare string value for Flower's TOML-typed --run-config parser."""
    key, _, value = item.partition("=")
    if value[:1] in ("'", '"') or value in ("true", "false"):
        return item
    try:
        float(value)
        return item
    except ValueError:
        return f"{key}='{value}'"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run-config", default="", help='e.g. "strategy=ensemble alpha=0.4"')
    parser.add_argument("--num-supernodes", type=int, default=None)
    args = parser.parse_args(argv)
    # Ctrl-C stops the run even when this process inherited SIGINT ignored: a shell script's
    # background job (`cmd &` without job control) starts with it ignored, and Python then
    # leaves it so (the interrupt test hung 120 s that way when its pytest ran in the background)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        launch(args.run_config, args.num_supernodes)
    except RuntimeError as exc:
        print(f"fedfusion.app.launch: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("fedfusion.app.launch: interrupted; the run and its processes are stopped",
              file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
