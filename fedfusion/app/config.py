"""Run settings: one typed, validated view of Flower's run config.

Flower hands ServerApp and ClientApp a flat ``run_config`` mapping with kebab-case keys
(``[tool.flwr.app.config]`` in pyproject.toml, overridden by ``--run-config``). Both apps,
the replay CLI and the tests parse it through :meth:`Settings.from_mapping`, so a typo or a
wrong type fails the same way everywhere, with a message naming the key.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch

from fedfusion.app.paths import output_name_error
from fedfusion.core.architecture import ModelSpec
from fedfusion.core.normalization import NORM_STATS
from fedfusion.datasets import DATASETS, PARTITIONERS, ImageData
from fedfusion.device import CLIENT_DEVICE_PATTERN
from fedfusion.flower.strategy import FusionStrategy
from fedfusion.strategies.fens.strategy import FENS_HOLDOUT


class ConfigError(ValueError):
    """A run-config key is unknown, mistyped or out of range."""


#: run-config keys that name a file or folder: a NUL byte in one is refused (no path holds
#: one; the OS call would raise ``ValueError: embedded null byte`` mid-run)
PATH_KEYS = ("output-dir", "run-name", "data-dir", "data-path", "partition-file", "replay",
             "client-registry")
#: run-config keys that name one folder directly inside ``output-dir`` (the run's outputs)
OUTPUT_NAME_KEYS = ("run-name",)


@dataclass(frozen=True)
class Settings:
    """Every knob of a fedfusion run. Field ``foo_bar`` is run-config key ``foo-bar``."""

    # what runs
    strategy: str = "fedavg"
    num_rounds: int = 1
    # data
    dataset: str = "fmnist"
    data_dir: str = ""
    val_size: int = 500
    train_subset: int = 0
    partitioner: str = "dirichlet"
    alpha: float = 0.1
    labels_per_client: str = "3,6"
    fractions: str = ""
    min_samples: int = 10
    num_clients: int = 5
    seed: int = 0
    split_seed: int = -1
    partition_file: str = ""
    partition_key: str = ""
    partition_sha256: str = ""
    val_source: str = "holdout"
    # where a client's training data comes from: "partition" (simulations, demos: rows
    # partition-id of the split every process derives) or "local" (real devices: the file
    # data-path of the node's node config, the device's own data)
    client_data: str = "partition"
    data_path: str = ""
    input_mean: str = ""
    input_std: str = ""
    # model and local training
    model: str = ""
    model_kwargs: str = ""
    num_members: int = 1
    init_perturbation: float = 0.0
    local_epochs: int = 20
    lr: float = 0.01
    momentum: float = 0.9
    batch_size: int = 64
    client_threads: int = 1
    # where a client trains, fits curvature and builds its upload: auto = the GPU Flower
    # gave its process (Ray's visible devices, a SuperNode's GPU), else the CPU
    client_device: str = "auto"
    accelerate: bool = True
    largest_client_first: bool = False
    # Laplace curvature (FedBEns and its curvature-based baselines)
    hessian_structure: str = "kron"
    temperature: float = 0.1
    prior_var: float = 0.1
    curvature_backend: str = ""
    curvature_batch_size: int = 256
    curvature_rank: int = 0
    curvature_half: bool = False
    extra_sections: str = ""
    # server
    server_device: str = "auto"
    server_threads: int = 0
    eval_batch_size: int = 2000
    server_steps: int = 300
    server_steps_noval: int = 100
    server_lr: float = 0.001
    server_clip: float = 1.0
    server_eval_every: int = 30
    server_patience: int = 4
    server_validation: bool = True
    server_cuda_graphs: bool = True
    round_timeout: float = 3600.0
    node_wait_timeout: float = 600.0
    client_registry: str = ""
    min_valid_uploads: int = 1
    member_fusion: str = ""
    norm_stats: str = "auto"
    # robust aggregation (fedfusion.core.screening): weight-norm, curvature/Gram and
    # validation screens, count cap
    screen_factor: float = 10.0
    curvature_screen_factor: float = 1000.0
    val_screen: bool = True
    num_examples_cap: float = 3.0
    # one network out of any fused predictor (fedfusion.distillation)
    distill: str = "none"
    distill_epochs: int = 30
    distill_lr: float = 0.001
    distill_temperature: float = 1.0
    distill_augment: bool = True
    mixture_prune_margin: float = 50.0
    mixture_refresh_every: int = 10
    fedbens_starts: str = "auto"
    fedbens_num_starts: int = 0
    fedbens_modes: int = 0
    # FedBEns' baselines
    fedfisher_steps: int = 2000
    fedfisher_lr: float = 0.01
    fedfisher_eval_every: int = 100
    regmean_alpha: str = "0.1,0.5,0.9"
    otfusion_mode: str = "weights"
    dense_epochs: int = 200
    dense_batch_size: int = 256
    dense_latent_dim: int = 256
    dense_g_lr: float = 0.001
    dense_s_lr: float = 0.01
    dense_g_steps: int = 1
    dense_s_steps: int = 5
    dense_adv_weight: float = 1.0
    dense_act_weight: float = 0.1
    # Co-Boosting: its own knobs (the generator and the student take the dense-* ones)
    co_boosting_epsilon: float = 0.03
    co_boosting_perturb_steps: int = 1
    co_boosting_perturbation: str = "ods"
    co_boosting_hardness: float = 1.0
    co_boosting_weight_lr: float = 0.01
    co_boosting_weight_decay: float = 0.99
    co_boosting_weight_steps: int = 1
    # FENS (fedfusion.strategies.fens): rows held out of local training, aggregator rounds
    holdout_fraction: float = 0.0
    fens_hidden: int = 0
    fens_rounds: int = 100
    fens_patience: int = 10
    fens_server_optimizer: str = "fedadam"
    fens_server_lr: float = 0.05
    fens_local_epochs: int = 1
    fens_lr: float = 0.1
    fens_batch_size: int = 64
    fens_base: str = "members"
    # SWA and its baselines
    swa_distance: str = "hos"
    swa_size_weighting: bool = False
    prox_mu: float = 0.01
    contrastive_weight: float = 0.0
    contrastive_temperature: float = 0.5
    # AMS and its PFNM baseline
    ams_top_k: int = 1
    pfnm_sigma: float = 1.0
    pfnm_sigma0: float = 1.0
    pfnm_gamma: float = 1.0
    pfnm_iters: int = 5
    client_models: str = ""
    # outputs
    output_dir: str = ""
    run_name: str = ""
    save_uploads: bool = True
    replay: str = ""
    replay_clients: str = ""
    replay_members: int = 0
    replay_client_members: str = ""

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
        from fedfusion.models import available_models
        from fedfusion.strategies import available_strategies

        _check_choice("strategy", self.strategy, available_strategies())
        _check_choice("dataset", self.dataset, DATASETS)
        _check_choice("partitioner", self.partitioner, PARTITIONERS)
        if self.model:
            _check_choice("model", self.model, available_models())
        _check_choice("hessian-structure", self.hessian_structure, ("kron", "diag", "diag_full"))
        for key in ("num-rounds", "num-clients", "num-members", "batch-size", "client-threads",
                    "eval-batch-size", "curvature-batch-size", "server-eval-every",
                    "mixture-refresh-every"):
            if getattr(self, key.replace("-", "_")) < 1:
                raise ConfigError(f"run-config {key!r} must be >= 1")
        for key in ("val-size", "train-subset", "local-epochs", "min-samples", "curvature-rank",
                    "server-steps", "server-steps-noval", "replay-members", "fedbens-modes",
                    "server-threads", "server-patience", "fedbens-num-starts"):
            if getattr(self, key.replace("-", "_")) < 0:
                raise ConfigError(f"run-config {key!r} must be >= 0")
        if self.alpha <= 0:
            raise ConfigError("run-config 'alpha' must be > 0")
        if self.split_seed < -1:
            raise ConfigError("run-config 'split-seed' must be -1 (follow 'seed') or >= 0")
        _check_choice("val-source", self.val_source, ("holdout", "file"))
        _check_choice("client-data", self.client_data, ("partition", "local"))
        if self.client_data == "local" and (self.partition_file or self.largest_client_first):
            raise ConfigError("run-config client-data='local' (each device trains on its own "
                              "data-path) excludes 'partition-file' and largest-client-first")
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
        if self.partition_sha256 and (len(self.partition_sha256) != 64 or any(
                c not in "0123456789abcdef" for c in self.partition_sha256)):
            raise ConfigError("run-config 'partition-sha256' must be 64 lowercase hex digits")
        self.parsed_input_stats()
        if not (self.init_perturbation >= 0 and math.isfinite(self.init_perturbation)):
            raise ConfigError("run-config 'init-perturbation' must be a finite number >= 0")
        for key in ("screen-factor", "curvature-screen-factor", "num-examples-cap"):
            value = getattr(self, key.replace("-", "_"))
            if not (math.isfinite(value) and (value == 0 or value >= 1)):
                raise ConfigError(f"run-config {key!r} must be 0 (off) or a number >= 1, got "
                                  f"{value!r}")
        if self.min_valid_uploads < 1:
            raise ConfigError("run-config 'min-valid-uploads' must be >= 1")
        if self.norm_stats not in NORM_STATS:
            raise ConfigError(f"run-config 'norm-stats' must be one of {NORM_STATS}, got "
                              f"{self.norm_stats!r}")
        if self.member_fusion not in ("", "first", "each", "all"):
            raise ConfigError("run-config 'member-fusion' must be '' (the strategy's default), "
                              f"'first', 'each' or 'all', got {self.member_fusion!r}")
        for key in ("lr", "temperature", "prior-var", "server-lr", "server-clip",
                    "round-timeout", "node-wait-timeout"):
            if getattr(self, key.replace("-", "_")) <= 0:
                raise ConfigError(f"run-config {key!r} must be > 0")
        if self.server_device not in ("auto", "cpu") and not self.server_device.startswith("cuda"):
            raise ConfigError("run-config 'server-device' must be 'auto', 'cpu' or 'cuda[:i]'")
        if not CLIENT_DEVICE_PATTERN.fullmatch(self.client_device):
            raise ConfigError("run-config 'client-device' must be 'auto', 'cpu', 'cuda' or "
                              f"'cuda:<i>', got {self.client_device!r}")
        if not 0 <= self.holdout_fraction < 1:
            raise ConfigError("run-config 'holdout-fraction' must be in [0, 1) (0: FENS' "
                              f"{FENS_HOLDOUT} for strategy 'fens', none otherwise), got "
                              f"{self.holdout_fraction!r}")
        self._validate_swa()
        self._validate_distill()
        self.parsed_model_kwargs()
        self.parsed_labels_per_client()
        self.parsed_fractions()
        self.parsed_replay_clients()
        self.parsed_replay_client_members()
        # AMS and PFNM
        for key in ("ams-top-k", "pfnm-iters"):
            if getattr(self, key.replace("-", "_")) < 0:
                raise ConfigError(f"run-config {key!r} must be >= 0")
        for key in ("pfnm-sigma", "pfnm-sigma0", "pfnm-gamma"):
            if not getattr(self, key.replace("-", "_")) > 0:
                raise ConfigError(f"run-config {key!r} must be > 0")
        self.parsed_client_models()

    def _validate_distill(self) -> None:
        from fedfusion.distillation import DISTILL_MODES

        _check_choice("distill", self.distill, DISTILL_MODES)
        if self.distill_epochs < 0:
            raise ConfigError("run-config 'distill-epochs' must be >= 0")
        for key in ("distill-lr", "distill-temperature"):
            value = getattr(self, key.replace("-", "_"))
            if not (value > 0 and math.isfinite(value)):
                raise ConfigError(f"run-config {key!r} must be a finite number > 0, got "
                                  f"{value!r}")
        if self.distill == "val" and not (self.server_validation and (
                self.val_size > 0 or self.val_source == "file")):
            raise ConfigError("run-config distill='val' distils on the server's validation "
                              "rows: it needs server-validation=true and val-size > 0 (or "
                              "use distill='synthetic')")

    def _validate_swa(self) -> None:
        from fedfusion.strategies.swa import SWA_DISTANCES

        _check_choice("swa-distance", self.swa_distance, SWA_DISTANCES)
        for key in ("prox-mu", "contrastive-weight"):
            value = getattr(self, key.replace("-", "_"))
            if not (value >= 0 and math.isfinite(value)):
                raise ConfigError(f"run-config {key!r} must be a finite number >= 0")
        if not (self.contrastive_temperature > 0 and math.isfinite(self.contrastive_temperature)):
            raise ConfigError("run-config 'contrastive-temperature' must be > 0")

    @property
    def data_seed(self) -> int:
        """Seed of the validation holdout, training subset and partition: ``split-seed``, or
        ``seed`` when it is -1. Fixing it while ``seed`` varies repeats a run on one split with
        other inits and batch orders (the FedBEns authors' code does this)."""
        return self.seed if self.split_seed < 0 else self.split_seed

    def parsed_model_kwargs(self) -> dict[str, Any]:
        if not self.model_kwargs:
            return {}
        try:
            kwargs = json.loads(self.model_kwargs)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"run-config 'model-kwargs' is not JSON: {exc}") from exc
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
            return tuple(float(v) for v in self.fractions.split(","))
        except ValueError as exc:
            raise ConfigError("run-config 'fractions' must look like '0.5,0.3,0.2'") from exc


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

        try:
            entries = json.loads(self.client_models)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"run-config 'client-models' is not JSON: {exc}") from exc
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


def check_output_name(key: str, name: str) -> None:
    """``name`` (of run-config ``key``, e.g. ``run-name``) must name one folder directly inside
    ``output-dir`` (:func:`fedfusion.app.paths.output_name_error`), else ConfigError naming
    the key."""
    message = output_name_error(key, name)
    if message:
        raise ConfigError(message)


def _check_choice(key: str, value: str, choices: Any) -> None:
    if value not in choices:
        raise ConfigError(f"run-config {key!r} is {value!r}; choose one of {', '.join(choices)}")


def _coerce(key: str, value: Any, annotation: Any) -> Any:
    kind = {"str": str, "int": int, "float": float, "bool": bool}[str(annotation)]
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if kind is str and isinstance(value, int | float) and not isinstance(value, bool):
        # flwr's --run-config types "input-mean=0.1307" as a float
        return str(value)
    if kind is bool and isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ConfigError(
            f"run-config {key!r} must be {kind.__name__}, got {type(value).__name__} {value!r}"
        )
    return value


#: per strategy, constructor argument -> the run-config key that sets it (each key's default
#: in pyproject.toml equals the constructor's; tests/test_library.py checks both)
def resolved_holdout(settings: Settings) -> float:
    """The fraction of each client's rows kept out of local training: ``holdout-fraction``,
    or where it is 0, FENS' own for strategy 'fens' and none for the others."""
    if settings.holdout_fraction or settings.strategy != "fens":
        return settings.holdout_fraction
    return FENS_HOLDOUT


def default_model(settings: Settings, input_shape: Sequence[int]) -> str:
    """The run's model: ``model`` if set, else LeNet for 1-channel and the CNN for 3-channel."""
    return settings.model or ("lenet" if input_shape[0] == 1 else "cnn")


STRATEGY_KEYS: dict[str, dict[str, str]] = {
    "fedbens": {"hessian_structure": "hessian-structure", "temperature": "temperature",
                "prior_var": "prior-var", "steps": "server-steps",
                "steps_noval": "server-steps-noval", "lr": "server-lr", "clip": "server-clip",
                "eval_every": "server-eval-every", "patience": "server-patience",
                "prune_margin": "mixture-prune-margin",
                "refresh_every": "mixture-refresh-every", "starts": "fedbens-starts",
                "num_starts": "fedbens-num-starts", "modes": "fedbens-modes",
                "cuda_graphs": "server-cuda-graphs"},
    "fedfisher": {"hessian_structure": "hessian-structure", "steps": "fedfisher-steps",
                  "lr": "fedfisher-lr", "eval_every": "fedfisher-eval-every"},
    "pfnm": {"sigma": "pfnm-sigma", "sigma0": "pfnm-sigma0", "gamma": "pfnm-gamma",
             "iters": "pfnm-iters"},
    "dense": {"epochs": "dense-epochs", "batch_size": "dense-batch-size",
              "latent_dim": "dense-latent-dim", "g_lr": "dense-g-lr", "s_lr": "dense-s-lr",
              "g_steps": "dense-g-steps", "s_steps": "dense-s-steps",
              "adv_weight": "dense-adv-weight", "act_weight": "dense-act-weight"},
    "co-boosting": {"epochs": "dense-epochs", "batch_size": "dense-batch-size",
                    "latent_dim": "dense-latent-dim", "g_lr": "dense-g-lr",
                    "s_lr": "dense-s-lr", "g_steps": "dense-g-steps",
                    "s_steps": "dense-s-steps", "adv_weight": "dense-adv-weight",
                    "act_weight": "dense-act-weight", "epsilon": "co-boosting-epsilon",
                    "perturb_steps": "co-boosting-perturb-steps",
                    "perturbation": "co-boosting-perturbation",
                    "hardness": "co-boosting-hardness", "weight_lr": "co-boosting-weight-lr",
                    "weight_decay": "co-boosting-weight-decay",
                    "weight_steps": "co-boosting-weight-steps"},
    "fens": {"hidden": "fens-hidden",
             "rounds": "fens-rounds", "patience": "fens-patience",
             "server_optimizer": "fens-server-optimizer", "server_lr": "fens-server-lr",
             "local_epochs": "fens-local-epochs", "local_lr": "fens-lr",
             "local_batch_size": "fens-batch-size", "base": "fens-base"},
    "fedprox": {"prox_mu": "prox-mu"},
    "regmean": {"alphas": "regmean-alpha"},
    "otfusion": {"mode": "otfusion-mode"},
    "swa": {"distance": "swa-distance", "size_weighting": "swa-size-weighting"},
    "ams": {"top_k": "ams-top-k"},
}


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
            num_members=settings.num_members,
            val=val,
            device=device,
            seed=settings.seed,
            init_perturbation=settings.init_perturbation,
            min_valid_uploads=settings.min_valid_uploads,
            round_timeout=settings.round_timeout,
            node_wait_timeout=settings.node_wait_timeout,
            extra_sections=[s for s in settings.extra_sections.split(",") if s],
            member_fusion=settings.member_fusion or None,
            client_config=client_config,
            norm_stats=settings.norm_stats,
            screen_factor=settings.screen_factor,
            curvature_screen_factor=settings.curvature_screen_factor,
            val_screen=settings.val_screen,
            num_examples_cap=settings.num_examples_cap,
            distill=settings.distill,
            distill_epochs=settings.distill_epochs,
            distill_lr=settings.distill_lr,
            distill_temperature=settings.distill_temperature,
            distill_augment=settings.distill_augment,
            # identities are decided in live rounds; a replay's uploads carry theirs, so a
            # registry file that is gone since must not stop it
            client_registry=None if settings.replay else settings.client_registry or None,
            **kwargs,
            **{arg: values[key]
               for arg, key in STRATEGY_KEYS.get(settings.strategy, {}).items()},
        )
    except ValueError as exc:
        keys = STRATEGY_KEYS.get(settings.strategy, {})
        where = "; ".join(f"{arg} is run-config {key!r}" for arg, key in keys.items()
                          if arg in str(exc))
        raise ConfigError(f"strategy {settings.strategy!r}: {exc}"
                          + (f" ({where})" if where else "")) from exc
