"""Model zoo and registry.

Every model maps a batch of images ``[B, C, H, W]`` to logits ``[B, num_classes]``.
The FedBEns models (LeNet, CNN) have no bias and no BatchNorm, exactly as in the
FedBEns / FedFisher reference code, so that every parameter is a weight matrix and
Kronecker-factored curvature applies to all of them.

Add a model with :func:`register_model`; build one with :func:`build_model`.

Model kwargs may come from a client's upload or a saved file, so every zoo model checks its
arguments' types and ranges in its constructor, before building a layer (a ValueError naming
the argument and the allowed range): an absurd size is refused in microseconds instead of
allocating, or recursing, until the process dies.
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


#: ranges the zoo models accept
MAX_CLASSES = 100_000
MAX_CHANNELS = 1024
MAX_INPUT_SIDE = 4096
MAX_INPUT_FEATURES = 2**24  # an MLP's flattened input
MAX_MLP_LAYERS = 64
MAX_MLP_WIDTH = 65536


def check_int(model: str, key: str, value: object, low: int, high: int) -> int:
    """``value`` if it is an int (not a bool) in ``low..high``, else a ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        shown = repr(value)
        shown = shown if len(shown) <= 60 else shown[:60] + "..."
        raise ValueError(f"{model}: {key} must be an int in {low}..{high}, got {shown}")
    return value


def _check_classes(model: str, num_classes: object) -> None:
    check_int(model, "num_classes", num_classes, 1, MAX_CLASSES)


def _image_input(model: str, input_shape: object) -> tuple[int, int, int]:
    """``(channels, height, width)``, each in range."""
    if not isinstance(input_shape, Sequence) or len(input_shape) != 3:
        raise ValueError(f"{model}: input_shape must be (channels, height, width), got "
                         f"{input_shape!r:.60}")
    channels, height, width = input_shape
    check_int(model, "input channels", channels, 1, MAX_CHANNELS)
    check_int(model, "input height", height, 1, MAX_INPUT_SIDE)
    check_int(model, "input width", width, 1, MAX_INPUT_SIDE)
    return channels, height, width


def _conv_side(model: str, input_shape: tuple[int, int, int], side: int, least: int) -> int:
    if side < 1:
        raise ValueError(f"{model} needs inputs of at least {least}x{least}, got {input_shape}")
    return side


@register_model("lenet")
class LeNet(nn.Module):
    """Bias-free LeNet-5: conv5(C->6), pool, conv5(6->16), pool, fc 256->120->84->K.

    44,190 parameters on 1x28x28 inputs.
    """

    def __init__(self, input_shape: tuple[int, int, int] = (1, 28, 28), num_classes: int = 10):
        super().__init__()
        channels, height, _ = _image_input("lenet", input_shape)
        _check_classes("lenet", num_classes)
        side = _conv_side("lenet", input_shape, _conv_out(_conv_out(height, 5), 5), 16)
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
        channels, height, _ = _image_input("cnn", input_shape)
        _check_classes("cnn", num_classes)
        side = _conv_side("cnn", input_shape, _conv_out(_conv_out(height, 5), 5), 16)
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
        if not isinstance(input_shape, Sequence) or not 1 <= len(input_shape) <= 4:
            raise ValueError(f"mlp: input_shape must be 1 to 4 sizes, got {input_shape!r:.60}")
        for size in input_shape:
            check_int("mlp", "input size", size, 1, MAX_INPUT_FEATURES)
        check_int("mlp", "input features", math.prod(input_shape), 1, MAX_INPUT_FEATURES)
        _check_classes("mlp", num_classes)
        if not isinstance(bias, bool):
            raise ValueError(f"mlp: bias must be true or false, got {bias!r:.60}")
        if hidden_sizes is None:
            check_int("mlp", "hidden_layers", hidden_layers, 0, MAX_MLP_LAYERS)
            check_int("mlp", "hidden", hidden, 1, MAX_MLP_WIDTH)
            hidden_sizes = [hidden] * hidden_layers
        elif not isinstance(hidden_sizes, list | tuple) or len(hidden_sizes) > MAX_MLP_LAYERS or (
                not all(isinstance(w, int) and not isinstance(w, bool) and 1 <= w <= MAX_MLP_WIDTH
                        for w in hidden_sizes)):
            raise ValueError(f"mlp: hidden_sizes must be a list of ints >= 1 (at most "
                             f"{MAX_MLP_LAYERS} of them, each <= {MAX_MLP_WIDTH}), got "
                             f"{hidden_sizes!r:.60}")
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
        channels, height, _ = _image_input("convnet", input_shape)
        _check_classes("convnet", num_classes)
        side = _conv_side("convnet", input_shape, _conv_out(_conv_out(height, 3), 3, pool=2) - 2,
                          18)
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
