"""A network's ``state_dict`` as fedfusion sees it: which entries are parameters and which are
buffers, their dtypes, and which module owns each parameter; and the exact conversion of a
``state_dict`` to the numpy arrays that travel in uploads and broadcasts.

Every entry round-trips exactly (:func:`state_arrays` -> :func:`load_state_arrays`): 0-d
tensors stay 0-d, integer counters (BatchNorm's ``num_batches_tracked``), bool and uint8
buffers keep their dtype, float16 stays float16. numpy has no bfloat16, so a bfloat16 entry
travels as float32 (every bfloat16 value is a float32 value, so nothing is lost) and is cast
back to bfloat16 when loaded into the network, whose dtype the receiver knows from its own
``model_fn()``.

:class:`StateLayout` is what a server knows of an architecture without any client's word:
built from ``model_fn()`` on the meta device (no memory), it maps every ``state_dict`` name to
its shape (so it is a drop-in ``{name: shape}`` mapping) and says, besides, which names are
parameters (what curvature covers and what optimisers move) and which are buffers (running
statistics and counters, governed by each strategy's normalisation-statistics rule), and
which parameters are linear maps of a captured input (``nn.Linear``, ``nn.Conv2d``, the packed
in-projection of ``nn.MultiheadAttention``: :mod:`fedfusion.capture`; Kronecker-factored
curvature and Gram matrices apply to those; every other parameter, e.g. of BatchNorm,
LayerNorm, GroupNorm, Embedding, a learned position ``nn.Parameter`` or a user's own layer,
gets a diagonal block).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from fedfusion.capture import linear_map_parameters

NumpyDict = dict[str, np.ndarray]

#: torch dtypes a state entry may have, and the numpy dtype each travels as
WIRE_DTYPES: dict[torch.dtype, np.dtype] = {
    torch.float64: np.dtype(np.float64),
    torch.float32: np.dtype(np.float32),
    torch.float16: np.dtype(np.float16),
    torch.bfloat16: np.dtype(np.float32),  # exact: bfloat16 is a subset of float32
    torch.int64: np.dtype(np.int64),
    torch.int32: np.dtype(np.int32),
    torch.int16: np.dtype(np.int16),
    torch.int8: np.dtype(np.int8),
    torch.uint8: np.dtype(np.uint8),
    torch.bool: np.dtype(np.bool_),
}


def wire_dtype(dtype: torch.dtype, name: str = "") -> np.dtype:
    """The numpy dtype a state entry of ``dtype`` travels as; ValueError for others (complex,
    float8 ...)."""
    if dtype not in WIRE_DTYPES:
        raise ValueError(f"state entry {name!r} has dtype {dtype}, which fedfusion does not "
                         f"transport (supported: {sorted(str(d) for d in WIRE_DTYPES)})")
    return WIRE_DTYPES[dtype]


def state_arrays(state: Mapping[str, torch.Tensor] | nn.Module) -> NumpyDict:
    """A ``state_dict`` (or a module's) as numpy arrays of the wire dtype, same shapes
    (0-d stays 0-d), sharing no memory with the tensors."""
    if isinstance(state, nn.Module):
        state = state.state_dict()
    arrays = {}
    for name, tensor in state.items():
        tensor = tensor.detach().cpu()
        arrays[name] = tensor.to(_torch_dtype(wire_dtype(tensor.dtype, name))).numpy().copy()
    return arrays


def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.zeros(0, dtype=dtype)).dtype


def load_state_arrays(model: nn.Module, arrays: Mapping[str, np.ndarray | torch.Tensor],
                      strict: bool = True) -> nn.Module:
    """Load wire arrays into ``model``: each is cast to the dtype of the model's own entry
    (bfloat16 back from float32, an average back to an integer counter), and shapes must
    match exactly (``load_state_dict``'s checks)."""
    own = model.state_dict()
    state = {}
    for name, value in arrays.items():
        tensor = torch.as_tensor(value)
        if name in own:
            tensor = tensor.to(own[name].dtype)
        state[name] = tensor
    model.load_state_dict(state, strict=strict)
    return model


@dataclass(frozen=True)
class StateLayout(Mapping[str, tuple[int, ...]]):
    """``{name: shape}`` of a network's ``state_dict``, plus what each entry is.

    ``parameters``: names of ``named_parameters()`` (in that order); ``buffers``: the other
    entries; ``dtypes``: each entry's torch dtype; ``kron``: the parameters of the linear maps
    (``nn.Linear``, ``nn.Conv2d``, the packed in-projection of ``nn.MultiheadAttention``: see
    :func:`fedfusion.capture.linear_maps`); ``owners``: parameter name ->
    the class name of the module that owns it (for messages)."""

    shapes: dict[str, tuple[int, ...]]
    parameters: tuple[str, ...]
    dtypes: dict[str, torch.dtype] = field(default_factory=dict)
    kron: frozenset[str] = frozenset()
    owners: dict[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, model: nn.Module) -> StateLayout:
        """The layout of ``model`` (any device, the meta device included)."""
        state = model.state_dict()
        parameters = tuple(name for name, _ in model.named_parameters())
        owners = {}
        for module_name, module in model.named_modules():
            for param_name, _ in module.named_parameters(recurse=False):
                full = f"{module_name}.{param_name}" if module_name else param_name
                owners[full] = type(module).__name__
        kron = linear_map_parameters(model)
        return cls({name: tuple(t.shape) for name, t in state.items()},
                   tuple(p for p in parameters if p in state),
                   {name: t.dtype for name, t in state.items()}, frozenset(kron), owners)

    @property
    def buffers(self) -> tuple[str, ...]:
        """The ``state_dict`` entries that are not parameters (running statistics, counters)."""
        params = set(self.parameters)
        return tuple(name for name in self.shapes if name not in params)

    @property
    def variances(self) -> tuple[str, ...]:
        """The buffers that hold a variance estimate (``running_var``, as PyTorch's
        BatchNorm and InstanceNorm name it): >= 0, or the normalisation takes the square
        root of a negative number."""
        return tuple(name for name in self.buffers if name.rsplit(".", 1)[-1] == "running_var")

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        """``{name: shape}`` of the parameters alone: what curvature sections cover."""
        return {name: self.shapes[name] for name in self.parameters}

    def wire_dtype(self, name: str) -> np.dtype:
        """The numpy dtype entry ``name`` travels as."""
        return wire_dtype(self.dtypes[name], name)

    def __getitem__(self, name: str) -> tuple[int, ...]:
        return self.shapes[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)


def parameter_shapes(shapes: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """The parameters' shapes of a :class:`StateLayout`; a plain ``{name: shape}`` mapping is
    taken to hold parameters only (callers that know no model, e.g. unit tests)."""
    if isinstance(shapes, StateLayout):
        return shapes.parameter_shapes()
    return {name: tuple(shape) for name, shape in shapes.items()}


def kron_parameters(shapes: Mapping[str, tuple[int, ...]]) -> frozenset[str]:
    """The parameters that get Kronecker factors: a layout's ``kron``; for a plain mapping,
    every parameter (today's structure for the papers' all-Linear/Conv2d networks)."""
    if isinstance(shapes, StateLayout):
        return shapes.kron
    return frozenset(shapes)


AverageWeights = Sequence[float] | Mapping[str, Sequence[float]]


def weighted_average(arrays: Sequence[dict[str, np.ndarray]], weights: AverageWeights
                     ) -> dict[str, np.ndarray]:
    """sum_i weights_i * arrays_i / sum_i weights_i, parameter by parameter (in float64), for
    every floating entry (parameters and running statistics alike); a non-float entry
    (integer counter, bool or uint8 buffer) is the value of the client with the largest
    weight.

    ``weights`` is one weight per client (the same for every parameter), or a mapping from
    every parameter name to one weight per client (each parameter normalised by its own sum).
    """
    per_name = weights if isinstance(weights, Mapping) else dict.fromkeys(arrays[0], weights)
    averaged = {}
    for name in arrays[0]:
        if name not in per_name:
            raise ValueError(f"no averaging weights for parameter {name!r}")
        given = np.asarray(per_name[name], dtype=np.float64)
        if not np.isfinite(given).all():
            raise ValueError(f"averaging weights of {name!r} must be finite, got {given}")
        # divided by the largest first: weights near float's range sum without overflow
        weights_of = given / max(float(np.abs(given).max(initial=0.0)), 1e-300)
        total = float(weights_of.sum())
        if not total > 0:
            raise ValueError(f"averaging weights of {name!r} sum to {given.sum()}, need > 0")
        if arrays[0][name].dtype.kind != "f":
            # an integer counter (num_batches_tracked) or a bool/uint8 buffer has no
            # meaningful average: the heaviest client's value (the first on ties)
            heaviest = int(np.argmax(weights_of))
            averaged[name] = arrays[heaviest][name].copy()
            continue
        averaged[name] = (
            sum(w * a[name].astype(np.float64) for a, w in zip(arrays, weights_of, strict=True))
            / total).astype(arrays[0][name].dtype)
    return averaged


def load_models(states: Sequence[Mapping[str, np.ndarray]], model_fn: Callable[[], nn.Module],
                what: str) -> list[nn.Module]:
    """One fresh ``model_fn()`` per state, loaded with it (the throw-away init draws from a
    fork of torch's global RNG: the caller's does not advance); a state that does not fit
    raises ValueError naming ``what`` and its index."""
    models = []
    for m, state in enumerate(states):
        with torch.random.fork_rng(devices=[]):
            model = model_fn()
        try:
            load_state_arrays(model, state)
        except RuntimeError as exc:
            raise ValueError(f"{what} {m} does not fit model_fn()'s network "
                             f"{type(model).__name__}: {exc}") from exc
        models.append(model)
    return models
