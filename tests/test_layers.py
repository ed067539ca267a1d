"""The package's layers, checked from the source: imports point down and
never in a circle, the library stays free of the App, of Flower's private modules and of the
optional native code, and what ``start()`` returns is usable by any Flower code."""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import torch
from conftest import SmallCNN, label_skewed_fmnist, sgd_client_app

from fedfusion import LocalGrid
from fedfusion.app.config import Settings
from fedfusion.strategies import FedAvg, FedBEns, FusionResult
from fedfusion.wire import decode_models

PACKAGE = Path(__file__).resolve().parents[1] / "fedfusion"
#: the Flower App and what only it uses (data sets); everything else is the library
APP = ("fedfusion.app", "fedfusion.server_app", "fedfusion.client_app", "fedfusion.datasets")
ACCEL = "fedfusion.accel"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imports(name: str) -> list[tuple[str, bool]]:
    """(imported fedfusion module, at module level?) for every import in module ``name``,
    ``from a import b`` resolved to ``a.b`` where that is a module."""
    path = MODULES[name]
    tree = ast.parse(path.read_text())
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    top_level = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base
                       for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in MODULES:
                target = target.rpartition(".")[0]
            if target.startswith("fedfusion") and target not in (name, "fedfusion"):
                found.append((target, id(node) in top_level))
    return found


GRAPH = {name: {t for t, _ in imports(name)} for name in MODULES}


def cycles() -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in GRAPH:
        if v not in index:
            visit(v)
    return out


def test_the_checker_sees_the_imports_it_must():
    """A checker that finds nothing passes everything: it must see known edges."""
    assert "fedfusion.wire" in GRAPH["fedfusion.client"]
    assert "fedfusion.accel.kernels" in GRAPH["fedfusion.accel.stacked"]
    assert ("fedfusion.accel.stacked", False) in imports("fedfusion.training")  # lazy import
    assert "fedfusion.app.config" in GRAPH["fedfusion.server_app"]
    assert "fedfusion.strategies.alignment.graph" in GRAPH["fedfusion.strategies.pfnm"]
    assert "fedfusion.flower.train_config" in GRAPH["fedfusion.core.model_check"]


def test_no_import_cycles():
    assert cycles() == []


def test_the_library_never_imports_the_app():
    leaks = sorted((m, t) for m, targets in GRAPH.items() for t in targets
                   if not m.startswith(APP) and t.startswith(APP))
    assert leaks == []


#: the library modules below accel that it may use (the loss terms it refuses, the CUDA graphs
#: it shares with FedBEns' server, seeded RNGs)
ACCEL_USES = {"fedfusion.loss_terms", "fedfusion.cuda_graphs", "fedfusion.seeding"}


def test_native_code_is_imported_only_on_request():
    """Library modules reach fedfusion.accel only inside functions (when asked); accel
    itself depends on nothing above it."""
    eager = sorted((m, t) for m in MODULES if not m.startswith((ACCEL, *APP))
                   for t, top in imports(m) if top and t.startswith(f"{ACCEL}."))
    assert eager == []
    upward = sorted((m, t) for m in MODULES if m.startswith(ACCEL)
                    for t in GRAPH[m] if not t.startswith(ACCEL) and t not in ACCEL_USES)
    assert upward == []


#: the Flower adapter and what sits above it; the rest of the library is the base
FLOWER, STRATEGIES, CLIENT = "fedfusion.flower", "fedfusion.strategies", "fedfusion.client"
ABOVE_BASE = (FLOWER, STRATEGIES, CLIENT, *APP)
#: the plain train-config keys the core's model check reads from a client's config
TRAIN_CONFIG = "fedfusion.flower.train_config"
#: what every family may share, and the modules that see every family
SHARED_FAMILIES = {"alignment"}
ALL_FAMILIES = {STRATEGIES, f"{STRATEGIES}.requirements", f"{STRATEGIES}.predictors"}
#: one family building on another: (importer family, imported family) -> why
FAMILY_EDGES = {
    ("fedprox", "fedavg"): "FedProx is FedAvg with a proximal client term",
    ("swa", "fedavg"): "SWA is FedAvg with per-layer Gaussianity weights",
    ("ams", "ensemble"): "AMS is the uniform ensemble with a max-logit selector",
    ("fedfisher", "fedbens"): "FedFisher runs FedBEns' batched server optimiser",
    ("fens", "fedbens"): "FENS can aggregate FedBEns' modes (base='fedbens')",
}


def flwr_imports(source: str) -> list[str]:
    """The ``flwr`` modules ``source`` imports, at any level."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] == "flwr"]
        elif isinstance(node, ast.ImportFrom) and not node.level and \
                (node.module or "").split(".")[0] == "flwr":
            found.append(node.module or "")
    return found


def family(module: str) -> str | None:
    """The algorithm family of a module under ``fedfusion.strategies``: its first component
    there (``fedbens`` for ``fedfusion.strategies.fedbens.objective``)."""
    if not module.startswith(f"{STRATEGIES}."):
        return None
    return module[len(STRATEGIES) + 1:].split(".")[0]


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    """Every edge of ``graph`` that breaks the import rules of docs/architecture.md."""
    bad = []
    for m, targets in graph.items():
        for t in sorted(targets):
            if not m.startswith(ABOVE_BASE) and t.startswith(ABOVE_BASE) and t != TRAIN_CONFIG:
                bad.append(f"base module {m} imports {t}")
            if m.startswith(FLOWER) and t.startswith((STRATEGIES, CLIENT, *APP)):
                bad.append(f"Flower adapter {m} imports {t}")
            if m.startswith(STRATEGIES) and t.startswith((CLIENT, *APP)):
                bad.append(f"strategy module {m} imports {t}")
            src, dst = family(m), family(t)
            if src and dst and src != dst and m not in ALL_FAMILIES and \
                    dst not in SHARED_FAMILIES and (src, dst) not in FAMILY_EDGES:
                bad.append(f"family {src} ({m}) imports family {dst} ({t})")
    return bad


def test_core_and_curvature_import_no_flower():
    found = {name: flwr_imports(path.read_text()) for name, path in MODULES.items()
             if name.startswith(("fedfusion.core", "fedfusion.curvature"))}
    assert len(found) > 10  # the packages were found
    assert {name: mods for name, mods in found.items() if mods} == {}


def test_imports_point_down_and_families_stay_apart():
    assert layer_violations(GRAPH) == []


def test_the_layer_rules_see_a_bad_edge():
    """Each rule flags the edge it exists for, on the real graph plus one bad edge."""
    bad_edges = {
        ("fedfusion.core.fusion", "fedfusion.strategies.fedavg"): "base module",
        ("fedfusion.curvature.kron", "fedfusion.flower.strategy"): "base module",
        ("fedfusion.wire.decode", "fedfusion.client"): "base module",
        ("fedfusion.flower.sampling", "fedfusion.strategies.fedbens.strategy"):
            "Flower adapter",
        ("fedfusion.strategies.regmean", "fedfusion.app.config"): "strategy module",
        ("fedfusion.strategies.pfnm", "fedfusion.strategies.otfusion"): "family pfnm",
        ("fedfusion.strategies.fedbens.objective", "fedfusion.strategies.swa.strategy"):
            "family fedbens",
    }
    for (m, t), message in bad_edges.items():
        assert m in MODULES and t in MODULES, (m, t)
        graph = {**GRAPH, m: GRAPH[m] | {t}}
        assert [v for v in layer_violations(graph) if v.startswith(message)], (m, t)
    assert flwr_imports("def f():\n    from flwr.app import Message\n") == ["flwr.app"]
    assert flwr_imports("import flwr.serverapp as s\nimport flwrx\n") == ["flwr.serverapp"]
    assert layer_violations({"fedfusion.core.model_check": {TRAIN_CONFIG}}) == []


def test_no_private_flower_imports_or_attributes():
    bad = []
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("flwr"):
                module = node.module or ""
                if any(part.startswith("_") for part in module.split(".")) or \
                        module.endswith("strategy_utils") or \
                        any(a.name.startswith("_") for a in node.names):
                    bad.append(f"{name}: from {module} import ...")
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and \
                    not node.attr.startswith("__") and isinstance(node.value, ast.Name) and \
                    node.value.id in {"TaskIdentity", "Message", "Grid", "Strategy", "Result"}:
                bad.append(f"{name}: {node.value.id}.{node.attr}")
    assert bad == []


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_crossings(name: str, source: str, is_package: bool = False) -> list[str]:
    """Private names (``_x``) of another fedfusion module that module ``name`` uses: imported
    (``from fedfusion.m import _x``) or read as an attribute (``m._x``, ``fedfusion.m._x``)."""
    tree = ast.parse(source)
    package = name.split(".") if is_package else name.split(".")[:-1]
    aliases: dict[str, str] = {}  # local name -> the fedfusion module it is bound to
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            if not base.startswith("fedfusion") or base == name:
                continue
            for alias in node.names:
                if _private(alias.name):
                    found.append(f"{name}: from {base} import {alias.name}")
                if f"{base}.{alias.name}" in MODULES:
                    aliases[alias.asname or alias.name] = f"{base}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("fedfusion"):
                    local = alias.asname or alias.name.split(".")[0]
                    aliases[local] = alias.name if alias.asname else "fedfusion"
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and _private(node.attr)):
            continue
        chain, value = [], node.value
        while isinstance(value, ast.Attribute):
            chain.append(value.attr)
            value = value.value
        if isinstance(value, ast.Name) and value.id in aliases:
            target = ".".join([aliases[value.id], *reversed(chain)])
            if target in MODULES and target != name:
                found.append(f"{name}: {target}.{node.attr}")
    return found


def test_the_private_name_scan_sees_planted_uses():
    planted = ("from fedfusion.wire.validation import _hidden\n"
               "from ..wire import validation\n"
               "import fedfusion.wire.npy\n"
               "import fedfusion.wire.decode as decode\n"
               "validation._a, fedfusion.wire.npy._b, decode._c, decode.__name__, self._d\n")
    assert private_crossings("fedfusion.strategies.x", planted) == [
        "fedfusion.strategies.x: from fedfusion.wire.validation import _hidden",
        "fedfusion.strategies.x: fedfusion.wire.validation._a",
        "fedfusion.strategies.x: fedfusion.wire.npy._b",
        "fedfusion.strategies.x: fedfusion.wire.decode._c",
    ]


def test_no_private_name_crosses_a_module_boundary():
    found = [crossing for name, path in MODULES.items()
             for crossing in private_crossings(name, path.read_text(),
                                               path.name == "__init__.py")]
    assert found == []


def _error_messages(path: Path) -> list[str]:
    """The string parts of every ``raise X(...)`` in ``path``."""
    texts = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
            for sub in ast.walk(node.exc):
                if isinstance(sub, ast.Constant) and isinstance(sub.value, str):
                    texts.append(sub.value)
    return texts


def test_library_errors_do_not_speak_in_run_config_keys():
    """A library user passes constructor arguments; the App adds its run-config key to
    the message (app.config.build_strategy). Keys that are also wire names (the train
    config's ``model-kwargs``) are not the App's."""
    keys = {f.name.replace("_", "-") for f in dataclasses.fields(Settings) if "_" in f.name}
    wire = {"model-kwargs", "num-members"}
    found = []
    for name, path in MODULES.items():
        if name.startswith(APP):
            continue
        for text in _error_messages(path):
            found += [f"{name}: {key!r} in {text!r}" for key in keys - wire
                      if re.search(rf"(?<![\w-]){re.escape(key)}(?![\w-])", text)]
    assert found == []



def test_start_returns_a_result_flower_code_can_use():
    data = label_skewed_fmnist(150, 60, 100)
    app = sgd_client_app(SmallCNN, data)
    result = FedAvg(SmallCNN, num_clients=3).start(LocalGrid(app, num_nodes=3))
    assert isinstance(result, FusionResult)
    model = SmallCNN()
    model.load_state_dict(result.arrays.to_torch_state_dict())  # plain Flower use, strict
    x = data["test"][0][:16]
    with torch.no_grad():
        torch.testing.assert_close(torch.log_softmax(model(x), -1), result.predictor(x))

    result = FedBEns(SmallCNN, num_clients=3, num_members=2, steps=4, eval_every=2).start(
        LocalGrid(app, num_nodes=3))
    modes = decode_models(result.arrays)  # several models: the documented encoding
    assert len(modes) == len(result.predictor.members) == 4  # 2 x M clustered runs
    assert result.predictor is not None
