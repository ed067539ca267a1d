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


class _TwoConvNet(nn.Module):
    """Bias-free conv5(C->c1), ReLU, pool2, conv5(c1->c2), ReLU, pool2, then
    fc ->f1->f2->K with ReLUs (``widths`` = (c1, c2, f1, f2)): LeNet's and CNN's shape."""

    def __init__(self, name: str, input_shape: tuple[int, int, int], num_classes: int,
                 widths: tuple[int, int, int, int]):
        super().__init__()
        channels, height, width = _image_input(name, input_shape)
        _check_classes(name, num_classes)
        c1, c2, f1, f2 = widths
        sides = [_conv_side(name, input_shape, _conv_out(_conv_out(side, 5), 5), 16)
                 for side in (height, width)]
        self.features = nn.Sequential(
            nn.Conv2d(channels, c1, 5, bias=False),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(c1, c2, 5, bias=False),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
        )
        self.classifier = nn.Sequential(
            nn.Linear(c2 * sides[0] * sides[1], f1, bias=False),
            nn.ReLU(),
            nn.Linear(f1, f2, bias=False),
            nn.ReLU(),
            nn.Linear(f2, num_classes, bias=False),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


@register_model("lenet")
class LeNet(_TwoConvNet):
    """Bias-free LeNet-5: conv5(C->6), pool, conv5(6->16), pool, fc 256->120->84->K.

    44,190 parameters on 1x28x28 inputs.
    """

    def __init__(self, input_shape: tuple[int, int, int] = (1, 28, 28), num_classes: int = 10):
        super().__init__("lenet", input_shape, num_classes, (6, 16, 120, 84))


@register_model("cnn")
class CNN(_TwoConvNet):
    """Bias-free CNN of Wang et al. (2020): conv5(C->32), pool, conv5(32->64), pool,
    fc 1600->512->128->K. 939,616 parameters on 3x32x32 inputs."""

    def __init__(self, input_shape: tuple[int, int, int] = (3, 32, 32), num_classes: int = 10):
        super().__init__("cnn", input_shape, num_classes, (32, 64, 512, 128))


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
        channels, height, width = _image_input("convnet", input_shape)
        _check_classes("convnet", num_classes)
        sides = [_conv_side("convnet", input_shape, _conv_out(_conv_out(side, 3), 3) - 2, 18)
                 for side in (height, width)]
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
            nn.Linear(64 * sides[0] * sides[1], 64),
            nn.ReLU(),
            nn.Linear(64, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


# --- models with normalisation layers (BatchNorm buffers, LayerNorm) and residual blocks ----
# None of them is a plain chain of conv/linear/ReLU/pool stages, so fedfusion.accel.stacked does not
# trace them (BatchNorm has buffers; LayerNorm and residual additions are stages it does not
# know) and fedfusion.training.train_members trains them one by one with train_local, which
# puts them in train mode for the steps and back in eval mode after.

#: the widest ``bn_cnn`` (its second conv has ``2 * width`` channels)
MAX_BN_CNN_WIDTH = MAX_CHANNELS // 2
#: the widest ``resnet20`` (its last stage has ``64 * width`` channels)
MAX_RESNET_WIDTH = MAX_CHANNELS // 64
#: BasicBlocks per stage of ``resnet20`` (depth ``6 * blocks + 2``: 64 is a ResNet-386)
MAX_RESNET_BLOCKS = 64
RESNET_NORMS = ("batch", "none")


def _check_width(model: str, width: object, high: int) -> int:
    return check_int(model, "width", width, 1, high)


@register_model("bn_cnn")
class BNCNN(nn.Module):
    """Small BatchNorm CNN: conv3(C->w, pad 1, no bias)-BN-ReLU-pool, conv3(w->2w, pad 1,
    no bias)-BN-ReLU-pool, fc (2w * H/4 * W/4)->128 (bias), ReLU, fc 128->K (bias).

    ``width`` w (default 32, at most :data:`MAX_BN_CNN_WIDTH`) scales the channels; inputs of
    at least 4x4. Parameters (w = 32, K = 10): 421,738 on 1x28x28, 545,194 on 3x32x32 (of
    them 192 BatchNorm affine weights; BatchNorm also keeps 192 running statistics and two
    ``num_batches_tracked`` counters as buffers).
    """

    def __init__(self, input_shape: tuple[int, int, int] = (1, 28, 28), num_classes: int = 10,
                 width: int = 32):
        super().__init__()
        channels, height, side_w = _image_input("bn_cnn", input_shape)
        _check_classes("bn_cnn", num_classes)
        width = _check_width("bn_cnn", width, MAX_BN_CNN_WIDTH)
        _conv_side("bn_cnn", input_shape, min(height, side_w) // 4, 4)
        self.features = nn.Sequential(
            nn.Conv2d(channels, width, 3, padding=1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, 3, padding=1, bias=False),
            nn.BatchNorm2d(2 * width),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
        )
        self.classifier = nn.Sequential(
            nn.Linear(2 * width * (height // 4) * (side_w // 4), 128),
            nn.ReLU(),
            nn.Linear(128, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


class BasicBlock(nn.Module):
    """ResNet basic block: conv3(stride s)-norm-ReLU-conv3-norm, plus the shortcut (identity,
    or conv1(stride s)-norm where the shape changes), then ReLU. ``norm=False``: no norm
    layers and convolutions with biases."""

    def __init__(self, in_channels: int, out_channels: int, stride: int, norm: bool):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride, 1, bias=not norm)
        self.norm1 = nn.BatchNorm2d(out_channels) if norm else nn.Identity()
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, 1, 1, bias=not norm)
        self.norm2 = nn.BatchNorm2d(out_channels) if norm else nn.Identity()
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride, bias=not norm),
                nn.BatchNorm2d(out_channels) if norm else nn.Identity(),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.norm1(self.conv1(x)))
        out = self.norm2(self.conv2(out))
        return torch.relu(out + self.shortcut(x))


@register_model("resnet20")
class ResNet20(nn.Module):
    """ResNet-20 of He et al. (2016) for CIFAR: conv3(C->16w)-norm-ReLU, three stages of
    ``blocks`` :class:`BasicBlock` s with 16w, 32w, 64w channels (stride 2 at the first block
    of stages 2 and 3; a 1x1 conv + norm projection shortcut where the shape changes), global
    average pool, fc 64w->K (bias). Depth ``6 * blocks + 2``; any input size (28x28 and 32x32
    alike: the global pool takes the 7x7 or 8x8 maps).

    ``norm="batch"`` (default): BatchNorm after every conv, convs without bias, Kaiming
    (fan-out) init as torchvision's ResNets. ``norm="none"``: the variant without
    normalisation of the FedBEns paper (appendix C.10): no norm layers, convs with biases;
    so that it trains without them it is initialised as Fixup (Zhang et al. 2019), less
    Fixup's scalar biases and multipliers: Kaiming (fan-in) convs, the first conv of each
    block's residual branch scaled by ``(3 * blocks) ** -0.5`` and the second zero, zero
    biases, so every block starts as its shortcut and the signal's scale does not grow with
    depth.

    ``width`` w (default 1, at most :data:`MAX_RESNET_WIDTH`), ``blocks`` (default 3, at most
    :data:`MAX_RESNET_BLOCKS`). Parameters (K = 10, the same for 28x28 and 32x32 inputs):

    ======  =====  ================  =================
    norm    width  1 input channel   3 input channels
    ======  =====  ================  =================
    batch   1      272,186           272,474
    none    1      271,402           271,690
    batch   4      4,326,602         4,327,754
    none    4      4,323,466         4,324,618
    ======  =====  ================  =================
    """

    def __init__(self, input_shape: tuple[int, int, int] = (3, 32, 32), num_classes: int = 10,
                 norm: str = "batch", width: int = 1, blocks: int = 3):
        super().__init__()
        channels, _, _ = _image_input("resnet20", input_shape)
        _check_classes("resnet20", num_classes)
        if not isinstance(norm, str) or norm not in RESNET_NORMS:
            raise ValueError(f"resnet20: norm must be one of {', '.join(RESNET_NORMS)}, got "
                             f"{norm!r:.60}")
        width = _check_width("resnet20", width, MAX_RESNET_WIDTH)
        blocks = check_int("resnet20", "blocks", blocks, 1, MAX_RESNET_BLOCKS)
        use_norm = norm == "batch"
        stem = 16 * width
        self.stem = nn.Sequential(
            nn.Conv2d(channels, stem, 3, 1, 1, bias=not use_norm),
            nn.BatchNorm2d(stem) if use_norm else nn.Identity(),
            nn.ReLU(),
        )
        stages: list[nn.Module] = []
        in_channels = stem
        for stage, out_channels in enumerate((16 * width, 32 * width, 64 * width)):
            stage_blocks = []
            for block in range(blocks):
                stride = 2 if stage > 0 and block == 0 else 1
                stage_blocks.append(BasicBlock(in_channels, out_channels, stride, use_norm))
                in_channels = out_channels
            stages.append(nn.Sequential(*stage_blocks))
        self.stages = nn.Sequential(*stages)
        self.pool = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.fc = nn.Linear(in_channels, num_classes)
        self._initialise(use_norm, 3 * blocks)

    def _initialise(self, use_norm: bool, num_blocks: int) -> None:
        with torch.no_grad():
            for module in self.modules():
                if isinstance(module, nn.Conv2d):
                    if use_norm:
                        nn.init.kaiming_normal_(module.weight, mode="fan_out",
                                                nonlinearity="relu")
                    else:
                        nn.init.kaiming_normal_(module.weight, mode="fan_in",
                                                nonlinearity="relu")
                    if module.bias is not None:
                        nn.init.zeros_(module.bias)
            if not use_norm:
                for module in self.modules():
                    if isinstance(module, BasicBlock):
                        module.conv1.weight.mul_(num_blocks ** -0.5)
                        nn.init.zeros_(module.conv2.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.pool(self.stages(self.stem(x))))


@register_model("ln_mlp")
class LNMLP(nn.Module):
    """MLP with LayerNorm: flatten, ``layers`` x [Linear(->width, bias)-LayerNorm-ReLU],
    Linear(->K, bias). ``width`` default 128 (at most :data:`MAX_MLP_WIDTH`), ``layers``
    default 2 (0 to :data:`MAX_MLP_LAYERS`; 0 = one Linear layer). Parameters (defaults,
    K = 10): 118,794 on 1x28x28, 411,658 on 3x32x32. No buffers."""

    def __init__(self, input_shape: tuple[int, int, int] = (1, 28, 28), num_classes: int = 10,
                 width: int = 128, layers: int = 2):
        super().__init__()
        if not isinstance(input_shape, Sequence) or not 1 <= len(input_shape) <= 4:
            raise ValueError(f"ln_mlp: input_shape must be 1 to 4 sizes, got "
                             f"{input_shape!r:.60}")
        for size in input_shape:
            check_int("ln_mlp", "input size", size, 1, MAX_INPUT_FEATURES)
        features = check_int("ln_mlp", "input features", math.prod(input_shape), 1,
                             MAX_INPUT_FEATURES)
        _check_classes("ln_mlp", num_classes)
        width = _check_width("ln_mlp", width, MAX_MLP_WIDTH)
        check_int("ln_mlp", "layers", layers, 0, MAX_MLP_LAYERS)
        modules: list[nn.Module] = [nn.Flatten()]
        for _ in range(layers):
            modules += [nn.Linear(features, width), nn.LayerNorm(width), nn.ReLU()]
            features = width
        modules.append(nn.Linear(features, num_classes))
        self.net = nn.Sequential(*modules)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


#: the widest ``vit`` / ``token_transformer`` embedding, their encoder layers and heads
MAX_TRANSFORMER_DIM = 4096
MAX_TRANSFORMER_LAYERS = 64
MAX_TOKENS = 65536
MAX_VOCAB = 2**24


class _Encoder(nn.Module):
    """A learned position ``nn.Parameter``, ``layers`` pre-norm ``nn.TransformerEncoderLayer``
    (no dropout, GELU, feed-forward ``2 * dim``), LayerNorm, mean over tokens, Linear head."""

    def __init__(self, model: str, tokens: int, num_classes: int, dim: object, heads: object,
                 layers: object):
        super().__init__()
        dim = check_int(model, "dim", dim, 1, MAX_TRANSFORMER_DIM)
        heads = check_int(model, "heads", heads, 1, dim)
        if dim % heads:
            raise ValueError(f"{model}: dim ({dim}) must be a multiple of heads ({heads})")
        layers = check_int(model, "layers", layers, 1, MAX_TRANSFORMER_LAYERS)
        self.position = nn.Parameter(torch.zeros(1, tokens, dim))
        nn.init.normal_(self.position, std=0.02)
        layer = nn.TransformerEncoderLayer(dim, heads, dim_feedforward=2 * dim, dropout=0.0,
                                           activation="gelu", batch_first=True,
                                           norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.encoder(tokens + self.position)).mean(dim=1))


@register_model("vit")
class ViT(nn.Module):
    """Small vision transformer: a Conv2d patch embedding (``patch`` x ``patch``, stride
    ``patch``, C -> ``dim``), a learned position embedding, ``layers`` pre-norm encoder layers
    (``nn.TransformerEncoderLayer``: ``nn.MultiheadAttention`` with ``heads`` heads, GELU
    feed-forward of ``2 * dim``, no dropout), LayerNorm, the mean over patches, Linear(->K).
    Defaults ``patch`` 7, ``dim`` 64, ``heads`` 4, ``layers`` 2: 16 patches and 71,946
    parameters on 1x28x28 (K = 10). Height and width must be multiples of ``patch``."""

    def __init__(self, input_shape: tuple[int, int, int] = (1, 28, 28), num_classes: int = 10,
                 patch: int = 7, dim: int = 64, heads: int = 4, layers: int = 2):
        super().__init__()
        channels, height, width = _image_input("vit", input_shape)
        _check_classes("vit", num_classes)
        patch = check_int("vit", "patch", patch, 1, min(height, width))
        if height % patch or width % patch:
            raise ValueError(f"vit: input height and width ({height}x{width}) must be "
                             f"multiples of patch ({patch})")
        tokens = check_int("vit", "patches", (height // patch) * (width // patch), 1, MAX_TOKENS)
        dim = check_int("vit", "dim", dim, 1, MAX_TRANSFORMER_DIM)
        self.embed = nn.Conv2d(channels, dim, patch, stride=patch)
        self.encoder = _Encoder("vit", tokens, num_classes, dim, heads, layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.encoder(self.embed(x).flatten(2).transpose(1, 2))


@register_model("token_transformer")
class TokenTransformer(nn.Module):
    """A transformer over integer tokens, the shape of a text model: ``nn.Embedding(vocab,
    dim)`` of each of the ``length`` tokens (``input_shape = (length,)``, int64 ids in
    ``0..vocab-1``), a learned position embedding, ``layers`` pre-norm encoder layers as in
    :class:`ViT`, LayerNorm, the mean over tokens, Linear(->K). Defaults ``vocab`` 17 (the
    digits data set's 0..16 intensities), ``dim`` 32, ``heads`` 4, ``layers`` 1: 11,530
    parameters for 64 tokens (K = 10)."""

    def __init__(self, input_shape: tuple[int, ...] = (64,), num_classes: int = 10,
                 vocab: int = 17, dim: int = 32, heads: int = 4, layers: int = 1):
        super().__init__()
        if not isinstance(input_shape, Sequence) or len(input_shape) != 1:
            raise ValueError(f"token_transformer: input_shape must be (length,), got "
                             f"{input_shape!r:.60}")
        length = check_int("token_transformer", "length", input_shape[0], 1, MAX_TOKENS)
        _check_classes("token_transformer", num_classes)
        vocab = check_int("token_transformer", "vocab", vocab, 1, MAX_VOCAB)
        dim = check_int("token_transformer", "dim", dim, 1, MAX_TRANSFORMER_DIM)
        self.embed = nn.Embedding(vocab, dim)
        self.encoder = _Encoder("token_transformer", length, num_classes, dim, heads, layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.encoder(self.embed(x))
