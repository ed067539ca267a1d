"""The processes a launch starts, read from ``/proc`` (Linux): each process's parent and
start time, the trees under given roots, and how to stop them.

A pid alone names a process only while it runs: :class:`ProcessTracker` records each with
its start time, so a pid reused after its process exited is never taken for it.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path


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
