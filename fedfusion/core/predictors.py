"""Global predictors: what a strategy hands to evaluation and saves for inference.

Every predictor is an ``nn.Module`` mapping inputs to LOG-probabilities ``[B, K]``, so one
evaluation path serves a single model, an ensemble, or a per-input selector. A predictor is
saved as plain tensors plus a JSON-able spec (``torch.load(weights_only=True)`` loads it).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fedfusion.core.architecture import ModelFn, ModelSpec
from fedfusion.models import check_int


class Ensemble(nn.Module):
    """p(y|x) = 1/M sum_m softmax(f_m(x)); a single model is an ensemble of one."""

    kind = "ensemble"

    def __init__(self, models: Sequence[nn.Module], specs: Sequence[ModelSpec]):
        super().__init__()
        if len(models) != len(specs) or not models:
            raise ValueError("an ensemble needs one spec per model and at least one model")
        self.members = nn.ModuleList(models)
        self.specs = list(specs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        log_probs = torch.stack([torch.log_softmax(m(x), dim=-1) for m in self.members])
        return torch.logsumexp(log_probs, dim=0) - math.log(len(self.members))

    def to_payload(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "specs": [s.to_dict() for s in self.specs],
            "states": [{k: v.detach().cpu() for k, v in m.state_dict().items()}
                       for m in self.members],
        }

    @classmethod
    def from_payload(cls, payload: Mapping[str, Any], model_fn: ModelFn | None = None
                     ) -> Ensemble:
        specs = [ModelSpec.from_dict(s, model_fn) for s in payload["specs"]]
        return cls([s.build(st) for s, st in zip(specs, payload["states"], strict=True)], specs)

    @classmethod
    def check_payload(cls, where: str, payload: Mapping[str, Any]) -> None:
        """Raise ValueError naming the first field of the payload, beyond the members' specs
        and states (checked by :func:`read_predictor`), that is wrong; a subclass with fields
        of its own checks them here."""


def save_predictor(predictor: nn.Module, path: str | Path) -> Path:
    """Save any registered predictor (plain tensors and lists; no code is pickled). A symlink
    at ``path`` is refused (``OSError``), not followed."""
    from fedfusion.upload_store import open_no_follow  # not at import: it pulls in flwr

    path = Path(path)
    with open_no_follow(path) as handle:
        torch.save(predictor.to_payload(), handle)  # type: ignore[operator]
    return path


#: members a saved predictor may hold
MAX_PREDICTOR_MEMBERS = 100_000


def read_predictor(path: str | Path, kinds: Mapping[str, type[Ensemble]],
                   device: str | torch.device = "cpu", model_fn: ModelFn | None = None
                   ) -> Ensemble:
    """Load a saved predictor of one of ``kinds`` (kind -> class) for inference; the
    public :func:`fedfusion.load_predictor` passes every strategy's kinds.

    The file is untrusted: it is unpickled with ``weights_only=True`` (tensors and plain
    containers only), and its kind, spec fields and state tensors are checked before any
    model is built (each spec is first built on the meta device, which allocates nothing, and
    its parameter names and shapes compared with the saved tensors'), so a bad file raises a
    ValueError naming the field instead of allocating what the spec claims. Each state tensor's
    real storage is checked against its shape before anything is copied: a tensor whose view
    needs more elements than its storage holds (a stride-0 "expanded" tensor, one float
    standing for a large shape), or members whose views of one storage add up to more than the
    file's distinct storages hold, is refused, so that loading allocates at most about what
    the file holds."""
    path = Path(path)
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise
    except Exception as exc:  # not a torch file, truncated, or holding code objects
        raise ValueError(f"{path}: not a saved fedfusion predictor ({type(exc).__name__}: "
                         f"{str(exc).splitlines()[0] if str(exc) else ''})") from exc
    _check_payload(path, payload, kinds, model_fn)
    return kinds[payload["kind"]].from_payload(payload, model_fn).to(device).eval()


def _check_payload(path: Path, payload: object, kinds: Mapping[str, type[Ensemble]],
                   model_fn: ModelFn | None = None) -> None:
    """Raise ValueError naming the first field of a predictor payload that is wrong."""
    if not isinstance(payload, dict):
        raise ValueError(f"{path}: holds a {type(payload).__name__}, not a predictor payload")
    kind = payload.get("kind")
    if not isinstance(kind, str) or kind not in kinds:
        raise ValueError(f"{path}: unknown predictor kind {kind!r:.60}; known: "
                         f"{', '.join(kinds)}")
    specs, states = payload.get("specs"), payload.get("states")
    if not isinstance(specs, list) or not 1 <= len(specs) <= MAX_PREDICTOR_MEMBERS:
        raise ValueError(f"{path}: 'specs' must be a list of 1..{MAX_PREDICTOR_MEMBERS} model "
                         "specs")
    if not isinstance(states, list) or len(states) != len(specs):
        raise ValueError(f"{path}: 'states' must be a list with one state per spec "
                         f"({len(specs)})")
    for i, (spec, state) in enumerate(zip(specs, states, strict=True)):
        _check_member(path, i, spec, state, model_fn)
    _check_storage_total(path, states)
    kinds[kind].check_payload(f"{path}", payload)


def _check_member(path: Path, i: int, spec: object, state: object,
                  model_fn: ModelFn | None = None) -> None:
    where = f"{path}: specs[{i}]"
    if not isinstance(spec, dict):
        raise ValueError(f"{where} must be a dict, got {type(spec).__name__}")
    fields = {"name": str, "input_shape": list, "num_classes": int, "kwargs": dict}
    for key, kind in fields.items():
        value = spec.get(key)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise ValueError(f"{where}.{key} must be {kind.__name__}, got {value!r:.60}")
    for size in spec["input_shape"]:
        check_int(where, "every input_shape entry", size, 1, 2**24)
    if not all(isinstance(k, str) for k in spec["kwargs"]):
        raise ValueError(f"{where}.kwargs must have string keys")
    try:
        with torch.device("meta"):  # shapes only: nothing is allocated, whatever the spec says
            expected = {k: (tuple(v.shape), v.dtype) for k, v in
                        ModelSpec.from_dict(spec, model_fn).build().state_dict().items()}
    except Exception as exc:
        raise ValueError(f"{where}: model {spec['name']!r:.60} cannot be built: "
                         f"{type(exc).__name__}: {exc}") from exc
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor)
                                              for v in state.values()):
        raise ValueError(f"{path}: states[{i}] must be a dict of tensors")
    missing = sorted(set(expected) - set(state))
    extra = sorted(map(str, set(state) - set(expected)))
    if missing or extra:
        raise ValueError(f"{path}: states[{i}] does not match specs[{i}]'s model: missing "
                         f"{missing[:8]}, unexpected {extra[:8]}")
    for name, (shape, dtype) in expected.items():
        tensor = state[name]
        # float entries in any float precision; others (BatchNorm's int64 step count) as built
        kind_ok = (tensor.is_floating_point() if dtype.is_floating_point
                   else tensor.dtype == dtype)
        if tuple(tensor.shape) != shape or not kind_ok:
            wanted = "a float tensor" if dtype.is_floating_point else f"a {dtype} tensor"
            raise ValueError(f"{path}: states[{i}][{name!r}] is {tensor.dtype} "
                             f"{tuple(tensor.shape)}, the model needs {wanted} {shape}")
        check_storage(f"{path}: states[{i}][{name!r}]", tensor)


def _view_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def check_storage(where: str, tensor: torch.Tensor) -> None:
    """Refuse a tensor whose view needs more bytes than its real storage holds (stride 0 or
    otherwise overlapping: copying it would materialise the whole declared shape)."""
    needed = _view_bytes(tensor)
    held = tensor.untyped_storage().nbytes() - tensor.storage_offset() * tensor.element_size()
    if tensor.numel() == 0:
        return
    reach = 1 + sum((size - 1) * stride for size, stride in
                    zip(tensor.shape, tensor.stride(), strict=True))
    if any(stride < 0 for stride in tensor.stride()) or needed > held or (
            reach * tensor.element_size() > held):
        raise ValueError(f"{where} declares {tuple(tensor.shape)} ({needed} bytes) over "
                         f"{max(held, 0)} bytes of storage (strides {tensor.stride()}): an "
                         "expanded or overlapping tensor, not a saved state")


def _check_storage_total(path: Path, states: list[Any]) -> None:
    """Refuse members whose tensors share storage so that, copied into models, they would
    take more than the file's distinct storages hold (a tensor listed twice under one member,
    as tied weights are, counts once)."""
    storages: dict[int, int] = {}
    needed = 0
    for state in states:
        views = {(t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape),
                  t.stride(), t.dtype): _view_bytes(t) for t in state.values()}
        needed += sum(views.values())
        for tensor in state.values():
            storage = tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    if needed > sum(storages.values()):
        raise ValueError(f"{path}: the states declare {needed} bytes of tensors over "
                         f"{sum(storages.values())} bytes of storage: tensors shared between "
                         "members or entries, not a saved predictor")
