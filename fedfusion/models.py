"""Model zoo and registry.

Every model maps a batch of images ``[B, C, H, W]`` to logits ``[B, num_classes]``.
The FedBEns models (LeNet, CNN) have no bias and no BatchNorm, exactly as in the
FedBEns / FedFisher reference code, so that every parameter is a weight matrix and
Kronecker-factored curvature applies to all of them.

Add a model with :func:`register_model`; build one with :func:`build_model`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import nn

ModelFactory = Callable[..., nn.Module]
_REGISTRY: dict[str, ModelFactory] = {}


def register_model(name: str) -> Callable[[ModelFactory], ModelFactory]:
    """Register a model factory under ``name`` (decorator)."""

    def decorator(factory: ModelFactory) -> ModelFactory:
        if name in _REGISTRY:
            raise ValueError(f"model {name!r} is already registered")
        _REGISTRY[name] = factory
        return factory

    return decorator


def available_models() -> list[str]:
    return sorted(_REGISTRY)


def build_model(
    name: str,
    input_shape: tuple[int, int, int],
    num_classes: int,
    **kwargs: object,
) -> nn.Module:
    """Instantiate the registered model ``name`` for the given input shape."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown model {name!r}; available: {', '.join(available_models())}")
    return _REGISTRY[name](input_shape=tuple(input_shape), num_classes=num_classes, **kwargs)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _conv_out(size: int, kernel: int, pool: int = 2) -> int:
    return (size - kernel + 1) // pool


@register_model("lenet")
class LeNet(nn.Module):
    """Bias-free LeNet-5: conv5(C->6), pool, conv5(6->16), pool, fc 256->120->84->K.

    44,190 parameters on 1x28x28 inputs.
    """

    def __init__(self, input_shape: tuple[int, int, int] = (1, 28, 28), num_classes: int = 10):
        super().__init__()
        channels, height, _ = input_shape
        side = _conv_out(_conv_out(height, 5), 5)
        self.features = nn.Sequential(
            nn.Conv2d(channels, 6, 5, bias=False),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(6, 16, 5, bias=False),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
        )
        self.classifier = nn.Sequential(
            nn.Linear(16 * side * side, 120, bias=False),
            nn.ReLU(),
            nn.Linear(120, 84, bias=False),
            nn.ReLU(),
            nn.Linear(84, num_classes, bias=False),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


@register_model("cnn")
class CNN(nn.Module):
    """Bias-free CNN of Wang et al. (2020): conv5(C->32), pool, conv5(32->64), pool,
    fc 1600->512->128->K. 939,616 parameters on 3x32x32 inputs."""

    def __init__(self, input_shape: tuple[int, int, int] = (3, 32, 32), num_classes: int = 10):
        super().__init__()
        channels, height, _ = input_shape
        side = _conv_out(_conv_out(height, 5), 5)
        self.features = nn.Sequential(
            nn.Conv2d(channels, 32, 5, bias=False),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 5, bias=False),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
        )
        self.classifier = nn.Sequential(
            nn.Linear(64 * side * side, 512, bias=False),
            nn.ReLU(),
            nn.Linear(512, 128, bias=False),
            nn.ReLU(),
            nn.Linear(128, num_classes, bias=False),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


@register_model("mlp")
class MLP(nn.Module):
    """MLP with ``hidden_layers`` ReLU layers of width ``hidden`` (AMS paper, Table 4).

    ``hidden_sizes`` (a list of widths, one per hidden layer) overrides ``hidden_layers`` and
    ``hidden``: layers of different widths, e.g. the wider global model PFNM builds.
    ``bias`` defaults to False, as the AMS paper's analysis (Sec. 3) uses bias-free MLPs.
    Parameters are ``net.{2i+1}.weight`` (and ``.bias``) for the i-th Linear layer.
    """

    def __init__(
        self,
        input_shape: tuple[int, int, int] = (1, 28, 28),
        num_classes: int = 10,
        hidden_layers: int = 2,
        hidden: int = 100,
        bias: bool = False,
        hidden_sizes: Sequence[int] | None = None,
    ):
        super().__init__()
        if hidden_sizes is None:
            if hidden_layers < 0 or hidden < 1:
                raise ValueError("mlp needs hidden_layers >= 0 and hidden >= 1")
            hidden_sizes = [hidden] * hidden_layers
        elif not all(isinstance(w, int) and not isinstance(w, bool) and w >= 1
                     for w in hidden_sizes):
            raise ValueError(f"mlp hidden_sizes must be a list of ints >= 1, got {hidden_sizes!r}")
        layers: list[nn.Module] = [nn.Flatten()]
        width = math.prod(input_shape)
        for size in hidden_sizes:
            layers += [nn.Linear(width, size, bias=bias), nn.ReLU()]
            width = size
        layers.append(nn.Linear(width, num_classes, bias=bias))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


@register_model("convnet")
class ConvNet(nn.Module):
    """3 conv + 2 fc ConvNet of the AMS paper (CIFAR-10): conv3(C->32), pool,
    conv3(32->64), pool, conv3(64->64), fc ->64 -> K, ReLU activations."""

    def __init__(self, input_shape: tuple[int, int, int] = (3, 32, 32), num_classes: int = 10):
        super().__init__()
        channels, height, _ = input_shape
        side = _conv_out(_conv_out(height, 3), 3, pool=2) - 2
        if side < 1:
            raise ValueError(f"convnet needs inputs of at least 18x18, got {input_shape}")
        self.features = nn.Sequential(
            nn.Conv2d(channels, 32, 3),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(64, 64, 3),
            nn.ReLU(),
            nn.Flatten(),
        )
        self.classifier = nn.Sequential(
            nn.Linear(64 * side * side, 64),
            nn.ReLU(),
            nn.Linear(64, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))
