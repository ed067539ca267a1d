"""Run a fedfusion simulation through ``flwr run`` and judge it by its results file.

``python -m fedfusion.app.launch [--run-config "k=v ..."] [--num-supernodes N]``

Flower keeps connection and simulation options outside pyproject.toml and starts a
detached local SuperLink that outlives the run; ``flwr run`` also exits 0 when the run
fails. This launcher makes a run self-contained:

* a private ``FLWR_HOME`` and free ports, so it never reuses a stale SuperLink;
* ``flwr run`` reads a copy of the App's files (:func:`stage_app`), not the checkout with
  its ``.venv``;
* ``largest-client-first=true`` where the App has that key and the run config does not set
  it (:func:`fedfusion.app.federation.client_for_partition`);
* ``FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1`` (the environment is already set up) and
  ``OPENBLAS_NUM_THREADS=1`` (see :func:`launch`);
* ``--federation-config`` from ``[tool.fedfusion.simulation]`` in pyproject.toml, with one
  SuperNode per client (``num-clients``);
* the SuperLink and everything it started are stopped afterwards;
* success is read from ``<output-dir>/<run-name>/results.json``; exit 1 if it is not "ok".
"""

from __future__ import annotations

import argparse
import json
import os
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
from pathlib import Path

APP_DIR = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _children(pid: int) -> list[int]:
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            kids.append(int(stat.parent.name))
    return kids


def _process_tree(pid: int) -> list[int]:
    tree, todo = [], [pid]
    while todo:
        current = todo.pop()
        tree.append(current)
        todo += _children(current)
    return tree


def stop_superlink(port: int) -> int:
    """Stop the SuperLink listening on ``port`` and its whole process tree."""
    roots = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        if any(b"flower-superlink" in a for a in args[:2]) and str(port).encode() in args:
            roots.append(int(cmdline.parent.name))
    stop_process_trees(roots)
    return len(roots)


def stop_process_trees(roots: list[int], grace_s: float = 2.0) -> None:
    """SIGTERM every process in the trees under ``roots``, SIGKILL those still running after
    ``grace_s``. The trees are read first: a stopped parent's children are re-parented."""
    victims = [p for root in roots for p in _process_tree(root)]
    deadline = time.monotonic() + grace_s
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in victims:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        while sig == signal.SIGTERM and time.monotonic() < deadline:
            victims = [pid for pid in victims if is_running(pid)]
            if not victims:
                return
            time.sleep(0.1)


def is_running(pid: int) -> bool:
    """Whether ``pid`` exists and has not exited (a zombie, not yet reaped, has)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


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


def stage_app(app_dir: Path, into: Path) -> Path:
    """Copy into ``into`` the App's files that ``flwr run`` may pack into its FAB: those of
    the kinds a FAB holds (``.py``, ``.toml``, ``.md``, ...) that neither ``.gitignore`` nor
    Flower's own exclusions (``.venv/``, ``__pycache__/``, ...) leave out, outside ``.git``;
    folders so left out are not entered. Flower builds the FAB by walking and resolving
    EVERY file under the App folder before it applies those rules: with the ``.venv`` inside
    the checkout that is ~53,000 files and ~4 s per launch, against ~0.1 s for the ~100 files
    staged here. Flower then filters the copy by the same rules, so the FAB (and its hash) is
    the one it would have built from ``app_dir``."""
    import pathspec
    from flwr.supercore.constant import (
        APP_PUBLISH_EXCLUDE_PATTERNS,
        APP_PUBLISH_INCLUDE_PATTERNS,
    )

    gitignore = app_dir / ".gitignore"
    ignored = pathspec.GitIgnoreSpec.from_lines(
        [*APP_PUBLISH_EXCLUDE_PATTERNS,
         *(gitignore.read_text().splitlines() if gitignore.is_file() else [])])
    packed = pathspec.GitIgnoreSpec.from_lines(APP_PUBLISH_INCLUDE_PATTERNS)
    for folder, subfolders, files in os.walk(app_dir):
        relative = Path(folder).relative_to(app_dir)
        subfolders[:] = [d for d in subfolders if d != ".git" and not ignored.match_file(
            f"{(relative / d).as_posix()}/")]
        for name in files:
            source, path = Path(folder) / name, (relative / name).as_posix()
            if source.is_symlink() or ignored.match_file(path) or not packed.match_file(path):
                continue  # Flower skips symlinks too
            (into / relative).mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, into / relative / name)
    return into


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
           timeout: float = 3 * 3600) -> dict:
    """Run ``flwr run`` on a private local SuperLink; return the parsed results.json."""
    federation, app_config = simulation_defaults(app_dir)
    clients = run_config_value(run_config, "num-clients")
    federation["num-supernodes"] = num_supernodes or int(clients or federation["num-supernodes"])
    if clients is None:
        run_config += f" num-clients={federation['num-supernodes']}"
    if "largest-client-first" in app_config and run_config_value(
            run_config, "largest-client-first") is None:
        # a simulation: start the longest clients first (federation.client_for_partition)
        run_config += " largest-client-first=true"
    run_name = (run_config_value(run_config, "run-name") or "").strip("'\"") or (
        time.strftime("%Y%m%d-%H%M%S") + f"-{os.getpid()}")
    paths = absolute_paths(run_config, app_dir / "outputs")
    items = [_toml_item(item) for item in shlex.split(run_config)
             if item.partition("=")[0] not in ("run-name", *paths)]
    items += [f"run-name='{run_name}'"] + [f"{key}='{value}'" for key, value in paths.items()]
    http_port, control_port = free_port(), free_port()
    flwr_home = Path(tempfile.mkdtemp(prefix="fedfusion-flwr-"))
    env = dict(os.environ, FLWR_HOME=str(flwr_home),
               FLWR_LOCAL_SUPERLINK_HTTP_API_PORT=str(http_port),
               FLWR_LOCAL_CONTROL_API_PORT=str(control_port),
               FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION="1",
               FLWR_DISABLE_UPDATE_CHECK="1")
    # numpy's OpenBLAS thread pool spun forever (100% of a core, >8 min) inside a 256 x 256
    # Cholesky in the ServerApp thread of flwr-simulation (Ray loaded), twice; the same replay
    # alone took 17 s. The server's numpy matrices are small: one BLAS thread is enough.
    env.setdefault("OPENBLAS_NUM_THREADS", "1")
    bin_dir = Path(sys.executable).parent
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    federation_config = " ".join(f"{k}={v}" for k, v in federation.items())
    staged = stage_app(app_dir, flwr_home / "app")
    command = [str(bin_dir / "flwr"), "run", str(staged), "--stream",
               "--federation-config", federation_config]
    for item in items:  # one flag per key: values with spaces need no extra quoting
        command += ["--run-config", item]
    print("$", " ".join(shlex.quote(c) for c in command), flush=True)
    if threading.current_thread() is threading.main_thread():
        # a SIGTERM (kill, CI timeout) must still run the `finally` that stops the SuperLink
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        subprocess.run(command, env=env, timeout=timeout, check=False)
    finally:
        stop_superlink(http_port)
        shutil.rmtree(staged, ignore_errors=True)
    results_file = Path(paths["output-dir"]) / run_name / "results.json"
    if not results_file.is_file():
        raise RuntimeError(f"the run wrote no {results_file}: see the log above")
    results = json.loads(results_file.read_text())
    if results.get("status") != "ok":
        raise RuntimeError(f"the run failed: {results.get('error')}")
    return results


def _toml_item(item: str) -> str:
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
    try:
        launch(args.run_config, args.num_supernodes)
    except RuntimeError as exc:
        print(f"fedfusion.app.launch: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
