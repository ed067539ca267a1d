"""The App on Flower's deployment engine: a real SuperLink and SuperNodes on 127.0.0.1.

Every test runs ``scripts/deploy-local.sh`` (the script users run) and then checks that no
process it started is left: none of the pids it recorded runs, and no process carries its
private ``FLWR_HOME`` in its environment (Flower's SuperExec, ServerApp and ClientApp
processes included).

* insecure (FedBEns, Kron curvature): the run's uploads (weights and Kron factors) are
  bit-identical to the Ray simulation's of the same run config, and so is its test accuracy;
* TLS (ensemble, SuperNode 1 with ``num-members=2`` in its node config): a SuperNode that
  lacks the CA is refused;
* TLS + SuperNode authentication (FedAvg): a SuperNode with an unregistered key and one with
  no key are refused, the registered ones complete the run;
* a run that fails (``flwr run`` exits 0) fails the script, and SIGTERM stops everything;
* the helpers: certificates a TLS client accepts, keys Flower's own loaders read, the run
  config the script hands to ``flwr run``, and ``stop-supernode`` (a device leaving) ending
  the SuperNode with its SuperExec and ClientApp before it returns.

Real Fashion-MNIST: 3 clients on a 6,000-sample subset (Dirichlet 1.0), 5 local epochs; floors
55% (measured in process: FedAvg 67.3%, ensemble 71.0%, FedBEns 67.5%).
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from conftest import FLOWER_PROCESSES, LAUNCH_TIMEOUT_S
from deploy_tools import (
    free_ports,
    live_processes,
    plan_run,
    processes_under,
    stop,
    stop_supernode,
    supernode_processes,
    terminate,
    write_node_key,
    write_tls_files,
)
from deploy_tools import main as deploy_tools_main
from helpers.doc_blocks import shell_blocks

from fedfusion.app.launch import launch
from fedfusion.app.processes import is_running
from fedfusion.datasets import write_partition_file

pytestmark = FLOWER_PROCESSES  # run apart from the other tests (conftest.py)

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "deploy-local.sh"
COMMON = "train-subset=6000 local-epochs=5 alpha=1.0 val-size=200 num-members=1"
#: one server thread: with torch's default (one per core) the FedBEns server's float
#: reductions vary from run to run (NLL 0.8010623 or 0.8010631 from the same uploads, in
#: deployment and simulation alike), which would hide a real difference between the two
FEDBENS = "strategy=fedbens server-steps=30 server-threads=1"
REFUSED = "Failed to initialize the connection to the SuperLink"


@dataclass
class Deployment:
    """One run of the script: its exit code, output, work folder and results (if any)."""

    returncode: int
    output: str
    work: Path
    results: dict | None

    def log(self, name: str) -> str:
        return (self.work / "logs" / f"{name}.log").read_text()


def _started_pids(work: Path) -> list[int]:
    return [int(line.split()[0]) for line in (work / "pids").read_text().splitlines()]


def assert_nothing_left(work: Path) -> None:
    """No pid the script recorded runs, no process runs under its FLWR_HOME."""
    running = [pid for pid in _started_pids(work) if is_running(pid)]
    assert not running, f"processes the script started still run: {running}"
    left = processes_under(work / "flwr-home")
    assert not left, f"processes left under {work / 'flwr-home'}: {left}"


def script_env() -> dict[str, str]:
    """The script's environment: this interpreter, no Flower settings of the caller, and no
    PYTHONPATH, so that Flower's processes can import fedfusion only from the App bundle
    (they run outside the checkout, and fedfusion is not installed in the environment)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("FLWR_") and k != "PYTHONPATH"}
    env["PYTHON"] = sys.executable
    return env


def deploy(work: Path, mode: str, run_config: str, *options: str, common: str = COMMON
           ) -> Deployment:
    """Run the script; assert it left nothing running, whatever its outcome."""
    return run_script(work, mode, ["--mode", mode, "--work-dir", str(work), "--run-config",
                                   f"{common} {run_config}", *options])


def documented_command(test_name: str) -> list[str]:
    """The arguments of the ``scripts/deploy-local.sh`` command that docs/deploy.md hands to
    test ``test_name`` (its ``<!-- doc-test: external: ... -->`` block): the page's text is
    what runs."""
    (block,) = [b for b in shell_blocks((REPO / "docs" / "deploy.md").read_text())
                if b.kind == "external" and f"::{test_name} " in f"{b.args[0]} "]
    words = shlex.split(block.text.replace("\\\n", " "), comments=True)
    assert words[:2] == ["bash", "scripts/deploy-local.sh"], block.text
    return words[2:]


def run_script(work: Path, mode: str, args: list[str]) -> Deployment:
    """Run the script with ``args``; assert it left nothing running, whatever its outcome.
    Past LAUNCH_TIMEOUT_S it gets SIGTERM (its trap stops the deployment), not subprocess's
    SIGKILL, which would leave the deployment running."""
    proc = subprocess.Popen(
        ["bash", str(SCRIPT), *args],
        env=script_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = proc.communicate(timeout=LAUNCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.terminate()
        output, _ = proc.communicate(timeout=60)
        pytest.fail(f"deploy-local.sh --mode {mode} ran past {LAUNCH_TIMEOUT_S} s:\n"
                    f"{output[-4000:]}")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        left = processes_under(work / "flwr-home")
        stop([], str(work / "flwr-home"))  # never leave a deployment running on CI
    assert not left, f"processes left under {work / 'flwr-home'}: {left}"
    assert_nothing_left(work)
    results_file = work / "outputs" / f"deploy-{mode}" / "results.json"
    results = json.loads(results_file.read_text()) if results_file.is_file() else None
    return Deployment(proc.returncode, output, work, results)


def assert_ok(run: Deployment, floor: float) -> dict:
    assert run.returncode == 0, run.output[-4000:]
    assert "deploy-local: OK" in run.output
    results = run.results
    assert results is not None and results["status"] == "ok"
    assert sorted(c["client_id"] for c in results["clients"]) == [0, 1, 2]
    assert not results["excluded"]
    assert results["test"]["accuracy"] >= floor
    return results


# ------------------------------------------------------------------------------ insecure


@pytest.fixture(scope="module")
def insecure(tmp_path_factory) -> Deployment:
    return deploy(tmp_path_factory.mktemp("deploy") / "insecure", "insecure", FEDBENS)


def test_insecure_deployment_runs_fedbens(insecure):
    results = assert_ok(insecure, floor=0.55)
    assert all("curvature.kron" in c["section_time_s"] for c in results["clients"])
    assert sum(c["num_examples"] for c in results["clients"]) == 6000
    assert "--insecure" in insecure.output.split("+ flower-superlink", 1)[1].splitlines()[0]
    # the ClientApp ran from the App bundle `flwr run` shipped, installed in the node's home
    assert list((insecure.work / "flwr-home" / "apps").glob("fedfusion.fedfusion.*"))


def _npz(folder: Path) -> dict[str, dict[str, np.ndarray]]:
    files = sorted(folder.glob("client_*.npz"))
    assert [f.name for f in files] == ["client_0.npz", "client_1.npz", "client_2.npz"]
    out = {}
    for file in files:
        with np.load(file, allow_pickle=False) as npz:
            out[file.name] = {key: npz[key] for key in npz.files}
    return out


def test_deployment_equals_the_simulation_of_the_same_run_config(insecure, tmp_path):
    """Same seed, same partitions, one torch thread per client and on the server in both:
    the uploads (weights, Kron factors) are bit-identical and so are the fused model's test
    accuracy, NLL and ECE."""
    assert_ok(insecure, floor=0.0)
    simulated = launch(f"{COMMON} {FEDBENS} num-clients=3 output-dir='{tmp_path}' run-name=sim",
                       timeout=LAUNCH_TIMEOUT_S)
    deployed_uploads = _npz(insecure.work / "outputs" / "deploy-insecure" / "uploads")
    simulated_uploads = _npz(tmp_path / "sim" / "uploads")
    for name, arrays in deployed_uploads.items():
        assert arrays.keys() == simulated_uploads[name].keys()
        for key, array in arrays.items():
            other = simulated_uploads[name][key]
            assert array.dtype == other.dtype and np.array_equal(array, other), (name, key)
    manifests = [json.loads((folder / "manifest.json").read_text())["clients"] for folder in
                 (insecure.work / "outputs" / "deploy-insecure" / "uploads",
                  tmp_path / "sim" / "uploads")]
    for deployed, sim in zip(*manifests, strict=True):
        assert {k: deployed[k] for k in ("client_id", "num_examples", "num_members")} == {
            k: sim[k] for k in ("client_id", "num_examples", "num_members")}
        assert deployed["metrics"]["class-histogram"] == sim["metrics"]["class-histogram"]
    assert insecure.results["test"] == simulated["test"]


# ------------------------------------------------------------------------------ TLS


def test_tls_deployment_refuses_a_supernode_without_the_ca(tmp_path):
    """Also: the clients' rows come from a partition file (bring-your-own partition); node 1
    reads its own copy (node config), and every node's copy matches the server's hash."""
    rows = np.random.default_rng(0).permutation(60_000)
    split = tmp_path / "split.npz"
    digest = write_partition_file(split, np.split(rows[:6000], 3), rows[6000:6200])
    copy = tmp_path / "node1" / "split-copy.npz"
    copy.parent.mkdir()
    copy.write_bytes(split.read_bytes())
    run = deploy(tmp_path / "tls", "tls",
                 f"strategy=ensemble partition-file='{split}' val-source='file'",
                 "--node", "1", f"num-members=2 partition-file='{copy}'", "--intruders",
                 common=COMMON.replace("train-subset=6000 ", ""))
    results = assert_ok(run, floor=0.55)
    assert {c["client_id"]: c["num_members"] for c in results["clients"]} == {0: 1, 1: 2, 2: 1}
    assert results["partition"]["file_sha256"] == digest
    assert results["partition"]["sizes"] == [2000, 2000, 2000]
    assert results["partition"]["val_overlap_with_clients"] == 0
    assert "Uvicorn running on https://127.0.0.1:" in run.log("superlink")
    intruder = run.log("intruder-untrusted-ca")
    assert REFUSED in intruder and "CERTIFICATE_VERIFY_FAILED" in intruder
    assert "intruder 'untrusted-ca' refused" in run.output


# ------------------------------------------------------------------------------ TLS + auth


def test_supernode_authentication_refuses_unregistered_supernodes(tmp_path):
    """The command docs/deploy.md shows for the script, as written there (plus a work
    folder)."""
    args = documented_command("test_supernode_authentication_refuses_unregistered_supernodes")
    assert args[:3] == ["--mode", "auth", "--intruders"]
    run = run_script(tmp_path / "auth", "auth", [*args, "--work-dir", str(tmp_path / "auth")])
    results = assert_ok(run, floor=0.55)
    # the intruders had node config partition-id=0: had one taken part, client 0 would be
    # listed twice
    assert len(results["clients"]) == 3
    superlink = run.log("superlink")
    assert "--enable-supernode-auth" in run.output
    assert superlink.count("register-node HTTP/1.1\" 200") >= 3  # flwr supernode register
    unregistered = run.log("intruder-unregistered-key")
    assert REFUSED in unregistered and "Failed to activate SuperNode" in unregistered
    assert "No SuperNode found with the given public key" in superlink
    no_key = run.log("intruder-no-key")
    assert REFUSED in no_key and "All SuperNodes must be registered via the CLI" in no_key
    for i in range(3):  # every registered SuperNode received the run and trained
        assert f"client {i} member 1/1" in run.log(f"supernode-{i}")


# ------------------------------------------------------------------------------ failures


def test_a_failed_run_fails_the_script_and_stops_everything(tmp_path):
    """The ensemble is one-shot: the ServerApp fails before it trains anyone (so one
    SuperNode is enough); `flwr run` exits 0, the script 1."""
    run = deploy(tmp_path / "failed", "insecure", "strategy=ensemble num-rounds=2 num-clients=1")
    assert run.returncode == 1, run.output[-4000:]
    assert run.results is not None and run.results["status"] == "failed"
    assert "deploy-local: the run failed: ConfigError" in run.output


def test_sigterm_stops_everything(tmp_path):
    work = tmp_path / "term"
    proc = subprocess.Popen(
        ["bash", str(SCRIPT), "--work-dir", str(work), "--run-config", f"{COMMON} local-epochs=50"],
        env=script_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        pids = work / "pids"
        while not (pids.is_file() and "flwr-run" in pids.read_text()):
            assert proc.poll() is None and time.monotonic() < deadline, "the run never started"
            time.sleep(0.2)
        time.sleep(2)  # the run in progress, Flower's subprocesses starting
        # the leftover check below sees the deployment's processes while they run
        running = {p.program for p in processes_under(work / "flwr-home")}
        assert {"flower-superlink", "flower-supernode", "flower-superexec"} <= running
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 143
        assert_nothing_left(work)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        # a failed assertion above must not leave the deployment running on the CI machine
        stop([], str(work / "flwr-home"))


# ------------------------------------------------------------------------------ helpers


def _handshake(server_ctx: ssl.SSLContext, client_ctx: ssl.SSLContext, name: str) -> bytes:
    """One TLS connection on 127.0.0.1 in which the client verifies the server as ``name``;
    returns what the server sent, or raises the client's ssl error."""
    with socket.create_server(("127.0.0.1", 0)) as listener:

        def serve() -> None:
            conn, _ = listener.accept()
            try:
                with server_ctx.wrap_socket(conn, server_side=True) as tls:
                    tls.sendall(b"ok")
            except (ssl.SSLError, OSError):  # the client refused us
                conn.close()

        thread = threading.Thread(target=serve)
        thread.start()
        try:
            with socket.create_connection(listener.getsockname()) as raw, \
                    client_ctx.wrap_socket(raw, server_hostname=name) as tls:
                return tls.recv(2)
        finally:
            thread.join()


def test_the_server_certificate_passes_tls_verification_against_the_ca(tmp_path):
    """Real handshakes with Python's ssl (under httpx, Flower's HTTP client), strict X.509
    checks on: both names verify against the CA; another CA is refused."""
    files = write_tls_files(tmp_path, ["127.0.0.1", "localhost"])
    assert oct(files.key.stat().st_mode & 0o777) == "0o600"
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(files.cert, files.key)
    client_ctx = ssl.create_default_context(cafile=str(files.ca))
    client_ctx.verify_flags |= ssl.VERIFY_X509_STRICT
    for name in ("127.0.0.1", "localhost"):
        assert _handshake(server_ctx, client_ctx, name) == b"ok"
    with pytest.raises(ssl.SSLCertVerificationError, match="Hostname mismatch|IP address"):
        _handshake(server_ctx, client_ctx, "10.0.0.1")
    other = ssl.create_default_context(cafile=str(write_tls_files(tmp_path / "other").ca))
    with pytest.raises(ssl.SSLCertVerificationError, match="unable to get local issuer"):
        _handshake(server_ctx, other, "127.0.0.1")


def test_node_keys_are_what_flower_reads(tmp_path):
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.hazmat.primitives.serialization import load_ssh_private_key
    from flwr.cli.supernode.register import try_load_public_key
    from flwr.supercore.primitives.asymmetric import public_key_to_bytes

    private, public = write_node_key(tmp_path, "node")
    assert oct(private.stat().st_mode & 0o777) == "0o600"
    key = load_ssh_private_key(private.read_bytes(), None)  # flower-supernode's loader
    assert isinstance(key, ec.EllipticCurvePrivateKey) and key.curve.name == "secp384r1"
    # `flwr supernode register` sends the bytes of the public key the SuperNode derives
    assert try_load_public_key(public) == public_key_to_bytes(key.public_key())


def test_the_run_config_handed_to_flwr_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    plan = plan_run("strategy=fedbens alpha=0.5 model-kwargs='{\"a\": 1}' output-dir=out",
                    None, tmp_path / "default", "deploy-tls")
    assert plan.items == ["strategy='fedbens'", "alpha=0.5", "model-kwargs='{\"a\": 1}'",
                          "num-clients=3", "run-name='deploy-tls'",
                          f"output-dir='{tmp_path / 'out'}'"]
    assert plan.results == tmp_path / "out" / "deploy-tls" / "results.json"
    # paths of this machine are made absolute: Flower's processes run in other folders
    assert plan_run("partition-file=split.npz data-dir=''", None, tmp_path, "y").items[-1] == \
        f"partition-file='{tmp_path / 'split.npz'}'"
    assert plan_run("num-clients=5 run-name=x", None, tmp_path, "y").num_clients == 5
    assert plan_run("", 4, tmp_path, "y").items[0] == "num-clients=4"
    with pytest.raises(ValueError, match="--num-clients 4 contradicts the run config's "
                                         "num-clients=5"):
        plan_run("num-clients=5", 4, tmp_path, "y")
    with pytest.raises(ValueError, match=r"must be key=value, got \['fedavg'\]"):
        plan_run("fedavg", None, tmp_path, "y")
    with pytest.raises(ValueError, match="largest-client-first=true is for simulations only"):
        plan_run("largest-client-first=true", None, tmp_path, "y")


def test_serverapp_running_sees_only_a_serverapp_under_its_flwr_home(tmp_path):
    """What the script waits on after `flwr run --stream` returns: a ``flwr-serverapp``
    process carrying its FLWR_HOME (a ClientApp, or a ServerApp of another home, is not)."""
    home, other = tmp_path / "home", tmp_path / "other"
    home.mkdir(), other.mkdir()
    for name in ("flwr-serverapp", "flwr-clientapp"):
        (tmp_path / name).write_text("import time\ntime.sleep(60)\n")

    def start(name: str, flwr_home: Path) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, str(tmp_path / name)],
                                env={**os.environ, "FLWR_HOME": str(flwr_home)})

    procs = [start("flwr-clientapp", home), start("flwr-serverapp", other)]
    try:
        assert deploy_tools_main(["serverapp-running", str(home)]) == 1
        procs.append(start("flwr-serverapp", home))
        deadline = time.monotonic() + 10
        while deploy_tools_main(["serverapp-running", str(home)]) != 0:
            assert time.monotonic() < deadline, "the ServerApp process was not seen"
            time.sleep(0.1)
        procs[-1].terminate()
        procs[-1].wait()
        assert deploy_tools_main(["serverapp-running", str(home)]) == 1
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def test_stop_supernode_ends_its_superexec_and_clientapps_and_waits(tmp_path):
    """What docs/deploy.md's `deploy_tools.py stop-supernode --port P` does when a device
    leaves: the SuperNode of port P, its SuperExec (which ignores SIGTERM here: SIGKILL after
    the grace) and the SuperExec's ClientApp are all gone when it returns, the SuperExec of a
    SuperNode that exited first too (re-parented, found by its Runtime API port and its
    ``--parent-pid``); another port's SuperNode runs on. Stand-ins named like Flower's
    programs, linked as Flower links them (``--parent-pid``, ``--runtime-api-address``)."""
    scripts = {
        "flower-supernode": (
            "import os, subprocess, sys, time\n"
            "port = sys.argv[sys.argv.index('--port') + 1]\n"
            "subprocess.Popen([sys.executable, sys.argv[0].replace('flower-supernode',"
            " 'flower-superexec'), '--runtime-api-address', f'127.0.0.1:{port}',"
            " '--parent-pid', str(os.getpid())])\n"
            "time.sleep(600)\n"),
        "flower-superexec": (
            "import os, signal, subprocess, sys, time\n"
            "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
            "subprocess.Popen([sys.executable, sys.argv[0].replace('flower-superexec',"
            " 'flwr-clientapp'), '--parent-pid', str(os.getpid())])\n"
            "time.sleep(600)\n"),
        "flwr-clientapp": "import time\ntime.sleep(600)\n",
    }
    for name, text in scripts.items():
        (tmp_path / name).write_text(text)
    ports = free_ports(3)

    def start(port: int) -> tuple[subprocess.Popen, list[int]]:
        """A stand-in SuperNode; returns once its SuperExec and ClientApp run."""
        node = subprocess.Popen([sys.executable, str(tmp_path / "flower-supernode"),
                                 "--port", str(port)])
        nodes.append(node)
        deadline = time.monotonic() + 60
        while True:
            family = [p.pid for p in supernode_processes(port)]
            family += [p.pid for p in processes_under_parent(family)]
            if len(family) == 3:
                return node, family
            assert time.monotonic() < deadline, f"the stand-ins did not start: {family}"
            time.sleep(0.1)

    def processes_under_parent(pids: list[int]) -> list:
        return [p for p in live_processes().values()
                if p.parent_pid_option in pids and p.program == "flwr-clientapp"]

    nodes: list[subprocess.Popen] = []
    try:
        (_, family), (_, kept) = start(ports[0]), start(ports[1])
        found, left = stop_supernode(ports[0], grace_s=1)
        assert sorted(p.program for p in found) == ["flower-superexec", "flower-supernode"]
        assert left == [] and not any(is_running(pid) for pid in family)
        assert all(is_running(pid) for pid in kept)
        # a SuperNode that exited first (killed alone): its SuperExec is still found
        orphaned, family = start(ports[2])
        orphaned.kill()
        orphaned.wait()
        found, left = stop_supernode(ports[2], grace_s=1)
        assert [p.program for p in found] == ["flower-superexec"]
        assert left == [] and not any(is_running(pid) for pid in family)
        assert deploy_tools_main(["stop-supernode", "--port", str(ports[2])]) == 0
    finally:
        terminate([n.pid for n in nodes if n.returncode is None], grace_s=1)  # not reaped
        for node in nodes:
            node.wait()
