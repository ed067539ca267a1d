"""Operations helpers for a Flower deployment of the App, from a checkout (not part of the
wheel: a library user's process never needs a CA, node keys or process management).

They serve ``scripts/deploy-local.sh`` (the parts of a local deployment bash does badly),
the walkthrough in docs/deploy.md and its tests.

The script starts a real ``flower-superlink`` and N ``flower-supernode`` processes on
127.0.0.1 (Flower's deployment engine, no Ray) and runs the App on them with ``flwr run``;
its commands are the ones a user types on real machines (see docs/deploy.md). This module
gives, as ``python scripts/deploy_tools.py <command>``:

``tls DIR [--host H]... [--days D]``
    a new CA and a server certificate it signs for H... and 127.0.0.1/localhost:
    ``ca.pem``, ``server.pem``, ``server.key``;
``node-key DIR NAME...``
    SuperNode authentication key pairs: EC P-384 in OpenSSH format (``NAME`` and
    ``NAME.pub``), the format ``flower-supernode --auth-supernode-private-key`` and
    ``flwr supernode register`` read;
``free-ports N``
    N distinct free TCP ports on 127.0.0.1 (:func:`fedfusion.app.launch.free_port`);
``plan "k=v ..." --output-dir DIR --run-name NAME [--num-clients N]``
    shell assignments ``NUM_CLIENTS``, ``RESULTS`` (the run's results.json) and
    ``RUN_CONFIG_ARGS`` (TOML-typed ``--run-config`` flags, bare strings quoted as the
    launcher does), for ``eval`` (:func:`plan_run`);
``stop PID... [--flwr-home FLWR_HOME]``
    stop PID... with their descendants and the Flower processes tied to them by
    ``--parent-pid``, then what still runs under FLWR_HOME, and wait until all of it is gone
    (SIGTERM, SIGKILL after a grace period; :func:`stop`); exit 1 if anything survived;
``stop-supernode [--port PORT]``
    stop a device: the SuperNode whose Runtime API port is PORT (its ``--port``, default
    9094), its SuperExec (also one whose SuperNode exited already) and their ClientApps, and
    wait until they are gone (:func:`stop_supernode`); exit 1 if anything survived;
``leftovers FLWR_HOME``
    list the live processes whose environment has ``FLWR_HOME=<FLWR_HOME>``: everything the
    script started and everything Flower spawned from it; exit 1 if there is any;
``watch FLWR_HOME OUT``
    sample the peak memory and the CPU time of Flower's processes among them until SIGTERM,
    then write OUT (JSON, :func:`watch`);
``check RESULTS --clients N|ID,ID,...``
    judge a run by its ``results.json`` (``flwr run`` exits 0 even when the run fails): exit
    1 unless it is ok and fused exactly the expected clients; missing devices are named.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import ipaddress
import json
import os
import shlex
import signal
import sys
import time
from collections.abc import Collection, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

# run as a script from a checkout: the checkout's fedfusion, as the benchmarks do
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fedfusion.app.launch import (  # noqa: E402
    absolute_paths,
    free_port,
    run_config_value,
    toml_item,
)

#: the hosts every server certificate of :func:`main`'s ``tls`` is valid for
TLS_HOSTS = ("127.0.0.1", "localhost")

#: ``flower-supernode --port``'s default, the port of its Runtime API (flwr 1.41,
#: ``SUPERNODE_UVICORN_DEFAULT_PORT``): its SuperExec's ``--runtime-api-address``
SUPERNODE_DEFAULT_PORT = 9094


@dataclass(frozen=True)
class TlsFiles:
    """PEM files of a TLS deployment: the CA every client trusts, the server's pair."""

    ca: Path
    cert: Path
    key: Path


def write_tls_files(folder: Path, hosts: Sequence[str] = TLS_HOSTS, days: int = 7) -> TlsFiles:
    """Write a new CA and a server certificate it signs, valid for ``hosts`` (IP addresses or
    DNS names) from now for ``days``. Private keys are written mode 0600.

    The server certificate carries subject/authority key identifiers and the serverAuth
    usage, so a strict verifier (Python >= 3.13 sets VERIFY_X509_STRICT) accepts it."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    folder.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC) - datetime.timedelta(minutes=5)
    until = now + datetime.timedelta(days=days)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fedfusion local CA")])
    ca_ski = x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key())
    ca_cert = (
        x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
        .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now).not_valid_after(until)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(
            digital_signature=False, content_commitment=False, key_encipherment=False,
            data_encipherment=False, key_agreement=False, key_cert_sign=True, crl_sign=True,
            encipher_only=False, decipher_only=False), critical=True)
        .add_extension(ca_ski, critical=False)
        .sign(ca_key, hashes.SHA256()))
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
        .issuer_name(ca_name).public_key(key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now).not_valid_after(until)
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                       critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski),
                       critical=False)
        .sign(ca_key, hashes.SHA256()))
    files = TlsFiles(folder / "ca.pem", folder / "server.pem", folder / "server.key")
    files.ca.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    files.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_private(files.key, key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()))
    return files


def write_node_key(folder: Path, name: str) -> tuple[Path, Path]:
    """Write a SuperNode key pair ``folder/name`` (private) and ``folder/name.pub``.

    Flower 1.41 wants an elliptic-curve key on a NIST curve in OpenSSH format: the SuperNode
    loads the private key with ``load_ssh_private_key`` and ``flwr supernode register`` the
    public one with ``load_ssh_public_key`` (same as ``ssh-keygen -t ecdsa -b 384 -N ''``)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    folder.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP384R1())
    private, public = folder / name, folder / f"{name}.pub"
    _write_private(private, key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
        serialization.NoEncryption()))
    public.write_bytes(key.public_key().public_bytes(
        serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH) + b"\n")
    return private, public


def _write_private(path: Path, data: bytes) -> None:
    """Create ``path`` readable by its owner only, before any key byte is written."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as file:
        file.write(data)


def free_ports(count: int) -> list[int]:
    """``count`` distinct free ports on 127.0.0.1 (:func:`fedfusion.app.launch.free_port`
    may hand out the same port twice once it is released)."""
    ports: list[int] = []
    while len(ports) < count:
        port = free_port()
        if port not in ports:
            ports.append(port)
    return ports


@dataclass(frozen=True)
class RunPlan:
    """What ``flwr run`` gets and where the run's results will be."""

    items: list[str]
    num_clients: int
    results: Path


def plan_run(run_config: str, num_clients: int | None, output_dir: Path, run_name: str
             ) -> RunPlan:
    """Turn the user's ``run_config`` (``"k=v ..."``, bare strings allowed, as for
    ``python -m fedfusion.app.launch``) into TOML-typed ``--run-config`` items, with
    ``num-clients`` (one SuperNode per client), an absolute ``output-dir`` and a
    ``run-name``: the run config's own when set, else ``num_clients`` (3 when None),
    ``output_dir`` and ``run_name``. A ``num_clients`` that contradicts the run config's
    ``num-clients`` is an error."""
    items = shlex.split(run_config)
    bad = [item for item in items if "=" not in item or not item.partition("=")[0]]
    if bad:
        raise ValueError(f"run config items must be key=value, got {bad}")
    given = run_config_value(run_config, "num-clients")
    if given is not None:
        if not given.isdigit() or int(given) < 1:
            raise ValueError(f"num-clients must be a positive integer, got {given!r}")
        if num_clients is not None and int(given) != num_clients:
            raise ValueError(f"--num-clients {num_clients} contradicts the run config's "
                             f"num-clients={given}")
        num_clients = int(given)
    if (run_config_value(run_config, "largest-client-first") or "").lower() == "true":
        raise ValueError("largest-client-first=true is for simulations only: on SuperNodes "
                         "partition-id names the node's own data, which the flag would swap")
    num_clients = 3 if num_clients is None else num_clients
    name = (run_config_value(run_config, "run-name") or "").strip("'\"") or run_name
    paths = absolute_paths(run_config, output_dir)
    items = [toml_item(item) for item in items if item.partition("=")[0] not in (
        "num-clients", "run-name", *paths)]
    items += [f"num-clients={num_clients}", f"run-name='{name}'"]
    items += [f"{key}='{value}'" for key, value in paths.items()]
    return RunPlan(items, num_clients, Path(paths["output-dir"]) / name / "results.json")


# ------------------------------------------------------------------------- processes


@dataclass(frozen=True)
class ProcessInfo:
    """A live process seen in /proc; ``start`` (clock ticks since boot) and ``pid`` together
    name it (a pid alone may be reused once its process exits)."""

    pid: int
    ppid: int
    program: str
    argv: tuple[str, ...]
    pgid: int = 0
    start: int = field(default=0, repr=False)
    uid: int = field(default=-1, repr=False)

    def option(self, name: str) -> str | None:
        """The value of the command-line option ``name`` (``--name V`` or ``--name=V``)."""
        for i, arg in enumerate(self.argv):
            if arg == name and i + 1 < len(self.argv):
                return self.argv[i + 1]
            if arg.startswith(f"{name}="):
                return arg.partition("=")[2]
        return None

    @property
    def parent_pid_option(self) -> int | None:
        """The ``--parent-pid`` Flower gives the processes it starts (a SuperNode's or a
        SuperLink's SuperExec, a SuperExec's ClientApp or ServerApp): each exits once that
        process is gone, but only by polling, after its current retry, up to about 20 s
        later; the link survives the parent's death (the child is re-parented to PID 1)."""
        value = self.option("--parent-pid")
        return int(value) if value is not None and value.isdigit() else None


def _read_process(pid: int) -> ProcessInfo | None:
    """The process ``pid``, or None when it is gone or a zombie (exited, not yet reaped)."""
    proc = Path("/proc") / str(pid)
    try:
        fields = proc.joinpath("stat").read_text().rsplit(")", 1)[1].split()
        state, ppid, pgid, start = fields[0], int(fields[1]), int(fields[2]), int(fields[19])
        argv = tuple(a.decode(errors="replace") for a in
                     proc.joinpath("cmdline").read_bytes().split(b"\0") if a)
        uid = proc.stat().st_uid
    except (OSError, IndexError, ValueError):
        return None
    if state in ("Z", "X") or not argv:
        return None
    # a console script runs as `python /path/bin/flower-supernode ...`: name it by the script
    program = Path(argv[1]).name if len(argv) > 1 and "python" in Path(argv[0]).name else (
        Path(argv[0]).name)
    return ProcessInfo(pid, ppid, program, argv, pgid, start, uid)


def live_processes() -> dict[int, ProcessInfo]:
    """Every live process but this one, read in one pass over /proc."""
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            info = _read_process(int(entry.name))
            if info is not None:
                found[info.pid] = info
    return found


def _environment(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(e.decode(errors="replace").partition("=")[::2] for e in raw.split(b"\0") if e)


def processes_under(flwr_home: str | os.PathLike[str]) -> list[ProcessInfo]:
    """Live processes whose environment has ``FLWR_HOME`` = ``flwr_home`` (the same folder,
    symlinks resolved): the script exports it before starting anything, and Flower's
    SuperExec, ServerApp and ClientApp processes inherit it, so it names everything one
    deployment started."""
    home = os.path.realpath(flwr_home)
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        value = _environment(int(entry.name)).get("FLWR_HOME")
        if not value or os.path.realpath(value) != home:
            continue
        info = _read_process(int(entry.name))
        if info is not None:
            found.append(info)
    return sorted(found, key=lambda p: p.pid)


def process_group(pgid: int) -> list[ProcessInfo]:
    """The live members of the process group ``pgid`` (zombies are not)."""
    return sorted((p for p in live_processes().values() if p.pgid == pgid),
                  key=lambda p: p.pid)


def _is_serverapp(process: ProcessInfo) -> bool:
    """A ServerApp process (``flwr-serverapp``, run as a script or by its entry point)."""
    return any(Path(arg).name == "flwr-serverapp" for arg in process.argv[:2])


def _tied(live: dict[int, ProcessInfo], known: dict[int, int], gone: set[int],
          pgids: Collection[int]) -> dict[int, ProcessInfo]:
    """The live processes tied to ``known`` (pid -> start ticks: processes met before, alive
    or not) or to ``gone`` (pids of processes that exited): those themselves, the members of
    the process groups ``pgids``, and, transitively, the children of a tied process and the
    processes whose ``--parent-pid`` names a tied or gone one (a SuperNode's SuperExec is
    re-parented to PID 1 when the SuperNode exits first, and keeps that link)."""
    tied = {pid: info for pid, info in live.items()
            if known.get(pid) == info.start or info.pgid in pgids}
    dead = gone | {pid for pid, start in known.items()
                   if pid not in live or live[pid].start != start}
    grown = True
    while grown:
        grown = False
        for pid, info in live.items():
            if pid in tied or pid in known:  # (known, not tied: the pid was reused)
                continue
            if info.ppid in tied or (info.parent_pid_option in tied.keys() | dead):
                tied[pid] = info
                grown = True
    return tied


def terminate(pids: Iterable[int] = (), pgids: Collection[int] = (), grace_s: float = 10.0,
              kill_wait_s: float = 10.0) -> list[ProcessInfo]:
    """Stop the processes ``pids`` and the members of the process groups ``pgids``, with
    everything tied to them (:func:`_tied`: their descendants, and the Flower processes whose
    ``--parent-pid`` names one of them, also when that one has exited already), and WAIT
    until they are gone: SIGTERM, then SIGKILL to those still running after ``grace_s``, then
    at most ``kill_wait_s`` more. A process that appears meanwhile (a ClientApp started just
    before its SuperExec got the signal) is signalled in turn. Returns the processes still
    running at the end (empty: all gone; a zombie counts as gone)."""
    live = live_processes()
    known = {pid: live[pid].start for pid in pids if pid in live}
    gone = {pid for pid in pids if pid not in live}
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, kill_wait_s)):
        signalled: set[tuple[int, int]] = set()
        deadline = time.monotonic() + wait_s
        while True:
            tied = _tied(live, known, gone, pgids)
            if not tied:
                return []
            for pid, info in tied.items():
                known.setdefault(pid, info.start)
                if (pid, info.start) not in signalled:
                    signalled.add((pid, info.start))
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(pid, sig)
            if time.monotonic() >= deadline:
                break
            time.sleep(0.1)
            live = live_processes()
    return sorted(_tied(live_processes(), known, gone, pgids).values(), key=lambda p: p.pid)


def stop(pids: Sequence[int], flwr_home: str | None = None, grace_s: float = 10.0
         ) -> list[ProcessInfo]:
    """Stop the processes ``pids`` (the script's own children) with everything tied to them
    (:func:`terminate`), then, with ``flwr_home``, whatever still runs under it, and wait
    until all of it is gone. Returns what survived even SIGKILL (empty: nothing). With
    ``flwr_home``, a pid is taken only while its process carries that ``FLWR_HOME`` (the
    script exports it before starting anything): the pid of a process that exited long ago
    may name another one by now."""
    if flwr_home is not None:
        home = os.path.realpath(flwr_home)
        pids = [pid for pid in pids
                if os.path.realpath(_environment(pid).get("FLWR_HOME") or "/nonexistent") == home]
    left = terminate(pids, grace_s=grace_s)
    if flwr_home is not None:
        for _ in range(3):  # a straggler's own children are signalled with it
            stragglers = [p.pid for p in processes_under(flwr_home)]
            if not stragglers:
                break
            left = terminate(stragglers, grace_s=grace_s)
    return left


def supernode_processes(port: int = SUPERNODE_DEFAULT_PORT) -> list[ProcessInfo]:
    """This user's ``flower-supernode`` whose Runtime API port (``--port``) is ``port``, and
    the ``flower-superexec`` serving that port (``--runtime-api-address HOST:port``) whose
    ``--parent-pid`` is that SuperNode or a process that has exited (its SuperNode stopped
    before it), not another live process (a SuperLink's SuperExec)."""
    everything = live_processes()
    live = [info for info in everything.values() if info.uid == os.getuid()]
    nodes = []
    for info in live:
        if info.program == "flower-supernode":
            given = info.option("--port")
            if (int(given) if given and given.isdigit() else SUPERNODE_DEFAULT_PORT) == port:
                nodes.append(info)
    execs = [info for info in live if info.program == "flower-superexec"
             and (info.option("--runtime-api-address") or "").rpartition(":")[2] == str(port)
             and (info.parent_pid_option in {n.pid for n in nodes}
                  or info.parent_pid_option not in everything)]
    return sorted(nodes + execs, key=lambda p: p.pid)


def stop_supernode(port: int = SUPERNODE_DEFAULT_PORT, grace_s: float = 10.0
                   ) -> tuple[list[ProcessInfo], list[ProcessInfo]]:
    """Stop the SuperNode of Runtime API port ``port`` together with its SuperExec and their
    ClientApps, and wait until they are gone (:func:`terminate`). Returns (the processes
    found, those that survived SIGKILL)."""
    found = supernode_processes(port)
    return found, terminate([p.pid for p in found], grace_s=grace_s) if found else []


def _node_config(pid: int) -> str | None:
    """The ``--node-config`` of the SuperNode ``pid`` belongs to (itself or an ancestor)."""
    for _ in range(8):
        info = _read_process(pid)
        if info is None:
            return None
        if info.program == "flower-supernode":
            args = list(info.argv)
            return args[args.index("--node-config") + 1] if "--node-config" in args else ""
        pid = info.ppid
    return None


#: the programs whose memory :func:`watch` records: Flower's own processes
FLOWER_PROGRAMS = ("flower-superlink", "flower-supernode", "flower-superexec", "flwr-serverapp",
                   "flwr-clientapp")


@dataclass
class ProcessUsage:
    """What one process used: ``peak_rss_mb`` is the kernel's high-water mark of its
    resident pages (``VmHWM``, shared libraries included); ``peak_anon_mb`` the largest
    sampled ``RssAnon`` (its own heap: tensors, data, models), a lower bound of the true
    peak; ``cpu_s`` its user + system CPU time at the last sample (what it costs a core,
    whatever else the machine runs)."""

    pid: int
    program: str
    node_config: str | None
    peak_rss_mb: float
    peak_anon_mb: float
    cpu_s: float
    first_seen_s: float
    last_seen_s: float


_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def _usage(pid: int) -> tuple[float, float, float] | None:
    """(VmHWM MiB, RssAnon MiB, CPU seconds) of ``pid``, None when it is gone."""
    values = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in ("VmHWM", "RssAnon"):
                values[key] = int(rest.split()[0]) / 1024
        # fields 14 and 15 of stat (utime, stime), counted after the ")" closing the name
        utime, stime = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[11:13]
    except (OSError, ValueError, IndexError):
        return None
    if len(values) < 2:
        return None
    return values["VmHWM"], values["RssAnon"], (int(utime) + int(stime)) / _CLOCK_TICKS


def watch(flwr_home: str, out: Path, interval_s: float = 0.1) -> list[ProcessUsage]:
    """Sample the memory and CPU time of the Flower processes (:data:`FLOWER_PROGRAMS`)
    under ``flwr_home`` until SIGTERM/SIGINT, then write ``out``. ``VmHWM`` is the kernel's
    own high-water mark, so sampling misses at most the growth in a process's last
    ``interval_s`` (and CPU time its last ``interval_s``); ``RssAnon`` is sampled, so a spike
    shorter than ``interval_s`` can be missed."""
    stopping = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopping.append(True))
    seen: dict[int, ProcessUsage] = {}
    start = time.monotonic()
    while not stopping:
        now = time.monotonic() - start
        for info in processes_under(flwr_home):
            if info.program not in FLOWER_PROGRAMS:
                continue
            usage = _usage(info.pid)
            if usage is None:
                continue
            entry = seen.get(info.pid)
            if entry is None:
                entry = seen[info.pid] = ProcessUsage(info.pid, info.program,
                                                      _node_config(info.pid), *usage, now, now)
            entry.peak_rss_mb = max(entry.peak_rss_mb, usage[0])
            entry.peak_anon_mb = max(entry.peak_anon_mb, usage[1])
            entry.cpu_s, entry.last_seen_s = usage[2], now
        time.sleep(interval_s)
    entries = sorted(seen.values(), key=lambda p: p.pid)
    out.write_text(json.dumps({"interval_s": interval_s,
                               "processes": [asdict(p) for p in entries]}, indent=1))
    return entries


# ------------------------------------------------------------------------- results


def expected_clients(text: str) -> list[int]:
    """``--clients``: a count N (the clients 0..N-1) or the ids, comma-separated (a fleet
    after a device left: ``0,2,3``)."""
    try:
        ids = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--clients: a count or comma-separated client ids, got {text!r}") from None
    if not ids or min(ids) < 0 or len(set(ids)) != len(ids) or ("," not in text and ids[0] < 1):
        raise argparse.ArgumentTypeError(
            f"--clients: a count or distinct client ids >= 0, got {text!r}")
    return list(range(ids[0])) if "," not in text else sorted(ids)


def check_results(path: Path, clients: int | Sequence[int]) -> list[str]:
    """What is wrong with the run whose ``results.json`` is ``path`` (empty: nothing):
    it must be ``"status": "ok"``, have a test accuracy, and list exactly the expected
    clients (a count N: 0..N-1), each once. Each exclusion is listed with its node and client
    id, so the operator sees which device was missing and why."""
    expected = list(range(clients)) if isinstance(clients, int) else sorted(clients)
    if not path.is_file():
        return [f"the run wrote no {path}: see the logs above"]
    try:
        results = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        return [f"{path} is not JSON: {exc}"]
    if not isinstance(results, dict):
        return [f"{path} holds no results object"]
    excluded = [f"excluded {e.get('client')} in round {e.get('round')}: {e.get('reason')}"
                for e in results.get("excluded") or [] if isinstance(e, dict)]
    if results.get("status") != "ok":
        error = results.get("error", "status " + repr(results.get("status")))
        return [f"the run failed: {error}", *excluded]
    problems = []
    if not isinstance(results.get("test", {}).get("accuracy"), int | float):
        problems.append(f"{path} has no test accuracy")
    ids = sorted(c.get("client_id") for c in results.get("clients", []))
    if ids != expected:
        missing = sorted(set(expected) - set(ids))
        problems.append(f"the run's clients are {ids}, expected {expected}"
                        + (f" (missing {missing})" if missing else ""))
        problems += excluded
    return problems


def _summary(path: Path) -> str:
    results = json.loads(path.read_text())
    mb = sum(c.get("upload_mb", 0.0) for c in results["clients"])
    return (f"deploy-local: OK {results.get('strategy')}: test accuracy "
            f"{100 * results['test']['accuracy']:.2f}%, {len(results['clients'])} clients, "
            f"{mb:.2f} MB uploaded, excluded {len(results.get('excluded') or [])} "
            f"({path})")


# ------------------------------------------------------------------------- CLI


def _lines(items: Iterator[str] | Sequence[str]) -> None:
    for item in items:
        print(item)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python scripts/deploy_tools.py",
                                     description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("tls", help="CA + server certificate for H... and 127.0.0.1/localhost")
    p.add_argument("folder", type=Path)
    p.add_argument("--host", action="append", dest="hosts",
                   help="an IP address or DNS name the SuperLink is reached at (repeatable)")
    p.add_argument("--days", type=int, default=7, help="validity (default 7)")
    p = sub.add_parser("node-key", help="SuperNode EC key pairs (OpenSSH format)")
    p.add_argument("folder", type=Path)
    p.add_argument("names", nargs="+")
    p = sub.add_parser("free-ports", help="N distinct free ports on 127.0.0.1, one per line")
    p.add_argument("count", type=int)
    p = sub.add_parser("plan", help="shell assignments NUM_CLIENTS, RESULTS, RUN_CONFIG_ARGS")
    p.add_argument("run_config")
    p.add_argument("--num-clients", type=int, default=None)
    p.add_argument("--output-dir", type=Path, required=True)
    p.add_argument("--run-name", required=True)
    p = sub.add_parser("stop", help="stop PID... and what is tied to them; wait until gone")
    p.add_argument("pids", type=int, nargs="*")
    p.add_argument("--flwr-home", default=None, help="then what still runs under FLWR_HOME")
    p = sub.add_parser("stop-supernode",
                       help="stop a SuperNode, its SuperExec and ClientApps; wait until gone")
    p.add_argument("--port", type=int, default=SUPERNODE_DEFAULT_PORT,
                   help=f"the SuperNode's --port (default {SUPERNODE_DEFAULT_PORT})")
    p.add_argument("--grace", type=float, default=10.0,
                   help="seconds between SIGTERM and SIGKILL (default 10)")
    p = sub.add_parser("leftovers", help="live processes under FLWR_HOME; exit 1 if any")
    p.add_argument("flwr_home")
    p = sub.add_parser("serverapp-running",
                       help="exit 0 while a flwr-serverapp process runs under FLWR_HOME")
    p.add_argument("flwr_home")
    p = sub.add_parser("watch", help="memory and CPU of the Flower processes until SIGTERM")
    p.add_argument("flwr_home")
    p.add_argument("out", type=Path)
    p.add_argument("--interval", type=float, default=0.1)
    p = sub.add_parser("check", help="judge a run by its results.json")
    p.add_argument("results", type=Path)
    p.add_argument("--clients", type=expected_clients, required=True,
                   help="the clients the run must fuse: a count N (0..N-1) or ids, e.g. 0,2,3")
    args = parser.parse_args(argv)

    if args.command == "tls":
        # loopback always: the SuperLink's own ServerApp reaches it at 127.0.0.1 over TLS
        # (Flower turns a bind-all --host 0.0.0.0 into 127.0.0.1 for it)
        hosts = list(dict.fromkeys([*(args.hosts or []), *TLS_HOSTS]))
        files = write_tls_files(args.folder, hosts, args.days)
        _lines(str(p) for p in vars(files).values())
    elif args.command == "node-key":
        _lines(str(p) for name in args.names for p in write_node_key(args.folder, name))
    elif args.command == "free-ports":
        _lines(str(port) for port in free_ports(args.count))
    elif args.command == "plan":
        try:
            plan = plan_run(args.run_config, args.num_clients, args.output_dir, args.run_name)
        except ValueError as exc:
            print(f"deploy-local: {exc}", file=sys.stderr)
            return 2
        flags = " ".join(f"--run-config {shlex.quote(item)}" for item in plan.items)
        _lines([f"NUM_CLIENTS={plan.num_clients}", f"RESULTS={shlex.quote(str(plan.results))}",
                f"RUN_CONFIG_ARGS=({flags})"])
    elif args.command == "stop":
        left = stop(args.pids, args.flwr_home)
        for p in left:
            print(f"deploy-local: still running after SIGKILL: {p.pid} {' '.join(p.argv)}",
                  file=sys.stderr)
        return 1 if left else 0
    elif args.command == "stop-supernode":
        found, left = stop_supernode(args.port, args.grace)
        if not found:
            print(f"no SuperNode of port {args.port} runs (nor its SuperExec)")
        for p in found:
            if p.pid not in {q.pid for q in left}:
                print(f"stopped {p.program} (pid {p.pid})")
        for p in left:
            print(f"still running after SIGKILL: {p.pid} {' '.join(p.argv)}", file=sys.stderr)
        return 1 if left else 0
    elif args.command == "leftovers":
        left = processes_under(args.flwr_home)
        _lines(f"{p.pid} {' '.join(p.argv)}" for p in left)
        return 1 if left else 0
    elif args.command == "serverapp-running":
        return 0 if any(_is_serverapp(p) for p in processes_under(args.flwr_home)) else 1
    elif args.command == "watch":
        watch(args.flwr_home, args.out, args.interval)
    elif args.command == "check":
        problems = check_results(args.results, args.clients)
        for problem in problems:
            print(f"deploy-local: {problem}", file=sys.stderr)
        if problems:
            return 1
        print(_summary(args.results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
