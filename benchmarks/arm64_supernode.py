"""An ARM64 SuperNode in a fleet: an aarch64 device's upload fused with x86-64 clients'.

The device is an arm64 Debian userland on this x86-64 machine (``benchmarks/arm64_install.sh``:
debootstrap, qemu-user through binfmt_misc, PyPI's aarch64 wheels of torch 2.10.0 (the
newest CPU-only one: later ones are CUDA builds that pull in the CUDA wheels) and flwr 1.41.0
in a venv), so every instruction of its SuperNode, SuperExec and ClientApp runs emulated. It
joins, as a device owner would (docs/deploy.md), a SuperLink on 127.0.0.1 (x86-64, TLS and
SuperNode authentication) next to ``--x86-clients`` SuperNodes of this machine; each device
trains the same ClientApp on its own data file (``client-data='local'``, Fashion-MNIST demo
files of ``--samples`` rows), LeNet, M = 1 member, ``--epochs`` local epoch(s); the server
fuses every upload (FedAvg). The chroot shares the host's network namespace, so its
SuperNode reaches the SuperLink on loopback; its files (CA, private key, data) are copies
under ``<root>/var/lib/fedfusion``, as on a device of its own.

It records, in benchmarks/results/arm64_supernode.json:

* ``machine``: ``platform.machine()`` inside the chroot (``aarch64``), the wheels' versions,
  and the emulated import time of torch and of flwr's ClientApp runtime;
* ``upload_fused``: the run's ``results.json`` says ``status: ok`` and lists the ARM64
  node's Flower node id (the one its registered key was given) among the fused clients,
  under the client id it claimed, with the x86 clients beside it;
* ``train_s``: the ARM64 client's wall training time as the ClientApp measured it
  (``train_time_s``), with its data loading and whole-message time, the x86 clients' beside;
* ``install``: each command of ``arm64_install.sh`` and its wall seconds (from the chroot's
  ``/root/fedfusion-install.jsonl``);
* ``estimate``: the native time on a real ARM64 core from the FLOP count: LeNet's forward +
  backward FLOPs per sample (PyTorch's ``FlopCounterMode`` over one SGD step, as
  ``benchmarks/throughput.py`` counts them) x rows x epochs, over an assumed sustained
  rate: a core's peak FP32 rate (``--native-gflops``, default a Raspberry Pi 5's
  Cortex-A76 at 2.4 GHz: 2 NEON FMA pipes x 4 lanes x 2 = 16 FLOP/cycle, 38.4 GFLOP/s)
  times the share of a core's peak the same training loop (PyTorch ops only, no compiled
  kernels: the chroot has no C compiler) reached on this machine's x86-64 core
  (``throughput.json``: samples/s x FLOPs/sample over the measured GEMM rate). The
  emulated GEMM rate inside the chroot is measured too, to show what emulation costs.

    sudo env PYTHONPATH=.:benchmarks .venv/bin/python benchmarks/arm64_supernode.py
        [--root /srv/arm64] [--work /tmp/arm64-supernode] [--x86-clients 2]
        [--samples 1000] [--epochs 1] [--skip-install]

Needs root (chroot, mounts). It first runs ``arm64_install.sh`` (each step skipped when done;
it also mounts /proc, /sys, /dev into the chroot); ``--skip-install`` only checks the chroot.
Every process it starts is stopped by pid on exit, with the processes tied to them
(``scripts/deploy_tools.py``), and waited for.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from common import REPO

sys.path.insert(0, str(REPO / "scripts"))
from deploy_tools import (  # noqa: E402
    FLOWER_PROGRAMS,
    _is_serverapp,
    free_ports,
    plan_run,
    processes_under,
    terminate,
    write_node_key,
    write_tls_files,
)
from throughput import CONFIG, load_rows, step_flops_per_sample  # noqa: E402

from fedfusion.datasets.local_file import write_demo_files  # noqa: E402

RESULTS = REPO / "benchmarks" / "results" / "arm64_supernode.json"
INSTALL = REPO / "benchmarks" / "arm64_install.sh"
#: the device's venv inside the chroot (arm64_install.sh) and its own files
ENV = "/opt/fedfusion-env"
DEVICE = "/var/lib/fedfusion"
#: why the chroot's torch is not the project's 2.14.1 (benchmarks/arm64_install.sh)
TORCH_NOTE = ("torch 2.10.0, not 2.14.1: PyPI's aarch64 wheels of torch 2.11.0 and later are "
              "CUDA 13 builds (2.14.1: 454 MB) whose metadata requires cuda-toolkit, "
              "nvidia-cudnn-cu13, nccl, cusparselt, nvshmem and triton on every Linux machine; "
              "2.10.0 (146 MB) is the newest whose CUDA requirements are for x86_64 only. "
              "The 2.14.1 install was started here and stopped once pip, having downloaded "
              "the 454 MB wheel, began collecting the CUDA wheels.")
#: Raspberry Pi 5 (Cortex-A76, 2.4 GHz): 2 NEON pipes x 4 float32 lanes x 2 (FMA) per cycle
PI5_PEAK_GFLOPS = 2 * 4 * 2 * 2.4


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def in_root(root: Path, *command: str, env: dict[str, str] | None = None
            ) -> list[str]:
    """``command`` run in the chroot with a clean environment (no host pip config, paths)."""
    base = {"HOME": "/root", "PATH": f"{ENV}/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "LANG": "C.UTF-8", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    base.update(env or {})
    return ["chroot", str(root), "/usr/bin/env", "-i",
            *(f"{k}={v}" for k, v in base.items()), *command]


PROBE = """
import json, platform, time
t = time.perf_counter()
from flwr.supernode.cli import flwr_clientapp
import flwr.supernode.runtime.run_clientapp
flwr_s = time.perf_counter() - t
t = time.perf_counter()
import torch
torch_s = time.perf_counter() - t
import flwr, numpy, scipy
torch.set_num_threads(1)
n = 256
a, b = torch.randn(n, n), torch.randn(n, n)
a @ b
best = float("inf")
for _ in range(3):
    t = time.thread_time(); a @ b; best = min(best, time.thread_time() - t)
print(json.dumps({"machine": platform.machine(), "python": platform.python_version(),
                  "torch": torch.__version__, "flwr": flwr.__version__,
                  "numpy": numpy.__version__, "scipy": scipy.__version__,
                  "torch_cuda": torch.cuda.is_available(),
                  "import_torch_s": torch_s, "import_flwr_clientapp_s": flwr_s,
                  "gemm_size": n, "gemm_gflops_emulated": 2 * n ** 3 / best / 1e9}))
"""


def probe(root: Path) -> dict[str, Any]:
    """What the chroot's Python reports about itself (all of it emulated)."""
    out = subprocess.run(in_root(root, f"{ENV}/bin/python", "-c", PROBE), check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


class ChrootWatch(threading.Thread):
    """Peak resident memory and CPU time of the Flower processes running in the chroot
    (``/proc/<pid>/root`` is ``root``), sampled every 0.5 s. Under qemu-user a process's
    memory includes the emulator and its translated code: an upper bound of the native."""

    def __init__(self, root: Path) -> None:
        super().__init__(daemon=True)
        self.root = os.path.realpath(root)
        self.seen: dict[int, dict[str, Any]] = {}
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.is_set():
            for entry in Path("/proc").iterdir():
                if entry.name.isdigit():
                    self._sample(int(entry.name))
            self.stopping.wait(0.5)

    def _sample(self, pid: int) -> None:
        proc = Path(f"/proc/{pid}")
        try:
            if os.path.realpath(proc / "root") != self.root:
                return
            argv = [a.decode(errors="replace")
                    for a in (proc / "cmdline").read_bytes().split(b"\0") if a]
            status = dict(line.split(":", 1) for line in (proc / "status").read_text()
                          .splitlines() if ":" in line)
            fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return
        program = next((Path(a).name for a in argv if Path(a).name in FLOWER_PROGRAMS), None)
        if program is None or "VmHWM" not in status:
            return
        cpu_s = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        entry = self.seen.setdefault(pid, {"pid": pid, "program": program, "cpu_s": 0.0,
                                           "peak_rss_mb": 0.0})
        entry["cpu_s"] = max(entry["cpu_s"], cpu_s)
        entry["peak_rss_mb"] = max(entry["peak_rss_mb"], int(status["VmHWM"].split()[0]) / 1024)


def install_log(root: Path) -> list[dict[str, Any]]:
    path = root / "root" / "fedfusion-install.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def estimate(rows: int, epochs: int, native_gflops: float) -> dict[str, Any]:
    """Native training seconds of the ARM64 client from the FLOP count (module docstring)."""
    x, y = load_rows(CONFIG.batch_size)
    flops = step_flops_per_sample("lenet", (1, 28, 28), x, y)
    measured = json.loads((REPO / "benchmarks" / "results" / "throughput.json").read_text())
    torch_ops = measured["models"]["lenet"]["summary"]["stacked, torch ops"]
    share = torch_ops["samples_per_cpu_s"] * flops / measured["gemm_flops_per_s"]
    sustained = native_gflops * 1e9 * share
    return {
        "flops_per_sample": flops, "rows": rows, "epochs": epochs,
        "total_gflop": flops * rows * epochs / 1e9,
        "assumed_peak_gflops_per_core": native_gflops,
        "assumed_share_of_peak": share,
        "share_source": "benchmarks/results/throughput.json: lenet 'stacked, torch ops' "
                        "samples per CPU s x FLOPs/sample over the x86-64 core's measured "
                        "float32 GEMM rate",
        "sustained_gflops": sustained / 1e9,
        "native_train_s": flops * rows * epochs / sustained,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=Path("/srv/arm64"))
    parser.add_argument("--work", type=Path, default=Path("/tmp/arm64-supernode"))
    parser.add_argument("--x86-clients", type=int, default=2)
    parser.add_argument("--samples", type=int, default=1000, help="rows of each device's file")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--native-gflops", type=float, default=PI5_PEAK_GFLOPS,
                        help="peak float32 GFLOP/s of one native ARM64 core (default: Pi 5)")
    parser.add_argument("--timeout", type=float, default=3600.0)
    parser.add_argument("--skip-install", action="store_true")
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("arm64_supernode: needs root (chroot)")
    root = args.root.resolve()

    if not args.skip_install:
        log(f"installing / checking the chroot: bash {INSTALL} {root}")
        subprocess.run(["bash", str(INSTALL), str(root)], check=True)
    if not (root / ENV.lstrip("/") / "bin" / "flower-supernode").exists():
        sys.exit(f"arm64_supernode: no {ENV}/bin/flower-supernode in {root}: run {INSTALL}")
    log("probing the chroot (emulated imports and GEMM)")
    inside = probe(root)
    log(f"inside: {inside}")
    if inside["machine"] != "aarch64":
        sys.exit(f"arm64_supernode: the chroot reports {inside['machine']!r}, not aarch64")

    work = args.work.resolve()
    shutil.rmtree(work, ignore_errors=True)
    (work / "logs").mkdir(parents=True)
    num_clients = args.x86_clients + 1
    arm_id = args.x86_clients  # the ARM64 device's client id: the last one
    certs = write_tls_files(work / "certs")
    names = [f"x86-{i}" for i in range(args.x86_clients)] + ["arm64"]
    for name in names:
        write_node_key(work / "keys", name)
    data = write_demo_files(work / "data", num_clients, args.samples)
    device = root / DEVICE.lstrip("/")
    shutil.rmtree(device, ignore_errors=True)
    device.mkdir(parents=True)
    for src, dst in ((certs.ca, "ca.pem"), (work / "keys" / "arm64", "device-key"),
                     (data[arm_id], "data.npz")):
        shutil.copy2(src, device / dst)
    log(f"work {work}: certificates, keys {names}, data files of {args.samples} rows")

    bin_dir = Path(sys.executable).parent
    flwr_home = work / "flwr-home"
    flwr_home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLWR_")}
    env.update(FLWR_HOME=str(flwr_home), FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION="1",
               FLWR_DISABLE_UPDATE_CHECK="1", OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1",
               PATH=f"{bin_dir}:{env.get('PATH', '')}")
    link_port, *node_ports = free_ports(num_clients + 1)
    superlink = f"127.0.0.1:{link_port}"
    pids: list[int] = []
    watch = ChrootWatch(root)

    def start(name: str, command: list[str]) -> subprocess.Popen[bytes]:
        log(f"+ {' '.join(command)}")
        proc = subprocess.Popen(command, env=env, cwd=work, start_new_session=True,
                                stdout=(work / "logs" / f"{name}.log").open("wb"),
                                stderr=subprocess.STDOUT)
        pids.append(proc.pid)
        return proc

    try:
        link = start("superlink", [
            str(bin_dir / "flower-superlink"), "--ssl-ca-certfile", str(certs.ca),
            "--ssl-certfile", str(certs.cert), "--ssl-keyfile", str(certs.key),
            "--enable-supernode-auth", "--host", "127.0.0.1", "--port", str(link_port)])
        (flwr_home / "config.toml").write_text(
            f'[superlink]\ndefault = "arm64"\n\n[superlink.arm64]\naddress = "{superlink}"\n'
            f'root-certificates = "{certs.ca}"\n')
        deadline = time.monotonic() + 60
        while subprocess.run(["bash", "-c", f"exec 3<>/dev/tcp/127.0.0.1/{link_port}"],
                             capture_output=True).returncode:
            if link.poll() is not None or time.monotonic() > deadline:
                sys.exit("arm64_supernode: the SuperLink did not start: "
                         f"{(work / 'logs' / 'superlink.log').read_text()[-2000:]}")
            time.sleep(0.2)
        node_ids = {}
        for name in names:
            out = subprocess.run([str(bin_dir / "flwr"), "supernode", "register",
                                  str(work / "keys" / f"{name}.pub"), "arm64", "--format",
                                  "json"], env=env, check=True, capture_output=True,
                                 text=True).stdout
            node_ids[name] = int(json.loads(out)["node-id"])
        log(f"registered node ids {node_ids}")

        nodes = {}
        for i in range(args.x86_clients):
            nodes[names[i]] = start(names[i], [
                str(bin_dir / "flower-supernode"), "--root-certificates", str(certs.ca),
                "--auth-supernode-private-key", str(work / "keys" / names[i]),
                "--superlink", superlink, "--host", "127.0.0.1", "--port", str(node_ports[i]),
                "--node-config", f"client-id={i} data-path='{data[i]}'"])
        # the device: no C compiler in its userland, so the native kernels are off by choice
        watch.start()
        nodes["arm64"] = start("arm64", in_root(root, "flower-supernode",
                                                "--root-certificates", f"{DEVICE}/ca.pem",
                                                "--auth-supernode-private-key",
                                                f"{DEVICE}/device-key",
                                                "--superlink", superlink,
                                                "--host", "127.0.0.1",
                                                "--port", str(node_ports[-1]),
                                                "--node-config",
                                                f"client-id={arm_id} "
                                                f"data-path='{DEVICE}/data.npz' "
                                                "accelerate=false",
                                                env={"FLWR_HOME": f"{DEVICE}/flwr",
                                                     "FLWR_DISABLE_UPDATE_CHECK": "1"}))

        run_config = (f"client-data='local' strategy='fedavg' model='lenet' num-members=1 "
                      f"local-epochs={args.epochs} node-wait-timeout={args.timeout} "
                      f"round-timeout={args.timeout} server-threads=1")
        plan = plan_run(run_config, num_clients, work / "outputs", "arm64")
        command = [str(bin_dir / "flwr"), "run", str(REPO), "arm64", "--stream",
                   "--run-config", " ".join(plan.items)]
        started = time.monotonic()
        run = start("flwr-run", command)
        deadline = started + args.timeout
        # `flwr run --stream` can return while the run goes on: it ends with its ServerApp
        while run.poll() is None or any(_is_serverapp(p) for p in processes_under(flwr_home)):
            for name, node in nodes.items():
                if node.poll() is not None:
                    sys.exit(f"arm64_supernode: SuperNode {name} exited: "
                             f"{(work / 'logs' / f'{name}.log').read_text()[-2000:]}")
            if time.monotonic() > deadline:
                sys.exit(f"arm64_supernode: the run did not finish within {args.timeout} s")
            time.sleep(2)
        run_s = time.monotonic() - started
        log(f"the run ended after {run_s:.0f} s")
    finally:
        watch.stopping.set()
        left = terminate(pids)
        left += terminate([p.pid for p in processes_under(flwr_home)])
        left += terminate([p.pid for p in processes_under(f"{DEVICE}/flwr")
                           if os.path.realpath(f"/proc/{p.pid}/root") == str(root)])
        if left:
            print(f"arm64_supernode: processes left: {left}", file=sys.stderr)

    results = json.loads(plan.results.read_text())
    clients = results.get("clients") or []
    arm = next((c for c in clients if c["node_id"] == node_ids["arm64"]), None)
    upload_fused = (results.get("status") == "ok" and arm is not None
                    and arm["client_id"] == arm_id and len(clients) == num_clients)
    apps = [p for p in watch.seen.values() if p["program"] == "flwr-clientapp"]
    out = {
        "machine": inside["machine"],
        "host_machine": platform.machine(),
        "chroot": inside,
        "upload_fused": upload_fused,
        "train_s": arm["train_time_s"] if arm else None,
        "arm64_client": arm,
        "fused_clients": [{k: c[k] for k in ("client_id", "node_id", "num_examples",
                                             "train_time_s", "load_time_s", "client_time_s")}
                          for c in clients],
        "arm64_node_id": node_ids["arm64"],
        "excluded": results.get("excluded"),
        "status": results.get("status"),
        "test_accuracy": (results.get("test") or {}).get("accuracy"),
        "run_wall_s": run_s,
        "run_config": plan.items,
        "arm64_processes": sorted(watch.seen.values(), key=lambda p: p["pid"]),
        "arm64_clientapp_cpu_s": max((p["cpu_s"] for p in apps), default=None),
        "install": install_log(root),
        "torch_note": TORCH_NOTE,
        "estimate": estimate(args.samples, args.epochs, args.native_gflops),
        "load_average_end": os.getloadavg(),
    }
    RESULTS.write_text(json.dumps(out, indent=1))
    log(f"upload_fused={upload_fused} train_s={out['train_s']} "
        f"(native estimate {out['estimate']['native_train_s']:.2f} s), "
        f"test accuracy {out['test_accuracy']}; saved {RESULTS}")
    if not upload_fused:
        sys.exit(f"arm64_supernode: the ARM64 upload was not fused: {results.get('error')}, "
                 f"clients {[(c['client_id'], c['node_id']) for c in clients]}")


if __name__ == "__main__":
    main()
