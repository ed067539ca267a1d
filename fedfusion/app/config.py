"""Run settings: one typed, validated view of Flower's run config, declared once.

Flower hands ServerApp and ClientApp a flat ``run_config`` mapping with kebab-case keys
(``[tool.flwr.app.config]`` in pyproject.toml, overridden by ``--run-config``). Both apps,
the replay CLI and the tests parse it through :meth:`Settings.from_mapping`, so a typo or a
wrong type fails the same way everywhere, with a message naming the key.

Each :class:`Settings` field declares its key once (:func:`fedfusion.app.knobs.knob`): type,
default, doc, valid range and roles. :data:`STRATEGY_KEYS`, :data:`DATA_KEYS`,
:data:`NODE_OVERRIDES` and :data:`PATH_KEYS` are read off those declarations.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import Field, dataclass, fields
from typing import Any

import torch

from fedfusion.app.knobs import (
    CLIENT_DEVICE,
    EVERY,
    HOLDOUT_FRACTION,
    SERVER_DEVICE,
    SERVER_THREADS,
    SHA256,
    SPLIT_SEED,
    Knob,
    knob,
)
from fedfusion.app.paths import output_name_error
from fedfusion.constraints import (
    AT_LEAST_ONE,
    FINITE_NON_NEGATIVE,
    FINITE_POSITIVE,
    MOMENTUM,
    NON_NEGATIVE,
    OFF_OR_AT_LEAST_ONE,
    SECONDS,
    SEED,
    THREADS,
    one_of,
)
from fedfusion.core.architecture import ModelSpec
from fedfusion.core.fusion import MEMBERS
from fedfusion.core.normalization import NORM_STATS
from fedfusion.curvature import STRUCTURES
from fedfusion.datasets import DATASETS, PARTITIONERS, ImageData
from fedfusion.distillation import DISTILL_EPOCHS
from fedfusion.flower.strategy import FusionStrategy
from fedfusion.reasons import brief, describe
from fedfusion.strategies.ams import CALIBRATIONS, TOP_K
from fedfusion.strategies.ensemble import SIZE
from fedfusion.strategies.fedbens.strategy import MODES, NUM_STARTS, PATIENCE, PREDICTIONS
from fedfusion.strategies.fens.strategy import FENS_HOLDOUT


class ConfigError(ValueError):
    """A run-config key is unknown, mistyped or out of range."""


#: run-config keys that name one folder directly inside ``output-dir`` (the run's outputs)
OUTPUT_NAME_KEYS = ("run-name",)


# the registries fill up when their packages are imported, after this module may be
def _strategies() -> Iterable[str]:
    from fedfusion.strategies import available_strategies

    return available_strategies()


def _models() -> Iterable[str]:
    from fedfusion.models import available_models

    return available_models()


def _distill_modes() -> Iterable[str]:
    from fedfusion.distillation import DISTILL_MODES

    return DISTILL_MODES


def _swa_distances() -> Iterable[str]:
    from fedfusion.strategies.swa import SWA_DISTANCES

    return SWA_DISTANCES


@dataclass(frozen=True)
class Settings:
    """Every knob of a fedfusion run. Field ``foo_bar`` is run-config key ``foo-bar``,
    declared there once (:func:`~fedfusion.app.knobs.knob`); the declarations' order is the
    docs' table's."""

    strategy: str = knob(
        "fedavg",
        doc="the fusion strategy ([strategies.md](strategies.md))",
        valid=("`fedavg` `ensemble` `fedbens` `fedfisher` `regmean` `fisher-merge` `otfusion` "
               "`dense` `co-boosting` `fens` `swa` `fedprox` `ams` `pfnm`"),
        check=one_of(_strategies))
    num_rounds: int = knob(
        1,
        doc="federated rounds; 1 = one-shot",
        valid=(">= 1; > 1 only for `fedavg`, `fedprox`, `swa`, `fedfisher`, `fisher-merge` (the "
               'others refuse it: "strategy ... is one-shot: set num-rounds=1")'),
        check=AT_LEAST_ONE)
    dataset: str = knob(
        "fmnist",
        doc="dataset",
        valid=("`fmnist` `mnist` `cifar10` `cifar100` `svhn` `digits` (scikit-learn's 8x8 digits "
               "as 64 int64 tokens 0..16, for `token_transformer`; 1,400 training rows, a fixed "
               "397-row test split; needs scikit-learn)"),
        check=one_of(DATASETS), data=True)
    data_dir: str = knob(
        "",
        doc=('folder with the dataset files; `""` = `FEDFUSION_DATA_DIR`, then the defaults (see '
             "[Data](configuration/data-and-models.md#data))"),
        valid='a path or `""` **[start]**',
        node=True, path=True)
    val_size: int = knob(
        500,
        doc="server validation holdout, removed from the training set before partitioning",
        valid=">= 0 and below the training-set size **[start]**",
        check=NON_NEGATIVE, data=True)
    train_subset: int = knob(
        0,
        doc="0 = the whole training pool; N = a seeded subset of N samples",
        valid=">= 0 (N above the pool size = the whole pool)",
        check=NON_NEGATIVE, data=True)
    partitioner: str = knob(
        "dirichlet",
        doc="how the pool is split among clients",
        valid=("`dirichlet` `flwr-dirichlet` `hetero-label` `iid` `fractions` (`flwr-dirichlet` "
               "needs the `flwr-datasets` package)"),
        check=one_of(PARTITIONERS), data=True)
    alpha: float = knob(
        0.1,
        doc="Dirichlet concentration (`dirichlet`, `flwr-dirichlet`)",
        valid="finite, > 0",
        check=FINITE_POSITIVE, data=True)
    labels_per_client: str = knob(
        "3,6",
        doc="`hetero-label`: each client holds k ~ U{lo..hi} labels",
        valid='`"lo,hi"` with 1 <= lo <= hi; hi <= number of classes **[start]**',
        data=True)
    fractions: str = knob(
        "",
        doc="`fractions`: relative part sizes, one per client",
        valid="comma list of `num-clients` positive numbers summing to 1 **[start]**",
        data=True)
    min_samples: int = knob(
        10,
        doc=("`dirichlet`/`flwr-dirichlet`: the least samples a client may get (redrawn "
             "otherwise)"),
        valid=">= 0; `num-clients` x `min-samples` <= pool size **[start]**",
        check=NON_NEGATIVE, data=True)
    num_clients: int = knob(
        5,
        doc=("number of clients; with `client-data='partition'` it must equal the number of "
             "SuperNodes; with `'local'` the number of devices a round waits for (all connected "
             "ones train)"),
        valid=">= 1",
        check=AT_LEAST_ONE, data=True)
    seed: int = knob(
        0,
        doc="decides holdout, partition, inits and batch order",
        valid="an integer in [0, 2**63)",
        check=SEED, data=True, strategy=((EVERY, "seed"),))
    split_seed: int = knob(
        -1,
        doc="-1 = `seed`; N pins holdout + partition while `seed` varies inits and batch order",
        valid="-1 or an integer in [0, 2**63)",
        check=SPLIT_SEED, data=True)
    partition_file: str = knob(
        "",
        doc=("bring-your-own partition: `.npz` / `.json` of per-client rows ([Bring your own "
             "partition](configuration/data-and-models.md#bring-your-own-partition)); "
             "replaces `partitioner`, `alpha`, `train-subset`"),
        valid='`""` or a valid file for `num-clients` clients **[start]**',
        node=True, path=True)
    partition_key: str = knob(
        "",
        doc="the group inside the partition file, e.g. `C5_a0.05`",
        valid='`""` or a key of the file **[start]**')
    partition_sha256: str = knob(
        "",
        doc="the partition file's expected SHA-256; filled in by the server, pinned in manifests",
        valid='`""` or 64 lowercase hex digits; must match the file **[start]**',
        check=SHA256, data=True)
    val_source: str = knob(
        "holdout",
        doc=("server validation rows: `holdout` = `val-size` rows no client holds; `file` = the "
             "partition file's `val` rows"),
        valid="`holdout` `file` (`file` needs `partition-file`)",
        check=one_of(("holdout", "file")), data=True)
    client_data: str = knob(
        "partition",
        doc=("where a client's training data come from: `partition` = rows `partition-id` of the "
             "split every process derives (simulations, demos); `local` = each device's own file "
             "`data-path` (real devices; the server holds no partition, devices join and leave "
             "between runs; [deploy/device.md](deploy/device.md#where-a-devices-data-lives))"),
        valid=("`partition` `local` (`local` excludes `partition-file` and "
               "`largest-client-first`)"),
        check=one_of(("partition", "local")), data=True)
    data_path: str = knob(
        "",
        doc=("`client-data='local'`: the device's `.npz` with `x` (uint8 images `[N,H,W]`, "
             "`[N,C,H,W]` or `[N,H,W,C]`) and `y` (labels); set per device in its node config"),
        valid="a readable `.npz` of the run dataset's image shape and classes **[client]**",
        node=True, path=True)
    input_mean: str = knob(
        "",
        doc='per-channel normalisation mean, e.g. `"0.1307"`; `""` = the training set\'s own',
        valid="one finite number per channel, set with `input-std`",
        data=True)
    input_std: str = knob(
        "",
        doc='per-channel normalisation std, e.g. `"0.3081"`',
        valid="one number > 0 per channel, set with `input-mean`",
        data=True)
    model: str = knob(
        "",
        doc=('`""` = `lenet` (1 channel) / `cnn` (3 channels); or `mlp`, `convnet`, `bn_cnn`, '
             "`resnet20`, `ln_mlp`, `vit`, `token_transformer` "
             "([Models](configuration/data-and-models.md#models))"),
        valid='`""` or a registered model',
        check=one_of(_models, allow_empty=True), data=True, node=True)
    model_kwargs: str = knob(
        "",
        doc='JSON keyword arguments of the model, e.g. `\'{"hidden_layers": 3}\'`',
        valid='`""` or a JSON object; its keys must suit the model **[start]**',
        data=True, node=True)
    num_members: int = knob(
        1,
        doc="M models per client, each from its own broadcast init",
        valid="1..64 (the most an upload carries)",
        check=MEMBERS, data=True, node=True, strategy=((EVERY, "num_members"),))
    init_perturbation: float = knob(
        0.0,
        doc=("0 = each member from its own seeded init; s > 0 = member m > 0 from member 0's init "
             "+ N(0, s^2) (a local ensemble around one init, paper Table 7: 0.001)"),
        valid=">= 0",
        check=FINITE_NON_NEGATIVE, strategy=((EVERY, "init_perturbation"),))
    local_epochs: int = knob(
        20,
        doc="local epochs per round",
        valid=">= 0",
        check=NON_NEGATIVE, data=True, node=True)
    lr: float = knob(
        0.01,
        doc="local SGD learning rate",
        valid="finite, > 0",
        check=FINITE_POSITIVE, data=True)
    momentum: float = knob(
        0.9,
        doc="local SGD momentum",
        valid="finite, in [0, 1)",
        check=MOMENTUM, data=True)
    batch_size: int = knob(
        64,
        doc="local batch size",
        valid=">= 1",
        check=AT_LEAST_ONE, data=True)
    client_threads: int = knob(
        1,
        doc="torch threads per client (one Ray actor per CPU)",
        valid="1..1024",
        check=THREADS, node=True)
    client_device: str = knob(
        "auto",
        doc=("where a client trains its members, fits curvature and builds its upload (FENS' "
             "aggregator rounds too): `auto` = CUDA when the client's process has a GPU (a "
             "simulation's `client-resources-num-gpus` share, a SuperNode's GPU), else the CPU; "
             "the data stays on the CPU and moves to the GPU once (up to 1 GiB) or a batch at a "
             "time; uploads are the same format; on a GPU `accelerate` trains the members as "
             "one vmapped computation (`fedfusion.accel.vmapped`) where the model has no "
             "buffers or dropout, else PyTorch's own loop member by member; "
             "`results.json` reports each client's `device`"),
        valid=("`auto` `cpu` `cuda` `cuda:<i>`; `cuda` on a process without a GPU fails that "
               "client's round with an error naming it **[client]**"),
        check=CLIENT_DEVICE, node=True)
    accelerate: bool = knob(
        True,
        doc=("the App's clients use `fedfusion.accel` (on the CPU the stacked trainer, its C "
             "kernels compiled with the system `cc`, and the compiled Kron fit; on a GPU the "
             "members trained as one vmapped computation) where they know the model, and "
             "PyTorch/laplace-torch elsewhere; `false` = PyTorch/laplace-torch only, "
             "the library's default ([library/acceleration.md](library/acceleration.md))"),
        valid="`true` / `false`",
        node=True)
    largest_client_first: bool = knob(
        False,
        doc=("simulations: node `p` trains the `p`-th largest client, so Flower's in-order "
             "dispatch starts the longest clients first on few CPUs "
             "(`fedfusion.app.federation.client_for_partition`); uploads keep their client ids"),
        valid=("`true` `false`; the deployment launcher refuses `true` (on SuperNodes "
               "`partition-id` names the node's own data)"),
        default_note="(`python -m fedfusion.app.launch` sets `true`)")
    hessian_structure: str = knob(
        "kron",
        doc=("curvature structure: K-FAC, diagonal, or diagonal + full last layer; also "
             "FedFisher's variant (`kron` or `diag`)"),
        valid="`kron` `diag` `diag_full` (`fedfisher` refuses `diag_full` **[start]**)",
        check=one_of(STRUCTURES),
        strategy=(("fedbens", "hessian_structure"), ("fedfisher", "hessian_structure")))
    temperature: float = knob(
        0.1,
        doc="posterior precision = H / `temperature` + I / `prior-var` (server side)",
        valid="finite, > 0",
        check=FINITE_POSITIVE, strategy=(("fedbens", "temperature"),))
    prior_var: float = knob(
        0.1,
        doc="Gaussian prior N(0, `prior-var` I)",
        valid="finite, > 0",
        check=FINITE_POSITIVE, strategy=(("fedbens", "prior_var"),))
    curvature_backend: str = knob(
        "",
        doc=('laplace-torch backend of the fit; `""` = the measured default `asdl_mc` (see '
             "`fedfusion/curvature/fit.py`)"),
        valid=('`""` or `<curvlinops\\|asdl\\|backpack>_<ggn\\|mc\\|ef>` **[client]** (after '
               "local training)"))
    curvature_batch_size: int = knob(
        256,
        doc="batch size of the curvature fit",
        valid=">= 1",
        check=AT_LEAST_ONE)
    curvature_rank: int = knob(
        0,
        doc="kron upload: keep the top-r eigenpairs per factor (0 = all)",
        valid=">= 0",
        check=NON_NEGATIVE)
    curvature_half: bool = knob(
        False,
        doc="kron upload: eigenvectors in float16",
        valid="`true` / `false`")
    extra_sections: str = knob(
        "",
        doc=("more upload sections than the strategy needs, computed in the same client pass so "
             "one run feeds other strategies on replay, e.g. "
             '`"curvature.diag,curvature.diag_full"`'),
        valid=("comma list of `weights` `curvature.kron` `curvature.diag` `curvature.diag_full` "
               "`gram` **[client]** (an unknown or failing one is left out with a warning)"))
    server_device: str = knob(
        "auto",
        doc="device of fusion and evaluation: `auto` = CUDA when present",
        valid="`auto` `cpu` `cuda` `cuda:<i>`",
        check=SERVER_DEVICE)
    server_threads: int = knob(
        0,
        doc=("torch CPU threads of the server; 0 = torch's default (all cores); 1 when other "
             "processes share the cores"),
        valid="0..1024",
        check=SERVER_THREADS)
    eval_batch_size: int = knob(
        2000,
        doc="batch size of the server's evaluation",
        valid=">= 1",
        check=AT_LEAST_ONE)
    server_validation: bool = knob(
        True,
        doc=("use the held-out validation set for model selection (FedBEns, FedFisher, RegMean, "
             "OTFusion activations, DENSE)"),
        valid="`true` / `false` (no effect with `val-size=0`)")
    server_cuda_graphs: bool = knob(
        True,
        doc=("FedBEns on a CUDA device: each Adam step replayed as one captured CUDA graph (the "
             "same kernels without their launch cost; `false` = eager steps; a failed capture "
             "falls back to them by itself)"),
        valid="`true` / `false` (no effect on the CPU)",
        strategy=(("fedbens", "cuda_graphs"),))
    round_timeout: float = knob(
        3600.0,
        doc=("seconds the server waits for a round's replies; a node that has not replied by then "
             'is excluded with "no reply within N s" and the round fuses the others (constructor '
             "argument `round_timeout`). The default is 1.5x the slowest honest round measured "
             "here (2,346 s: the leaderboard's live cell, C = 5, M = 5, 20 epochs on two loaded "
             "cores; the default job's round takes about 60 s): lower it to your clients' round "
             "time x 2 so a silent device costs less"),
        valid="> 0",
        check=SECONDS, strategy=((EVERY, "round_timeout"),))
    node_wait_timeout: float = knob(
        600.0,
        doc=("seconds a round waits, before sending anything, for `num-clients` SuperNodes to "
             "connect (`round-timeout` starts only after that); fewer by then fail the run with "
             '"N node(s) connected of the M required within T s" (constructor argument '
             "`node_wait_timeout`, raising `fedfusion.flower.sampling.NodeWaitTimeout`)"),
        valid="> 0 (`inf` waits forever, as Flower's own strategies do)",
        check=SECONDS, strategy=((EVERY, "node_wait_timeout"),))
    client_registry: str = knob(
        "",
        doc=('who is which client: `""` = the server keeps its own registry (a node\'s claimed '
             "client id is honoured while no other node owns it; a colliding node is fused under "
             "a fresh server-assigned id from 2**30, its claim kept as `claimed_client_id`); a "
             'path = a JSON file `{"<node id>": <client id>}` read by the server, enforced: each '
             "node is fused under its registered id whatever it claims, a node not in it is not "
             "sent the round, is excluded and does not count towards the nodes a round waits "
             "for ([library.md, Client "
             "identity](library.md#client-identity); constructor argument `client_registry`)"),
        valid=('`""` or a readable JSON object of at most 16 MiB (a regular file), node ids '
               "0..2**64-1, client ids 0..2**31-1, no client id twice, at least `num-clients` "
               "nodes **[start]**"),
        path=True)
    min_valid_uploads: int = knob(
        1,
        doc=("fewer valid uploads than this fail the run with every exclusion listed (the "
             "uploads received are still saved, for a replay); otherwise the server fuses what "
             "it has"),
        valid=">= 1",
        check=AT_LEAST_ONE, strategy=((EVERY, "min_valid_uploads"),))
    member_fusion: str = knob(
        "",
        doc=('which members a strategy fuses: `""` = the strategy\'s default; `first` = member 0 '
             "of each client (default of the single-model baselines: FedAvg, RegMean, FedFisher, "
             "Fisher merging, OTFusion, PFNM, DENSE, SWA, FedProx); `each` = every member index "
             "separately, ensembled (single-model strategies); `all` = every member (default of "
             "FedBEns and the ensembles)"),
        valid='`""`, `first`, `each`, `all`',
        check=one_of(("first", "each", "all"), allow_empty=True))
    norm_stats: str = knob(
        "auto",
        doc=("BatchNorm running statistics of the fused model(s): `average` = the sample-weighted "
             "average of the clients'; `recalibrate` = re-estimated on the server's validation "
             "rows; `client` = each client's own (ensemble, AMS, which keep client models); "
             "`auto` = `client` for those, else the strategy's measured default with validation "
             "rows, else `average` ([the rule per strategy](library/models.md))"),
        valid="`auto`, `average`, `recalibrate`, `client`",
        check=one_of(NORM_STATS), strategy=((EVERY, "norm_stats"),))
    screen_factor: float = knob(
        10.0,
        doc=("robust aggregation: a client whose `weights` hold a layer (any float entry) with an "
             "L2 norm above this x the median over clients of that layer's norm (and an RMS above "
             "this x the network's typical entry RMS) is excluded, the "
             "layer, norm, ratio and median in the reason; needs at least 3 clients sharing the "
             "layer (fewer: nothing is excluded and `results.json` `screening.notes` says so) "
             "([library/robust-aggregation.md](library/robust-aggregation.md); constructor "
             "argument `screen_factor`)"),
        valid="`0` (off) or >= 1",
        check=OFF_OR_AT_LEAST_ONE, strategy=((EVERY, "screen_factor"),))
    curvature_screen_factor: float = knob(
        1000.0,
        doc=("robust aggregation: a client whose curvature or Gram section (those the strategy "
             "fuses: FedBEns, FedFisher, Fisher merging, RegMean) holds a layer whose trace per "
             "example (of its capped count) is above this x the median over clients is excluded, "
             "the section, layer, value, ratio and median in the reason; needs at least 3 clients "
             "whose trace is above the floor, 1e-6 per diagonal entry "
             "([library/robust-aggregation.md](library/robust-aggregation.md); constructor "
             "argument `curvature_screen_factor`)"),
        valid="`0` (off) or >= 1",
        check=OFF_OR_AT_LEAST_ONE, strategy=((EVERY, "curvature_screen_factor"),))
    val_screen: bool = knob(
        True,
        doc=("robust aggregation: every member of every upload predicts the server's validation "
             "rows; a client with a member whose accuracy is below what its own predicted-class "
             "rates score by chance (by 3 standard errors, at least 0.02) is excluded before "
             "fusion, the member and both accuracies in the reason (a negated or permuted last "
             "layer; [library/robust-aggregation.md](library/robust-aggregation.md); constructor "
             "argument `val_screen`)"),
        valid="`true` / `false` (no effect without validation rows)",
        strategy=((EVERY, "val_screen"),))
    num_examples_cap: float = knob(
        3.0,
        doc=("robust aggregation: every strategy weights a client by at most this x the median of "
             "the other clients' claimed `num-examples`; each capped claim is in `results.json` "
             "`capped_claims` (and `num_examples_weighted` of its `clients` row, whose "
             "`num_examples` stays the claim) and the summary (constructor argument "
             "`num_examples_cap`)"),
        valid="`0` (trust the claims) or >= 1",
        check=OFF_OR_AT_LEAST_ONE, strategy=((EVERY, "num_examples_cap"),))
    distill: str = knob(
        "none",
        doc=("one network out of any fused predictor ([strategies/distill.md]"
             "(strategies/distill.md); constructor "
             "argument `distill`): `val` = the fused predictor (the teacher, kept in "
             "`results.json` `distill`) is distilled into one network of the run's `model` on the "
             "server's validation inputs, augmented (labels pick the best epoch only); "
             "`synthetic` = on DENSE's generator's images, no data; the student starts from the "
             "best-validated of the FedAvg of the clients' first members and the teacher's "
             "networks"),
        valid="`none` `val` (needs `server-validation=true`, validation rows) `synthetic`",
        check=one_of(_distill_modes), strategy=((EVERY, "distill"),))
    distill_epochs: int = knob(
        30,
        doc=("distill: passes over the validation inputs (`synthetic`: as many student steps); "
             "the best epoch on validation accuracy is kept, the start included (0 = the FedAvg "
             "start)"),
        valid=">= 0",
        check=DISTILL_EPOCHS, strategy=((EVERY, "distill_epochs"),))
    distill_lr: float = knob(
        0.001,
        doc="distill: Adam learning rate of the student",
        valid="> 0",
        check=FINITE_POSITIVE, strategy=((EVERY, "distill_lr"),))
    distill_temperature: float = knob(
        1.0,
        doc=("distill: T of the loss T^2 KL(softmax(log p_teacher / T) \\|\\| softmax(student / "
             "T))"),
        valid="> 0",
        check=FINITE_POSITIVE, strategy=((EVERY, "distill_temperature"),))
    distill_augment: bool = knob(
        True,
        doc=("`distill=val`: random shifts of images by up to min(H, W) // 8 pixels and mixup of "
             "half of each batch, the teacher queried on the augmented inputs"),
        valid="`true` / `false`",
        strategy=((EVERY, "distill_augment"),))
    server_steps: int = knob(
        300,
        doc="Adam steps per mode, with a validation set",
        valid=">= 0",
        check=NON_NEGATIVE, strategy=(("fedbens", "steps"),))
    server_steps_noval: int = knob(
        100,
        doc="steps without a server validation set (paper App. C.4)",
        valid=">= 0",
        check=NON_NEGATIVE, strategy=(("fedbens", "steps_noval"),))
    server_lr: float = knob(
        0.001,
        doc="Adam learning rate (the reference code's effective one)",
        valid="finite, > 0",
        check=FINITE_POSITIVE, strategy=(("fedbens", "lr"),))
    server_clip: float = knob(
        1.0,
        doc="gradient-norm clip per mode",
        valid="finite, > 0",
        check=FINITE_POSITIVE, strategy=(("fedbens", "clip"),))
    server_eval_every: int = knob(
        30,
        doc="model selection interval (validation or objective)",
        valid=">= 1",
        check=AT_LEAST_ONE, strategy=(("fedbens", "eval_every"),))
    server_patience: int = knob(
        4,
        doc=("FedBEns: a run stops (keeping its best iterate, leaving the batch) once its score "
             "has not improved in this many evaluations (0 = every run takes every step, the "
             "paper's schedule); see "
             "[benchmarks](../benchmarks/docs/starts.md)"),
        valid=">= 0",
        check=PATIENCE, strategy=(("fedbens", "patience"),))
    mixture_prune_margin: float = knob(
        50.0,
        doc=("skip members more than this many nats below their client's best (weight < e^-50) "
             "between refreshes"),
        valid="> 0; <= 0 turns pruning off (every member at every step)",
        strategy=(("fedbens", "prune_margin"),))
    mixture_refresh_every: int = knob(
        10,
        doc="steps between full re-evaluations of all members",
        valid=">= 1",
        check=AT_LEAST_ONE, strategy=(("fedbens", "refresh_every"),))
    fedbens_starts: str = knob(
        "auto",
        doc=("FedBEns runs: `median` = the paper's M runs from per-member medians; `mean` = M "
             "runs from per-member sample-weighted averages (better for BatchNorm networks, "
             "[strategies.md](strategies.md)); `auto` = `mean` for a model with BatchNorm running "
             "statistics, else `clustered`; `members` = one run from every uploaded member (C x M "
             "runs and modes); `clustered` = `fedbens-num-starts` runs from the weighted "
             "K-medoids of the members in parameter space ([strategies.md](strategies.md))"),
        valid="`auto` `median` `mean` `members` `clustered` **[start]**",
        strategy=(("fedbens", "starts"),))
    fedbens_num_starts: int = knob(
        0,
        doc=("FedBEns with `fedbens-starts=clustered`: the number of runs K (0 = 2 x the most "
             "members a client uploaded)"),
        valid="0..10000",
        check=NUM_STARTS, strategy=(("fedbens", "num_starts"),))
    fedbens_modes: int = knob(
        0,
        doc=("FedBEns: keep the first N runs (their modes form the ensemble); 0 = all; 1 = one "
             "model (paper Table 7)"),
        valid="0..10000",
        check=MODES, strategy=(("fedbens", "modes"),))
    fedbens_prediction: str = knob(
        "selected",
        doc=("FedBEns: what predicts. `modes` = the ensemble of the modes (the paper's); "
             "`selected` = as many networks as modes, picked from the modes and the uploaded "
             "members by greedy ensemble selection on the validation set (the modes without one; "
             "[strategies.md](strategies.md))"),
        valid="`selected` `modes`",
        check=one_of(PREDICTIONS), strategy=(("fedbens", "prediction"),))
    fedfisher_steps: int = knob(
        2000,
        doc="FedFisher (kron or diag, from `hessian-structure`): optimisation steps",
        valid=">= 0 **[start]**",
        strategy=(("fedfisher", "steps"),))
    fedfisher_lr: float = knob(
        0.01,
        doc="FedFisher: Adam learning rate",
        valid="finite, > 0 **[start]**",
        strategy=(("fedfisher", "lr"),))
    fedfisher_eval_every: int = knob(
        100,
        doc="FedFisher: model selection interval",
        valid=">= 1 **[start]**",
        strategy=(("fedfisher", "eval_every"),))
    regmean_alpha: str = knob(
        "0.1,0.5,0.9",
        doc="RegMean off-diagonal scale; several = chosen on validation (without one: the last)",
        valid="comma list of values in [0, 1] **[start]**",
        strategy=(("regmean", "alphas"),))
    otfusion_mode: str = knob(
        "weights",
        doc="OTFusion alignment: incoming weights, or activations on validation inputs",
        valid="`weights` `activations` **[start]**",
        strategy=(("otfusion", "mode"),))
    dense_epochs: int = knob(
        200,
        doc="DENSE: generator/distillation iterations",
        valid=">= 0 **[start]**",
        strategy=(("dense", "epochs"), ("co-boosting", "epochs")))
    dense_batch_size: int = knob(
        256,
        doc="DENSE: synthetic batch size",
        valid="2..65536 **[start]**",
        strategy=(("dense", "batch_size"), ("co-boosting", "batch_size")))
    dense_latent_dim: int = knob(
        256,
        doc="DENSE: generator noise dimension",
        valid="1..65536 **[start]**",
        strategy=(("dense", "latent_dim"), ("co-boosting", "latent_dim")))
    dense_g_lr: float = knob(
        0.001,
        doc="DENSE: generator learning rate",
        valid="finite, > 0 **[start]**",
        strategy=(("dense", "g_lr"), ("co-boosting", "g_lr")))
    dense_s_lr: float = knob(
        0.01,
        doc="DENSE: student learning rate",
        valid="finite, > 0 **[start]**",
        strategy=(("dense", "s_lr"), ("co-boosting", "s_lr")))
    dense_g_steps: int = knob(
        1,
        doc="DENSE: generator steps per iteration",
        valid=">= 0 **[start]**",
        strategy=(("dense", "g_steps"), ("co-boosting", "g_steps")))
    dense_s_steps: int = knob(
        5,
        doc="DENSE: student steps per iteration",
        valid=">= 0 **[start]**",
        strategy=(("dense", "s_steps"), ("co-boosting", "s_steps")))
    dense_adv_weight: float = knob(
        1.0,
        doc="DENSE: adversarial (teacher-student disagreement) loss weight",
        valid="finite, >= 0 **[start]**",
        strategy=(("dense", "adv_weight"), ("co-boosting", "adv_weight")))
    dense_act_weight: float = knob(
        0.1,
        doc="DENSE: weight of the statistics term (replaces the BN loss)",
        valid="finite, >= 0 **[start]**",
        strategy=(("dense", "act_weight"), ("co-boosting", "act_weight")))
    co_boosting_epsilon: float = knob(
        0.03,
        doc=("Co-Boosting: step of the hard-sample perturbation, in normalised input units (the "
             "authors' 8/255); the generator and the student take the `dense-*` keys above"),
        valid=">= 0 **[start]**",
        strategy=(("co-boosting", "epsilon"),))
    co_boosting_perturb_steps: int = knob(
        1,
        doc="Co-Boosting: signed-gradient steps per hard batch (0 = no perturbation)",
        valid=">= 0 **[start]**",
        strategy=(("co-boosting", "perturb_steps"),))
    co_boosting_perturbation: str = knob(
        "ods",
        doc=("Co-Boosting: what the perturbation ascends: `ods` = a random direction of the "
             "ensemble's output (the authors'), `kl` = the student-ensemble KL"),
        valid="`ods` `kl` **[start]**",
        strategy=(("co-boosting", "perturbation"),))
    co_boosting_hardness: float = knob(
        1.0,
        doc=("Co-Boosting: beta of the generator's hard-sample loss (1 - p_y)^beta CE (0 = "
             "DENSE's CE)"),
        valid=">= 0 **[start]**",
        strategy=(("co-boosting", "hardness"),))
    co_boosting_weight_lr: float = knob(
        0.01,
        doc="Co-Boosting: signed step mu of the ensemble weights",
        valid=">= 0 **[start]**",
        strategy=(("co-boosting", "weight_lr"),))
    co_boosting_weight_decay: float = knob(
        0.99,
        doc="Co-Boosting: the step at iteration t is mu * decay^t",
        valid=">= 0 **[start]**",
        strategy=(("co-boosting", "weight_decay"),))
    co_boosting_weight_steps: int = knob(
        1,
        doc="Co-Boosting: weight steps per iteration (0 = the uniform logit ensemble)",
        valid=">= 0 **[start]**",
        strategy=(("co-boosting", "weight_steps"),))
    co_boosting_weight_selection: str = knob(
        "validation",
        doc=("Co-Boosting: `validation` keeps a weight step only if the weighted teacher's NLL "
             "on the server's validation set does not rise; `none` keeps every step (the "
             "authors')"),
        valid="`validation` `none` **[start]**",
        strategy=(("co-boosting", "weight_selection"),))
    holdout_fraction: float = knob(
        0.0,
        doc=("fraction of each client's rows kept out of local training, for strategies trained "
             "on them afterwards (FENS' aggregator); `0` = FENS' 0.1 for `fens`, none otherwise; "
             "recorded resolved in results.json and the upload manifest (a replay adopts it)"),
        valid="in [0, 1)",
        check=HOLDOUT_FRACTION, data=True)
    fens_hidden: int = knob(
        0,
        doc=("FENS: width of the aggregator's shallow network over the concatenated outputs (`0` "
             "= the per-model class weights alone)"),
        valid="0..65536 **[start]**",
        strategy=(("fens", "hidden"),))
    fens_rounds: int = knob(
        100,
        doc="FENS: at most this many aggregator rounds after the upload round",
        valid=">= 0 **[start]**",
        strategy=(("fens", "rounds"),))
    fens_patience: int = knob(
        10,
        doc=("FENS: stop once the validation score has not improved in this many rounds (`0` = "
             "never; without a validation set every round runs)"),
        valid=">= 0 **[start]**",
        strategy=(("fens", "patience"),))
    fens_server_optimizer: str = knob(
        "fedadam",
        doc=("FENS: the server's step on the aggregator: `fedadam` (FENS' own, `fens-server-lr`) "
             "or `fedavg` (g + the clients' mean update)"),
        valid="`fedadam` `fedavg` **[start]**",
        strategy=(("fens", "server_optimizer"),))
    fens_server_lr: float = knob(
        0.05,
        doc="FENS: FedAdam's step size",
        valid="> 0 **[start]**",
        strategy=(("fens", "server_lr"),))
    fens_local_epochs: int = knob(
        1,
        doc="FENS: each client's SGD passes over its held-out rows per round",
        valid=">= 1 **[start]**",
        strategy=(("fens", "local_epochs"),))
    fens_lr: float = knob(
        0.1,
        doc="FENS: the clients' SGD learning rate (momentum 0.9)",
        valid="> 0 **[start]**",
        strategy=(("fens", "local_lr"),))
    fens_batch_size: int = knob(
        64,
        doc="FENS: the clients' SGD batch size",
        valid=">= 1 **[start]**",
        strategy=(("fens", "local_batch_size"),))
    fens_base: str = knob(
        "members",
        doc=("FENS: what the aggregator combines: every uploaded member, or FedBEns' modes of the "
             "same uploads (`fedbens`: its default server, the clients upload its curvature)"),
        valid="`members` `fedbens` **[start]**",
        strategy=(("fens", "base"),))
    swa_distance: str = knob(
        "hos",
        doc=("SWA: Gaussianity distance; `uniform` = no statistic: plain average (FedAvg with "
             "size weighting)"),
        valid="`hos` `renyi0` `renyi0.5` `renyi1` `renyi2` `uniform`",
        check=one_of(_swa_distances), strategy=(("swa", "distance"),))
    swa_size_weighting: bool = knob(
        False,
        doc="SWA: multiply each client's layer weights by its example count",
        valid="`true` / `false`",
        strategy=(("swa", "size_weighting"),))
    swa_score_cap: float = knob(
        3.0,
        doc=("SWA: cap each client's Gaussianity distance of a layer at this x the other "
             "clients' median (not in the paper: without size weighting one client's share "
             "of a layer is at most k / (k + C - 1) of C similar clients)"),
        valid="`0` (the paper's rule: no cap) or >= 1",
        check=OFF_OR_AT_LEAST_ONE, strategy=(("swa", "score_cap"),))
    prox_mu: float = knob(
        0.01,
        doc="FedProx: proximal term mu/2 \\|\\|w - w_global\\|\\|^2 (sent to the clients)",
        valid="finite, >= 0 (0 = FedAvg exactly)",
        check=FINITE_NON_NEGATIVE, strategy=(("fedprox", "prox_mu"),))
    contrastive_weight: float = knob(
        0.0,
        doc="MOON-style model-contrastive loss weight, any strategy (0 = off)",
        valid="finite, >= 0",
        check=FINITE_NON_NEGATIVE)
    contrastive_temperature: float = knob(
        0.5,
        doc="its temperature tau",
        valid="finite, > 0",
        check=FINITE_POSITIVE)
    ensemble_size: int = knob(
        0,
        doc=("Uniform ensemble: K, the members a prediction runs (0 = every member): the K that "
             "greedy ensemble selection picks on the validation set, or without one member 0 of "
             "every client first, then member 1, ..."),
        valid=">= 0",
        check=SIZE, strategy=(("ensemble", "size"),))
    ams_top_k: int = knob(
        1,
        doc=("AMS: 1 = AMS-top1 (highest max-logit model), k = sum of the top-k models' logits, 0 "
             "= all (AMS-full)"),
        valid=">= 0 (k above the number of models = all)",
        check=TOP_K, strategy=(("ams", "top_k"),))
    ams_calibration: str = knob(
        "none",
        doc=("AMS: `none` = the paper's raw max-logit; `temperature` = each model's logits "
             "divided by its temperature fitted on the validation set, selected by calibrated "
             "top probability (immune to a client scaling or shifting its logits; without a "
             "validation set, `none`)"),
        valid="`none` `temperature`",
        check=one_of(CALIBRATIONS), strategy=(("ams", "calibration"),))
    pfnm_sigma: float = knob(
        1.0,
        doc="PFNM: variance sigma^2 of local neurons around their global neuron",
        valid="finite, > 0",
        check=FINITE_POSITIVE, strategy=(("pfnm", "sigma"),))
    pfnm_sigma0: float = knob(
        1.0,
        doc="PFNM: prior variance sigma0^2 of a global neuron",
        valid="finite, > 0",
        check=FINITE_POSITIVE, strategy=(("pfnm", "sigma0"),))
    pfnm_gamma: float = knob(
        1.0,
        doc="PFNM: Beta-Bernoulli process mass gamma0 (larger = more new neurons)",
        valid="finite, > 0",
        check=FINITE_POSITIVE, strategy=(("pfnm", "gamma"),))
    pfnm_iters: int = knob(
        5,
        doc="PFNM: passes of re-matching every client after the greedy start",
        valid=">= 0",
        check=NON_NEGATIVE, strategy=(("pfnm", "iters"),))
    client_models: str = knob(
        "",
        doc=('per-client architectures, a JSON list with one entry per client: `\'[{"model": '
             '"mlp", "model-kwargs": {"hidden_layers": 1}}, ...]\'` (`{}` = the run\'s model); a '
             "node config's `model`/`model-kwargs` wins"),
        valid=('`""` or a JSON list of exactly `num-clients` objects with keys `model` (a '
               "registered model) and/or `model-kwargs` (a JSON object)"),
        data=True)
    output_dir: str = knob(
        "",
        doc='`""` = `~/fedfusion-outputs` (the launcher: `outputs/` of the app folder)',
        valid="a path (no NUL byte; nor in any path key)",
        path=True)
    run_name: str = knob(
        "",
        doc=('`""` = `<time>-<strategy>-<dataset>-<partitioner><alpha>-s<seed>` (+ `-replay`; the '
             "launcher: `<time>-<pid>`), with `-2`, `-3`, ... when a run of the same second "
             "took it"),
        valid=("one folder name directly inside `output-dir` (letters, digits, `.`, `-`, `_`, "
               "e.g. `table1-C5_a0.1-s0-fedavg`); refused with a ConfigError naming the key when "
               "absolute, holding `..`, a NUL byte or a separator (`/`, `\\`), `.`, or a drive; a "
               "run folder that is a symlink is refused at run time (OSError)"),
        path=True)
    save_uploads: bool = knob(
        True,
        doc="keep the clients' uploads of a one-shot run for replay (`<run>/uploads/`)",
        valid="`true` / `false` (multi-round runs never save them)")
    replay: str = knob(
        "",
        doc="folder of cached uploads: fuse them without training clients",
        valid='`""` or an upload folder (with `manifest.json`)',
        path=True)
    replay_clients: str = knob(
        "",
        doc='replay only these client ids, e.g. `"0,2,3"` (`""` = all)',
        valid="comma list of ints; each must be in the uploads")
    replay_members: int = knob(
        0,
        doc="replay only each client's first M members (0 = all)",
        valid=">= 0",
        check=NON_NEGATIVE)
    replay_client_members: str = knob(
        "",
        doc=('replay: members kept per client id, e.g. `"1,1,1,3,3"` (system heterogeneity from '
             'one run); `""` = all'),
        valid="comma list of counts >= 1, one per client id")


    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> Settings:
        """Parse a run-config mapping; reject unknown keys and wrong types by name."""
        known = {f.name.replace("_", "-"): f for f in fields(cls)}
        kwargs: dict[str, Any] = {}
        for key, value in values.items():
            if key not in known:
                close = [k for k in known if k.split("-")[0] == key.split("-")[0]]
                hint = f" (did you mean {', '.join(close)}?)" if close else ""
                raise ConfigError(f"unknown run-config key {key!r}{hint}")
            kwargs[known[key].name] = _coerce(key, value, known[key].type)
        settings = cls(**kwargs)
        settings.validate()
        return settings

    def to_mapping(self) -> dict[str, Any]:
        """The run-config mapping that reproduces these settings."""
        return {
            f.name.replace("_", "-"): getattr(self, f.name)
            for f in fields(self)
        }

    def replace(self, **changes: Any) -> Settings:
        settings = dataclasses.replace(self, **changes)
        settings.validate()
        return settings

    def validate(self) -> None:
        """Every key's declared rule (:class:`~fedfusion.app.knobs.Knob`), then the rules
        between keys and those of the keys' string forms; ConfigError naming the key."""
        for f in fields(self):
            rule = knob_of(f).check
            if rule is not None:
                rule.check(f"run-config {f.name.replace('_', '-')!r}", getattr(self, f.name),
                           ConfigError)
        if self.client_data == "local" and (self.partition_file or self.largest_client_first):
            raise ConfigError("run-config client-data='local' (each device trains on its own "
                              "data-path) excludes 'partition-file' and largest-client-first")
        if self.dataset == "digits" and self.client_data == "local":
            raise ConfigError("run-config client-data='local' needs an image dataset (a "
                              "device's file holds images); 'digits' is 64 features a row")
        if self.dataset == "digits" and (self.input_mean or self.input_std):
            raise ConfigError("run-config 'input-mean'/'input-std' are per image channel; "
                              "'digits' (64 features, already scaled) has none")
        if self.val_source == "file" and not self.partition_file:
            raise ConfigError("run-config val-source='file' needs a 'partition-file' holding "
                              "validation rows")
        if self.partition_file and self.train_subset:
            raise ConfigError("run-config 'train-subset' does not apply with a 'partition-file' "
                              "(the file decides every client's rows): set train-subset=0")
        for key in PATH_KEYS:
            if "\0" in getattr(self, key.replace("-", "_")):
                raise ConfigError(f"run-config {key!r} holds a NUL byte; no path can")
        for key in OUTPUT_NAME_KEYS:
            check_output_name(key, getattr(self, key.replace("-", "_")))
        if self.distill == "val" and not (self.server_validation and (
                self.val_size > 0 or self.val_source == "file")):
            raise ConfigError("run-config distill='val' distils on the server's validation "
                              "rows: it needs server-validation=true and val-size > 0 (or "
                              "use distill='synthetic')")
        self.parsed_input_stats()
        self.parsed_model_kwargs()
        self.parsed_labels_per_client()
        self.parsed_fractions()
        self.parsed_replay_clients()
        self.parsed_replay_client_members()
        self.parsed_client_models()

    @property
    def data_seed(self) -> int:
        """Seed of the validation holdout, training subset and partition: ``split-seed``, or
        ``seed`` when it is -1. Fixing it while ``seed`` varies repeats a run on one split with
        other inits and batch orders (the FedBEns authors' code does this)."""
        return self.seed if self.split_seed < 0 else self.split_seed

    def parsed_model_kwargs(self) -> dict[str, Any]:
        if not self.model_kwargs:
            return {}
        kwargs = _parse_json("model-kwargs", self.model_kwargs)
        if not isinstance(kwargs, dict):
            raise ConfigError("run-config 'model-kwargs' must be a JSON object")
        return kwargs

    def parsed_labels_per_client(self) -> tuple[int, int]:
        try:
            low, high = (int(v) for v in self.labels_per_client.split(","))
        except ValueError as exc:
            raise ConfigError("run-config 'labels-per-client' must look like '3,6'") from exc
        if not 1 <= low <= high:
            raise ConfigError("run-config 'labels-per-client' needs 1 <= low <= high")
        return low, high

    def parsed_fractions(self) -> tuple[float, ...] | None:
        if not self.fractions:
            return None
        try:
            fractions = tuple(float(v) for v in self.fractions.split(","))
        except ValueError as exc:
            raise ConfigError("run-config 'fractions' must look like '0.5,0.3,0.2'") from exc
        if not all(0 < f < math.inf for f in fractions):
            raise ConfigError(f"run-config 'fractions' must be positive numbers, got "
                              f"{brief(self.fractions)}")
        return fractions


    def parsed_input_stats(self) -> tuple[tuple[float, ...], tuple[float, ...]] | None:
        """``(mean, std)`` per channel from ``input-mean`` / ``input-std`` (e.g. ``0.1307`` and
        ``0.3081``), or None: normalise with the training set's own statistics."""
        if not self.input_mean and not self.input_std:
            return None
        try:
            mean = tuple(float(v) for v in self.input_mean.split(","))
            std = tuple(float(v) for v in self.input_std.split(","))
        except ValueError as exc:
            raise ConfigError("run-config 'input-mean' and 'input-std' must both be set, one "
                              "number per channel, like '0.1307' or '0.49,0.48,0.45'") from exc
        if len(mean) != len(std) or not all(math.isfinite(v) for v in mean + std) or not all(
                v > 0 for v in std):
            raise ConfigError("run-config 'input-mean' and 'input-std' need one finite number "
                              f"per channel each and std > 0, got {mean} and {std}")
        return mean, std

    def parsed_replay_clients(self) -> tuple[int, ...] | None:
        """Client ids to keep when replaying (``"0,2,3"``); None keeps all."""
        if not self.replay_clients:
            return None
        try:
            return tuple(int(v) for v in self.replay_clients.split(","))
        except ValueError as exc:
            raise ConfigError("run-config 'replay-clients' must look like '0,2,3'") from exc


    def parsed_replay_client_members(self) -> tuple[int, ...] | None:
        """Members to keep per client when replaying (``"1,1,1,3,3"``: client i keeps its
        first n_i members; system heterogeneity from one run); None keeps them all."""
        if not self.replay_client_members:
            return None
        try:
            counts = tuple(int(v) for v in self.replay_client_members.split(","))
        except ValueError as exc:
            raise ConfigError("run-config 'replay-client-members' must look like "
                              "'1,1,1,3,3' (members per client id)") from exc
        if any(c < 1 for c in counts):
            raise ConfigError("run-config 'replay-client-members' needs counts >= 1")
        return counts

    def parsed_client_models(self) -> list[dict[str, str]] | None:
        """Per-client architectures: ``client-models`` is a JSON list with one object per
        client id, e.g. ``[{"model": "mlp", "model-kwargs": {"hidden_layers": 1}}, {}]``; an
        entry overrides the run's ``model`` and/or ``model-kwargs`` for that client (keys it
        leaves out keep the run's values). Returns the run-config overrides per client, or
        None when the key is empty."""
        if not self.client_models:
            return None
        from fedfusion.models import available_models

        entries = _parse_json("client-models", self.client_models)
        if not isinstance(entries, list) or len(entries) != self.num_clients:
            raise ConfigError(
                "run-config 'client-models' must be a JSON list with one entry per client "
                f"(num-clients={self.num_clients}), got "
                + (f"{len(entries)} entries" if isinstance(entries, list) else
                   type(entries).__name__))
        overrides = []
        for client, entry in enumerate(entries):
            where = f"run-config 'client-models' entry {client}"
            if not isinstance(entry, dict):
                raise ConfigError(f"{where} must be a JSON object, got {entry!r}")
            unknown = sorted(set(entry) - {"model", "model-kwargs"})
            if unknown:
                raise ConfigError(f"{where} has unknown key(s) {unknown}; "
                                  "use 'model' and 'model-kwargs'")
            override = {}
            if "model" in entry:
                if entry["model"] not in available_models():
                    raise ConfigError(f"{where}: model {entry['model']!r} is not one of "
                                      f"{', '.join(available_models())}")
                override["model"] = entry["model"]
            if "model-kwargs" in entry:
                if not isinstance(entry["model-kwargs"], dict):
                    raise ConfigError(f"{where}: 'model-kwargs' must be a JSON object")
                override["model-kwargs"] = json.dumps(entry["model-kwargs"], sort_keys=True)
            overrides.append(override)
        return overrides


def knob_of(field: Field[Any]) -> Knob:
    """The declaration of the run-config key of ``Settings`` field ``field``."""
    return field.metadata["knob"]


def _keys(role: str) -> tuple[str, ...]:
    return tuple(f.name.replace("_", "-") for f in fields(Settings)
                 if getattr(knob_of(f), role))


#: run-config keys that decide the clients' data and models: a replay takes them from the
#: upload folder's manifest, since the uploads were trained under them
DATA_KEYS = _keys("data")
#: run-config keys a SuperNode's node config may override for its own client
NODE_OVERRIDES = _keys("node")
#: run-config keys that name a file or folder: a NUL byte in one is refused (no path holds
#: one; the OS call would raise ``ValueError: embedded null byte`` mid-run)
PATH_KEYS = _keys("path")
#: per strategy, its own constructor arguments -> the run-config keys that set them, and
#: the arguments every strategy takes (:class:`~fedfusion.core.fusion.Fusion`'s) ->
#: theirs; each key's default equals the constructor's (tests/test_library.py checks it)
STRATEGY_KEYS: dict[str, dict[str, str]] = {}
FUSION_KEYS: dict[str, str] = {}


def _collect_strategy_keys() -> None:
    for f in fields(Settings):
        for strategy, argument in knob_of(f).strategy:
            table = FUSION_KEYS if strategy == EVERY else STRATEGY_KEYS.setdefault(strategy, {})
            table[argument] = f.name.replace("_", "-")


_collect_strategy_keys()


def check_output_name(key: str, name: str) -> None:
    """``name`` (of run-config ``key``, e.g. ``run-name``) must name one folder directly inside
    ``output-dir`` (:func:`fedfusion.app.paths.output_name_error`), else ConfigError naming
    the key."""
    message = output_name_error(key, name)
    if message:
        raise ConfigError(message)


def _coerce(key: str, value: Any, annotation: Any) -> Any:
    kind = {"str": str, "int": int, "float": float, "bool": bool}[str(annotation)]
    try:
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        if kind is str and isinstance(value, int | float) and not isinstance(value, bool):
            # flwr's --run-config types "input-mean=0.1307" as a float
            return str(value)
    except (OverflowError, ValueError) as exc:  # an int beyond float's range or 4300 digits
        raise ConfigError(f"run-config {key!r}: {brief(value)} is not a usable "
                          f"{kind.__name__} ({exc})") from exc
    if kind is bool and isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ConfigError(
            f"run-config {key!r} must be {kind.__name__}, got {type(value).__name__} "
            f"{brief(value)}")
    return value


def _parse_json(key: str, text: str) -> Any:
    """A run-config value that holds JSON, parsed; anything it cannot be is a ConfigError
    naming ``key``."""
    try:
        return json.loads(text, parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:  # RecursionError: hostile nesting
        raise ConfigError(f"run-config {key!r} is not JSON: {describe(exc)}") from exc


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def resolved_holdout(settings: Settings) -> float:
    """The fraction of each client's rows kept out of local training: ``holdout-fraction``,
    or where it is 0, FENS' own for strategy 'fens' and none for the others."""
    if settings.holdout_fraction or settings.strategy != "fens":
        return settings.holdout_fraction
    return FENS_HOLDOUT


def default_model(settings: Settings, input_shape: Sequence[int]) -> str:
    """The run's model: ``model`` if set, else LeNet for 1-channel and the CNN for 3-channel."""
    return settings.model or ("lenet" if input_shape[0] == 1 else "cnn")


def build_strategy(settings: Settings, model_spec: ModelSpec, val: ImageData | None = None,
                   device: str | torch.device = "cpu", **kwargs: Any) -> FusionStrategy:
    """The run config's strategy, through its public constructor: the strategy's own knobs
    from its run-config keys (:data:`STRATEGY_KEYS`, whose defaults equal the
    constructor's), the shared ones from the run's settings; ``kwargs`` go to the
    constructor as they are (e.g. ``upload_sink``)."""
    from fedfusion.strategies import STRATEGIES

    if settings.strategy not in STRATEGIES:
        raise ConfigError(f"unknown strategy {settings.strategy!r}; available: "
                          f"{sorted(STRATEGIES)}")
    cls = STRATEGIES[settings.strategy]
    values = settings.to_mapping()
    client_config: dict[str, Any] = {}
    if settings.partition_sha256:  # each client checks its copy of the partition file
        client_config["partition-sha256"] = settings.partition_sha256
    holdout = resolved_holdout(settings)
    if holdout > 0:  # rows kept out of local training (FENS' aggregator is trained on them)
        client_config["holdout-fraction"] = holdout
    if cls.name == "fens":  # 0 in the run config means FENS' own, resolved above
        kwargs["holdout_fraction"] = holdout
    if settings.contrastive_weight > 0:  # MOON-style clients, any strategy
        client_config.update({"contrastive-weight": settings.contrastive_weight,
                              "contrastive-temperature": settings.contrastive_temperature})
    try:
        return cls(
            model_spec,
            num_clients=settings.num_clients,
            val=val,
            device=device,
            extra_sections=[s for s in settings.extra_sections.split(",") if s],
            member_fusion=settings.member_fusion or None,
            client_config=client_config,
            # identities are decided in live rounds; a replay's uploads carry theirs, so a
            # registry file that is gone since must not stop it
            client_registry=None if settings.replay else settings.client_registry or None,
            **kwargs,
            **{arg: values[key] for arg, key in FUSION_KEYS.items()},
            **{arg: values[key]
               for arg, key in STRATEGY_KEYS.get(settings.strategy, {}).items()},
        )
    except ValueError as exc:
        keys = {**FUSION_KEYS, **STRATEGY_KEYS.get(settings.strategy, {})}
        where = "; ".join(f"{arg} is run-config {key!r}" for arg, key in keys.items()
                          if arg in str(exc))
        raise ConfigError(f"strategy {settings.strategy!r}: {exc}"
                          + (f" ({where})" if where else "")) from exc
