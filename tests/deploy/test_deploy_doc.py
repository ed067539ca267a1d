"""docs/deploy.md runs as written: its shell blocks are extracted from the file and run.

Each fenced ``bash`` block of the page is run in order, as its text stands, unless the HTML
comment on the line before it (``<!-- doc-test: ... -->``) says otherwise:

* (no comment): run in the foreground; it must exit 0;
* ``env``: variable settings, prepended to every later block (each block runs in its own
  ``bash -euo pipefail``);
* ``background NAME PORT``: a server (SuperLink, SuperNode), started in its own process
  group; ready once PORT on 127.0.0.1 accepts connections;
* ``restart NAME PORT``: stop NAME's process group (as Ctrl-C in its terminal would) and
  wait until every process of it is gone, then start this block as NAME;
* ``stop NAME``: run this block in the foreground: the page's own command in it stops NAME
  (a SuperNode with its SuperExec and ClientApps) and waits until they are gone, so that
  nothing of NAME's process group may be left once the block has run;
* ``skip: REASON`` and ``external: TEST``: not run here (illustrative, or run by another
  test, which the comment names); a reason is required.

The environment is the reader's as the page tells it: the repository's ``.venv/bin`` first on
``PATH``, the checkout as the working directory, and a private ``HOME`` (so ``~/.flwr``,
``~/fedfusion-deploy`` and ``~/fedfusion-outputs`` are the test's own; ``FLWR_HOME`` names
the same ``~/.flwr``, which is how the leftover check finds every Flower process), plus
``FLWR_DISABLE_UPDATE_CHECK=1`` (no network in CI). Nothing of the page's text is replaced.

On top of what the blocks check themselves (``deploy check`` of each run's results.json),
the walkthrough's outcome is asserted: the runs fused exactly the devices present, each
device's upload holds its own file's sample count and class histogram, the devices that stay
upload bit-identical models when one joins or leaves, the registered node ids survive the
SuperLink's restart, and no process is left.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from conftest import FLOWER_PROCESSES
from deploy_tools import ProcessInfo, process_group, processes_under, stop, terminate
from helpers.doc_blocks import DOC, Block, shell_blocks

pytestmark = FLOWER_PROCESSES  # run apart from the other tests (conftest.py)

REPO = Path(__file__).resolve().parents[2]
KINDS = ("run", "env", "background", "restart", "stop", "skip", "external")
#: the whole walkthrough (3 runs, 4 SuperNodes) took 100-130 s here; a hung step fails it
BLOCK_TIMEOUT_S = 300


def test_every_shell_block_of_the_page_is_run_or_says_why_not():
    blocks = shell_blocks(DOC.read_text())
    assert len(blocks) >= 15
    for block in blocks:
        assert block.kind in KINDS, f"{block}: unknown doc-test marker"
        if block.kind in ("skip", "external"):
            assert block.args and len(block.args[0]) > 10, f"{block}: say why it is not run"
        if block.kind in ("background", "restart"):
            assert len(block.args) == 2 and block.args[1].isdigit(), f"{block}: NAME PORT"
    ran = [b for b in blocks if b.kind not in ("skip", "external")]
    assert len(ran) >= 12
    # the commands the issue found broken when pasted: every SuperLink of the page that runs
    # has its environment set up front (else `uv sync` kills the run, and `flwr run` exits 0)
    links = [b for b in ran if "flower-superlink" in b.text]
    assert links and all("FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1" in b.text
                         for b in links)
    # SuperNodes sharing the machine get their own --port in the command itself
    ports = [re.search(r"--port (\d+)", b.text) for b in ran if "flower-supernode" in b.text]
    assert all(ports) and len({p.group(1) for p in ports}) == len(ports) >= 4


def test_the_extractor_reads_markers():
    text = ("x\n<!-- doc-test: background superlink 9092 -->\n```bash\nserve\n```\n"
            "```toml\na = 1\n```\n<!-- doc-test: skip: needs root here -->\n```bash\nsudo x\n```\n"
            "```bash\nls\n```\n")
    blocks = shell_blocks(text)
    assert [(b.kind, b.args, b.text) for b in blocks] == [
        ("background", ["superlink", "9092"], "serve\n"),
        ("skip", ["needs root here"], "sudo x\n"),
        ("run", [], "ls\n")]


# ------------------------------------------------------------------------------ the walkthrough


def _port_open(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _stop_group(proc: subprocess.Popen) -> list[ProcessInfo]:
    """SIGTERM to every process of the block's process group (the server and what it started:
    a SuperNode's SuperExec and ClientApps, a SuperLink's SuperExec and ServerApp), SIGKILL
    after 20 s, and wait until all of them are gone, not only the block's own process: a
    SuperExec outlives its SuperNode by seconds. Returns what survived SIGKILL (empty)."""
    left = terminate([proc.pid], pgids=[proc.pid], grace_s=20)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)  # exited (a zombie until reaped here), unless it survived
    return left


def _assert_stopped(name: str, proc: subprocess.Popen) -> None:
    """The page's command stopped ``name``: after its block, no process of its group runs
    (the command waited for them). Only the block's own shell, whose child that was, may
    still be exiting: it is waited for first."""
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)
    left = process_group(proc.pid)
    assert proc.poll() is not None and not left, (
        f"{name}: the page's stop command left processes of it running: "
        f"{left or [proc.pid]}")


@dataclass
class Walkthrough:
    """What running the page left: per-block output, the private home, the server logs."""

    home: Path
    outputs: dict[int, str]  # block line -> combined output of a foreground block
    blocks: list[Block]

    def output_after(self, kind: str) -> str:
        """The output of the first foreground block after the first block of ``kind``."""
        start = next(i for i, b in enumerate(self.blocks) if b.kind == kind)
        return next(self.outputs[b.line] for b in self.blocks[start + 1:] if b.line in
                    self.outputs)

    def results(self, run_name: str) -> dict:
        return json.loads((self.home / "fedfusion-outputs" / run_name / "results.json")
                          .read_text())

    def uploads(self, run_name: str) -> dict[int, dict[str, np.ndarray]]:
        out = {}
        for file in (self.home / "fedfusion-outputs" / run_name / "uploads").glob("client_*.npz"):
            with np.load(file, allow_pickle=False) as npz:
                out[int(file.stem.split("_")[1])] = {k: npz[k] for k in npz.files}
        return out


def _environment(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("FLWR_", "FEDFUSION_DATA_DIR")) and k not in (
               "PYTHONPATH", "VIRTUAL_ENV")}
    env.update(HOME=str(home), FLWR_HOME=str(home / ".flwr"), FLWR_DISABLE_UPDATE_CHECK="1",
               PATH=f"{REPO / '.venv' / 'bin'}{os.pathsep}{env.get('PATH', '')}")
    return env


def run_walkthrough(home: Path) -> Walkthrough:
    blocks = shell_blocks(DOC.read_text())
    ports = [int(b.args[1]) for b in blocks if b.kind == "background"]
    busy = [port for port in ports if _port_open(port)]
    if busy:
        pytest.fail(f"ports {busy} of the walkthrough are in use on 127.0.0.1 (another run of "
                    "this test?); it needs them free")
    env = _environment(home)
    logs = home / "doc-test-logs"
    logs.mkdir(parents=True)
    prelude = ""
    servers: dict[str, subprocess.Popen] = {}
    stopping: dict[str, subprocess.Popen] = {}  # by the page's own command, in this block
    outputs: dict[int, str] = {}

    def start(block: Block) -> None:
        name, port = block.args
        log = open(logs / f"{name}.log", "a")  # noqa: SIM115 (kept open while it runs)
        proc = subprocess.Popen(["bash", "-euo", "pipefail", "-c", prelude + block.text],
                                cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        servers[name] = proc
        deadline = time.monotonic() + 90
        while not _port_open(int(port)):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"{block}: {name} did not open port {port} (exit {proc.poll()}):\n"
                            + (logs / f"{name}.log").read_text()[-3000:])
            time.sleep(0.3)

    try:
        for block in blocks:
            if block.kind in ("skip", "external"):
                continue
            if block.kind == "env":
                prelude += block.text
                continue
            if block.kind == "restart":
                left = _stop_group(servers.pop(block.args[0]))
                if left:
                    pytest.fail(f"{block}: {block.args[0]} survived SIGKILL: {left}")
            if block.kind == "stop":  # the block stops it: the page's command
                stopping[block.args[0]] = servers.pop(block.args[0])
            if block.kind in ("background", "restart"):
                start(block)
                continue
            started = time.monotonic()
            done = subprocess.run(["bash", "-euo", "pipefail", "-c", prelude + block.text],
                                  cwd=REPO, env=env, capture_output=True, text=True,
                                  timeout=BLOCK_TIMEOUT_S)
            outputs[block.line] = done.stdout + done.stderr
            print(f"{block}: exit {done.returncode} in {time.monotonic() - started:.1f} s")
            if done.returncode != 0:
                server_logs = "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}"
                                        for p in sorted(logs.glob("*.log")))
                pytest.fail(f"{block} exited {done.returncode}:\n{block.text}\n--- output\n"
                            f"{outputs[block.line][-4000:]}\n{server_logs}")
            if block.kind == "stop":
                _assert_stopped(block.args[0], stopping.pop(block.args[0]))
    finally:
        # every server's whole process group, waited for (and the group of one its block
        # was to stop, should that block have failed)
        for proc in [*servers.values(), *stopping.values()]:
            _stop_group(proc)
        left = processes_under(home / ".flwr")
        stop([], str(home / ".flwr"))  # never leave a deployment running on CI
        assert not left, f"processes left under {home / '.flwr'}: {left}"
    return Walkthrough(home, outputs, blocks)


@pytest.fixture(scope="module")
def walkthrough(tmp_path_factory) -> Walkthrough:
    return run_walkthrough(tmp_path_factory.mktemp("doc") / "home")


def _own_data(home: Path, device: int) -> tuple[int, list[int]]:
    with np.load(home / "fedfusion-deploy" / "data" / f"device-{device}.npz") as npz:
        return len(npz["y"]), np.bincount(npz["y"], minlength=10).tolist()


def test_the_walkthrough_fuses_the_devices_present_each_on_its_own_data(walkthrough):
    runs = {"fleet-3": [0, 1, 2], "fleet-4": [0, 1, 2, 3], "fleet-3b": [0, 2, 3]}
    uploads = {}
    for name, devices in runs.items():
        results = walkthrough.results(name)
        assert results["status"] == "ok" and not results["excluded"], name
        assert results["settings"]["client-data"] == "local"
        table = {c["client_id"]: c for c in results["clients"]}
        assert sorted(table) == devices, name
        for device in devices:
            assert (table[device]["num_examples"], table[device]["class_histogram"]) == \
                _own_data(walkthrough.home, device), (name, device)
        assert results["partition"] == {"client_data": "local", "clients": devices,
                                        "sizes": [1000] * len(devices),
                                        "histogram": [table[d]["class_histogram"]
                                                      for d in devices]}
        uploads[name] = walkthrough.uploads(name)
        assert sorted(uploads[name]) == devices
    # devices 0 and 2 took part in all three runs: the same upload each time
    for device in (0, 2):
        first = uploads["fleet-3"][device]
        for name in ("fleet-4", "fleet-3b"):
            other = uploads[name][device]
            assert first.keys() == other.keys()
            assert all(np.array_equal(first[k], other[k]) for k in first), (name, device)


def test_a_restarted_superlink_keeps_the_registered_fleet(walkthrough):
    state = walkthrough.home / "fedfusion-deploy" / "state" / "superlink.db"
    assert state.is_file() and state.stat().st_size > 0
    ids = [str(json.loads((walkthrough.home / "fedfusion-deploy" / "keys" /
                           f"device-{i}.json").read_text())["node-id"]) for i in range(3)]
    listed = walkthrough.output_after("restart")
    assert all(node_id in listed for node_id in ids), listed


def test_results_land_in_the_documented_place_and_nothing_is_left(walkthrough):
    outputs = walkthrough.home / "fedfusion-outputs"
    assert sorted(p.name for p in outputs.iterdir()) == ["fleet-3", "fleet-3b", "fleet-4"]
    for name in ("fleet-3", "fleet-4", "fleet-3b"):
        assert {"results.json", "predictor.pt", "uploads"} <= {
            p.name for p in (outputs / name).iterdir()}
    assert not processes_under(walkthrough.home / ".flwr")
