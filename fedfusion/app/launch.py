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
* the SuperLink and everything it started are stopped afterwards, and also when the launcher
  is interrupted (Ctrl-C, SIGTERM) or times out: the run is stopped on the SuperLink
  (``flwr stop``), then every process the launch started is terminated
  (:class:`ProcessTracker`, :func:`stop_launch`), so none is left behind;
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
from collections.abc import Iterator
from pathlib import Path

from fedfusion.app.paths import output_name_error

APP_DIR = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _stat(pid: int | str) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (state, ppid, ...), or None
    when the process is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _parents() -> dict[int, int]:
    """Every process's parent, read in one pass over ``/proc``."""
    parents = {}
    for entry in Path("/proc").glob("[0-9]*"):
        fields = _stat(entry.name)
        if fields is not None:
            parents[int(entry.name)] = int(fields[1])
    return parents


def _children(pid: int) -> list[int]:
    return [child for child, parent in _parents().items() if parent == pid]


def _process_tree(pid: int, parents: dict[int, int] | None = None) -> list[int]:
    """``pid`` and its descendants (``parents`` from :func:`_parents`, read once)."""
    parents = _parents() if parents is None else parents
    kids: dict[int, list[int]] = {}
    for child, parent in parents.items():
        kids.setdefault(parent, []).append(child)
    tree, todo = [], [pid]
    while todo:
        current = todo.pop()
        tree.append(current)
        todo += kids.get(current, [])
    return tree


def start_time(pid: int) -> int | None:
    """When ``pid`` started (clock ticks since boot): with the pid, the identity of a process
    (a pid alone may be reused once its process exits)."""
    fields = _stat(pid)
    return int(fields[19]) if fields is not None else None


def command_line(pid: int) -> str:
    """``pid``'s command line, its arguments joined by spaces ("" when it is gone)."""
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return ""
    return " ".join(a.decode(errors="replace") for a in args if a)[:300]


def processes_with_env(key: str, value: str) -> list[int]:
    """The processes (of this user) whose environment holds ``key=value``. Every process a
    launch starts inherits the launch's private ``FLWR_HOME``, including those whose parent
    exited before they could be found in a process tree."""
    wanted = f"{key}={value}".encode()
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if wanted in environ.split(b"\0") and is_running(int(entry.name)):
            found.append(int(entry.name))
    return sorted(found)


class ProcessTracker:
    """The processes a launch started, recorded while they run.

    :meth:`watch` adds, every ``interval`` seconds, the process trees under the given roots
    and under every process seen before (a SuperLink outlives the ``flwr run`` that started
    it, and is re-parented when that exits). :attr:`processes` maps each pid to its start
    time and command line, so :meth:`alive` never mistakes a reused pid for one of them.
    Pass one to :func:`launch` to learn which processes it started."""

    def __init__(self) -> None:
        #: pid -> (start time in clock ticks, command line)
        self.processes: dict[int, tuple[int, str]] = {}
        #: the Flower run id, once ``flwr run`` has printed it (:func:`run_flwr`)
        self.run_id: int | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def add_trees(self, roots: list[int]) -> None:
        """Record the processes of the trees under ``roots`` and under every live process
        recorded before."""
        parents = _parents()
        with self._lock:
            known = [pid for pid in self.processes if self._same(pid)]
        for root in {*roots, *known}:
            for pid in _process_tree(root, parents):
                started = start_time(pid)
                if started is None:
                    continue
                with self._lock:
                    if self.processes.get(pid, (None,))[0] != started:
                        self.processes[pid] = (started, command_line(pid))

    def _same(self, pid: int) -> bool:
        recorded = self.processes.get(pid)
        return recorded is not None and is_running(pid) and start_time(pid) == recorded[0]

    def alive(self) -> list[int]:
        """The recorded processes that still run (the same processes, not reused pids)."""
        with self._lock:
            pids = list(self.processes)
        return sorted(pid for pid in pids if self._same(pid))

    def commands(self) -> list[str]:
        with self._lock:
            return [command for _, command in self.processes.values()]

    def watch(self, roots: list[int], interval: float = 1.0) -> None:
        """Record the trees under ``roots`` now and then every ``interval`` s until
        :meth:`stop_watching`."""
        self.add_trees(roots)

        def loop() -> None:
            while not self._stop.wait(interval):
                self.add_trees(roots)

        self._stop.clear()
        self._thread = threading.Thread(target=loop, name="fedfusion-process-tracker",
                                        daemon=True)
        self._thread.start()

    def stop_watching(self, timeout: float = 10.0) -> None:
        """Stop the watcher, waiting at most ``timeout`` s: a read of ``/proc/<pid>/cmdline``
        can block while that process tears down a large address space, and the watcher is
        a daemon thread, so the caller goes on without it rather than wait for it."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                print(f"fedfusion.app.launch: the process watcher did not stop within "
                      f"{timeout:.0f} s; going on without it", file=sys.stderr, flush=True)
            self._thread = None


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
    parents = _parents()
    victims = [p for root in roots for p in _process_tree(root, parents)]
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
    fields = _stat(pid)
    return fields is not None and fields[0] not in ("Z", "X")


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
           timeout: float = 3 * 3600, *, tracker: ProcessTracker | None = None) -> dict:
    """Run ``flwr run`` on a private local SuperLink; return the parsed results.json.

    Every process the launch starts (``flwr run``, the SuperLink, the simulation and its Ray
    cluster) is stopped before it returns or raises, also on Ctrl-C, SIGTERM and
    ``timeout``; then, and only then, the run is also stopped on the SuperLink
    (:func:`stop_launch`). ``tracker`` receives those processes (:class:`ProcessTracker`),
    e.g. for a test that none is left."""
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
    refused = output_name_error("run-name", run_name)
    if refused:  # before Flower starts (the server would refuse it only once it started)
        from fedfusion.app.config import ConfigError  # torch: only on this path

        raise ConfigError(refused)
    paths = absolute_paths(run_config, app_dir / "outputs")
    items = [_toml_item(item) for item in shlex.split(run_config)
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
    federation_config = " ".join(f"{k}={v}" for k, v in federation.items())
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
