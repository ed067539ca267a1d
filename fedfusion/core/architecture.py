"""How the server and the clients (re)build a network: a factory plus the name and kwargs
that identify it in uploads.

A :class:`ModelSpec` wraps either

* a user's factory: ``ModelSpec.from_model_fn(model_fn)`` (``model_fn(**kwargs)`` returns an
  ``nn.Module``; its name is the class name of what it builds), or
* a model of the built-in zoo (:mod:`fedfusion.models`): ``ModelSpec("lenet", (1, 28, 28), 10)``.

Clients declare ``model`` (the spec's name) and ``model-kwargs`` in every upload; the server
rebuilds a client's network with :meth:`ModelSpec.variant`, so strategies that accept several
architectures (ensembles, AMS, PFNM) build each client's own network from the same factory.
"""

from __future__ import annotations

import copy
import functools
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from fedfusion.core.state import StateLayout, load_state_arrays
from fedfusion.models import build_model

ModelFn = Callable[..., nn.Module]


class ModelSpec:
    """One network architecture: how to build it and what it is called in uploads.

    Parameters
    ----------
    name : str
        The architecture's name in uploads (``model``). Without ``model_fn`` it names a
        model of the built-in zoo.
    input_shape : sequence of int, optional
        Shape of one input, e.g. ``(1, 28, 28)``. The zoo needs it; a ``model_fn`` does not
        (DENSE's generator does).
    num_classes : int, optional
        Number of outputs; as ``input_shape``.
    kwargs : mapping, optional
        Keyword arguments of the factory (``model-kwargs`` in uploads, JSON-able).
    model_fn : callable, optional
        ``model_fn(**kwargs) -> nn.Module``; None = the zoo model ``name``.
    """

    def __init__(
        self,
        name: str,
        input_shape: Sequence[int] = (),
        num_classes: int = 0,
        kwargs: Mapping[str, Any] | None = None,
        *,
        model_fn: ModelFn | None = None,
    ):
        self.name = name
        self.input_shape = tuple(int(v) for v in input_shape)
        self.num_classes = int(num_classes)
        self.kwargs = dict(kwargs or {})
        self.model_fn = model_fn

    @classmethod
    def from_model_fn(
        cls,
        model: ModelFn | nn.Module | ModelSpec,
        *,
        name: str | None = None,
        input_shape: Sequence[int] = (),
        num_classes: int = 0,
    ) -> ModelSpec:
        """A spec from what a user has: a factory, a template module (deep-copied at every
        build) or a spec (returned as is). ``name`` defaults to the class name of the built
        network."""
        if isinstance(model, ModelSpec):
            return model
        if isinstance(model, nn.Module):
            template = model

            def model_fn() -> nn.Module:
                return copy.deepcopy(template)
            built = template
        elif callable(model):
            model_fn = model
            with torch.device("meta"):  # the class name only: no memory
                built = model_fn()
            if not isinstance(built, nn.Module):
                raise TypeError(f"model_fn() must return an nn.Module, got {type(built).__name__}")
        else:
            raise TypeError("pass a model factory (model_fn() -> nn.Module), an nn.Module or a "
                            f"ModelSpec; got {type(model).__name__}")
        return cls(name or type(built).__name__, input_shape, num_classes, model_fn=model_fn)

    @property
    def is_zoo(self) -> bool:
        return self.model_fn is None

    def build(self, state: Mapping[str, np.ndarray | torch.Tensor] | None = None) -> nn.Module:
        """A fresh network (in eval mode), loaded with ``state`` when given.

        Its initial weights come from a fork of torch's global RNG: the caller's RNG does not
        advance (the server builds networks only to load weights into them). Seed the global
        RNG first for a given random init."""
        with torch.random.fork_rng(devices=[]):
            if self.model_fn is None:
                model = build_model(self.name, self.input_shape, self.num_classes, **self.kwargs)
            else:
                model = self.model_fn(**self.kwargs)
        if state is not None:
            load_state_arrays(model, state)
        return model.eval()

    def variant(self, name: str, kwargs: Mapping[str, Any]) -> ModelSpec:
        """The spec of architecture ``name(**kwargs)`` built the way this one is (the same zoo
        input shape, or the same factory). Raises ValueError for a name the factory is not."""
        if (name, dict(kwargs)) == (self.name, self.kwargs):
            return self
        if self.model_fn is not None and name != self.name:
            raise ValueError(f"architecture {name!r} is unknown to this server, which builds "
                             f"{self.name!r} from its model_fn")
        return ModelSpec(name, self.input_shape, self.num_classes, kwargs, model_fn=self.model_fn)

    def param_shapes(self) -> StateLayout:
        """The ``state_dict``'s layout (``{name: shape}``, and which entries are parameters,
        buffers, Linear/Conv2d weights), built on the meta device (no memory)."""
        return _param_shapes(self)

    def same_architecture(self, name: str, kwargs: Mapping[str, Any]) -> bool:
        return name == self.name and dict(kwargs) == self.kwargs

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ModelSpec) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def _key(self) -> tuple[Any, ...]:
        return (self.name, self.input_shape, self.num_classes,
                json.dumps(self.kwargs, sort_keys=True, default=str), self.model_fn)

    def __repr__(self) -> str:
        kind = "zoo" if self.is_zoo else "model_fn"
        return f"ModelSpec({self.name!r}, {kind}, kwargs={self.kwargs})"

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "input_shape": list(self.input_shape),
            "num_classes": self.num_classes,
            "kwargs": self.kwargs,
            "zoo": self.is_zoo,
        }

    @classmethod
    def from_dict(cls, spec: Mapping[str, Any], model_fn: ModelFn | None = None) -> ModelSpec:
        """Inverse of :meth:`to_dict`; a spec saved from a ``model_fn`` needs it back."""
        if not spec.get("zoo", True) and model_fn is None:
            raise ValueError(f"this predictor's model {spec['name']!r} was built by a user "
                             "model_fn: pass model_fn= to rebuild it")
        return cls(spec["name"], spec["input_shape"], spec["num_classes"], spec.get("kwargs"),
                   model_fn=None if spec.get("zoo", True) else model_fn)


@functools.lru_cache(maxsize=128)
def _param_shapes(spec: ModelSpec) -> StateLayout:
    with torch.device("meta"):
        net = spec.build()
    return StateLayout.of(net)
