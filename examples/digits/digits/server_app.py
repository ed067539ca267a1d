"""ServerApp: each strategy of ``strategies`` runs its own one-shot round on the same nodes,
then is evaluated on the held-out test set; results go to <output-dir>/<run-name>/."""

import json
from pathlib import Path

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from digits.task import model_fn, server_data
from fedfusion import evaluate
from fedfusion.strategies import AdaptiveModelSelection, FedAvg, FedBEns, RegMean

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    config = context.run_config
    clients, members, seed = int(config["num-clients"]), int(config["num-members"]), int(
        config["seed"])
    val, (x_test, y_test) = server_data(seed)
    net = model_fn(config)
    common = {"num_clients": clients, "num_members": members, "val": val, "seed": seed}
    make = {  # fedfusion glue: one line per strategy
        "fedavg": lambda: FedAvg(net, **common),
        "fedbens": lambda: FedBEns(net, hessian_structure="kron", **common),
        "regmean": lambda: RegMean(net, **common),
        "ams": lambda: AdaptiveModelSelection(net, **common),
    }
    results: dict = {"status": "running", "test": {}, "excluded": {}}
    folder = Path(str(config["output-dir"])) / str(config["run-name"])
    folder.mkdir(parents=True, exist_ok=True)
    for name in str(config["strategies"]).split(","):
        strategy = make[name]()
        strategy.start(grid)  # fedfusion glue
        results["test"][name] = evaluate(strategy.predictor, x_test, y_test)  # fedfusion glue
        results["excluded"][name] = strategy.exclusions
        print(f"{name}: test accuracy {results['test'][name]['accuracy']:.4f}", flush=True)
    results["status"] = "ok"
    (folder / "results.json").write_text(json.dumps(results, indent=1))
