"""Plain-torch models for federated experiments, built by name.

Three models cover the usual FL benchmarks:

``"mlp"``
    The "2NN" of McMahan et al. 2017 (*Communication-Efficient Learning of Deep Networks
    from Decentralized Data*): flatten, two hidden layers of 200 units with ReLU, a
    linear classifier. Works on any input shape, including tabular ``(features,)``.
``"cnn"``
    A small two-convolution network for images ``(C, H, W)`` with ``H, W >= 8``: about
    94k parameters for 8x8 digits and 10 classes, the same layout for MNIST and CIFAR.
``"cnn-bn"``
    The same network with BatchNorm after both convolutions and the hidden linear layer
    (94,410 parameters for digits): a small normalised model, like the ResNets of the
    papers, for experiments where normalisation matters (stale gradients).
``"cnn-fedavg"``
    The "CNN" of McMahan et al. 2017: two 5x5 convolutions (32 and 64 channels, each
    followed by 2x2 max-pooling), a 512-unit fully connected layer, a linear classifier;
    1,663,370 parameters for 1x28x28 MNIST, 2,156,490 for 3x32x32 CIFAR. Most of its bytes
    sit in one large matrix, as in real vision models, so it is the model on which
    compression ratios approach their payload limits.
``"resnet18"``
    The CIFAR variant of ResNet-18 (He et al. 2016, *Deep Residual Learning for Image
    Recognition*; layout as in kuangliu/pytorch-cifar): 3x3 stride-1 stem, no max-pool,
    BasicBlocks ``[2, 2, 2, 2]``; 11,173,962 parameters for 3x32x32 and 10 classes.

This module never imports Flower. Models are built on the CPU; move them with ``.to()``.

Examples
--------
>>> import torch
>>> from fededge.models import build_model, count_parameters
>>> model = build_model("cnn", input_shape=(1, 8, 8), num_classes=10, seed=0)
>>> model(torch.zeros(4, 1, 8, 8)).shape
torch.Size([4, 10])
>>> count_parameters(model)
93962
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from typing import Literal

import torch
from torch import nn

__all__ = [
    "MODELS",
    "MLP",
    "CNN",
    "FedAvgCNN",
    "BasicBlock",
    "CifarResNet",
    "resnet18_cifar",
    "build_model",
    "count_parameters",
]

MODELS: tuple[str, ...] = ("mlp", "cnn", "cnn-bn", "cnn-fedavg", "resnet18", "resnet18-w16")
"""Names accepted by :func:`build_model`; ``resnet18-wN`` (N in 1..512) too: see
:func:`resnet_width`."""

_RESNET_WIDTH = re.compile(r"resnet18-w([0-9]+)")


def resnet_width(name: str) -> int | None:
    """The base width of a ResNet-18 name: 64 for ``resnet18``, N for ``resnet18-wN``
    (stages of N, 2N, 4N and 8N channels; 1 <= N <= 512), None for any other name.

    A width-reduced ResNet-18 keeps the architecture (depth, strides, BatchNorm,
    shortcuts), so what a codec does to its layers carries over, at a fraction of the
    compute: ``resnet18-w16`` has 701,466 parameters for 3x32x32 and 10 classes and
    costs about 1/16 of ResNet-18's multiply-adds, a size a CPU trains in minutes.

    >>> resnet_width("resnet18"), resnet_width("resnet18-w16"), resnet_width("cnn")
    (64, 16, None)
    """
    if name == "resnet18":
        return 64
    match = _RESNET_WIDTH.fullmatch(name)
    if match and 1 <= int(match.group(1)) <= 512:
        return int(match.group(1))
    return None


def is_model_name(name: str) -> bool:
    """Whether :func:`build_model` accepts ``name``."""
    return name in MODELS or resnet_width(name) is not None

_NORMS = ("batch", "group")


# ---------------------------------------------------------------------------
# Validation helpers
# ---------------------------------------------------------------------------


def _is_int(value: object) -> bool:
    # bool is an int subclass; True classes or a shape of (True, 8, 8) is a bug upstream.
    return isinstance(value, int) and not isinstance(value, bool)


def _check_num_classes(num_classes: object) -> int:
    if not _is_int(num_classes) or num_classes < 2:  # type: ignore[operator]
        raise ValueError(f"num_classes must be an integer >= 2, got {num_classes!r}")
    return int(num_classes)  # type: ignore[arg-type]


def _check_input_shape(input_shape: object) -> tuple[int, ...]:
    if not isinstance(input_shape, Sequence) or isinstance(input_shape, (str, bytes)):
        raise ValueError(
            "input_shape must be a tuple of positive integers without the batch "
            f"dimension, e.g. (1, 28, 28) or (64,); got {input_shape!r}"
        )
    shape = tuple(input_shape)
    if not shape or not all(_is_int(d) and d >= 1 for d in shape):
        raise ValueError(
            "input_shape must be a non-empty tuple of positive integers without the "
            f"batch dimension, e.g. (1, 28, 28) or (64,); got {input_shape!r}"
        )
    return shape


def _check_image_shape(name: str, shape: tuple[int, ...], *, min_side: int) -> None:
    if len(shape) != 3:
        hint = (
            'for tabular or flat inputs use "mlp"'
            if len(shape) == 1
            else 'add a channel dimension, e.g. (1, H, W), or use "mlp"'
        )
        raise ValueError(
            f'input_shape for "{name}" must be an image shape (C, H, W); got '
            f"{shape} ({len(shape)}-D): {hint}"
        )
    _, height, width = shape
    if height < min_side or width < min_side:
        raise ValueError(
            f'input_shape for "{name}" needs H and W >= {min_side}, got {shape}; '
            'upsample the images or use "mlp"'
        )


# ---------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------


class MLP(nn.Module):
    """Two-hidden-layer perceptron, the "2NN" of McMahan et al. 2017.

    Parameters
    ----------
    in_features : int
        Number of input features after flattening (the product of the input shape).
    num_classes : int
        Number of output logits.
    hidden : int, optional
        Width of both hidden layers. McMahan et al. use 200; larger widths help little on
        MNIST and multiply the bytes each client uploads.

    Examples
    --------
    >>> MLP(64, 10)(torch.zeros(2, 1, 8, 8)).shape
    torch.Size([2, 10])
    """

    def __init__(self, in_features: int, num_classes: int, *, hidden: int = 200) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Flatten(),
            nn.Linear(in_features, hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class CNN(nn.Module):
    """Small CNN for images: two 3x3 convolutions, a max-pool, two linear layers.

    ``conv(C->32) - ReLU - conv(32->64) - ReLU - maxpool 2 - adaptive avg-pool 3x3 -
    fc(576->128) - ReLU - fc(128->num_classes)``. The adaptive pool makes the parameter
    count independent of the image size (93,962 for one channel and 10 classes), so the
    same network, and the same bytes per round, serve 8x8 digits, MNIST and CIFAR. No
    dropout or normalisation by default: the model is deterministic given its weights and
    has no buffers for FedAvg to average.

    With ``batch_norm=True`` (``model = "cnn-bn"``) a BatchNorm layer follows each
    convolution and the hidden linear layer (94,410 parameters for one channel and 10
    classes, and the running statistics as buffers, which FedAvg averages). Normalisation
    makes most weights scale-invariant, which is what lets stale-gradient SGD recover from
    a step too large instead of diverging (docs/algorithms.md, DGA without the correction).

    Parameters
    ----------
    in_channels : int
        Number of input channels (1 for greyscale, 3 for RGB).
    num_classes : int
        Number of output logits.
    batch_norm : bool
        Put BatchNorm after the two convolutions and the hidden linear layer.

    Examples
    --------
    >>> CNN(3, 10)(torch.zeros(2, 3, 32, 32)).shape
    torch.Size([2, 10])
    """

    def __init__(self, in_channels: int, num_classes: int, *, batch_norm: bool = False) -> None:
        super().__init__()

        def norm(layer: nn.Module, channels: int) -> list[nn.Module]:
            return [layer] if not batch_norm else [layer, nn.BatchNorm2d(channels) if isinstance(layer, nn.Conv2d)
                                                   else nn.BatchNorm1d(channels)]

        self.features = nn.Sequential(
            *norm(nn.Conv2d(in_channels, 32, kernel_size=3, padding=1), 32),
            nn.ReLU(),
            *norm(nn.Conv2d(32, 64, kernel_size=3, padding=1), 64),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.AdaptiveAvgPool2d((3, 3)),
        )
        self.classifier = nn.Sequential(
            nn.Flatten(),
            *norm(nn.Linear(64 * 3 * 3, 128), 128),
            nn.ReLU(),
            nn.Linear(128, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


class FedAvgCNN(nn.Module):
    """The CNN of McMahan et al. 2017 (*Communication-Efficient Learning of Deep Networks
    from Decentralized Data*, section 3).

    ``conv5x5(C->32, same) - ReLU - maxpool 2 - conv5x5(32->64, same) - ReLU - maxpool 2 -
    fc(64 * H/4 * W/4 -> 512) - ReLU - fc(512 -> num_classes)``: 1,663,370 parameters for
    1x28x28 inputs and 10 classes, the count the paper gives. No dropout or normalisation.

    Parameters
    ----------
    input_shape : tuple of int
        ``(C, H, W)`` with ``H, W >= 4``; the fully connected layer's width depends on it.
    num_classes : int
        Number of output logits.

    Examples
    --------
    >>> FedAvgCNN((3, 32, 32), 10)(torch.zeros(2, 3, 32, 32)).shape
    torch.Size([2, 10])
    """

    def __init__(self, input_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        c, h, w = input_shape
        self.features = nn.Sequential(
            nn.Conv2d(c, 32, kernel_size=5, padding=2),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(32, 64, kernel_size=5, padding=2),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(64 * (h // 4) * (w // 4), 512),
            nn.ReLU(),
            nn.Linear(512, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


def _norm_layer(norm: str, channels: int, num_groups: int) -> nn.Module:
    if norm == "batch":
        return nn.BatchNorm2d(channels)
    return nn.GroupNorm(num_groups, channels)


class BasicBlock(nn.Module):
    """ResNet basic block: two 3x3 convolutions with a residual connection.

    Parameters
    ----------
    in_planes, planes : int
        Input and output channels.
    stride : int
        Stride of the first convolution; when it is not 1 or the channels change, the
        shortcut is a 1x1 convolution followed by a normalisation layer.
    norm_layer : callable
        ``norm_layer(channels)`` returns the normalisation module.
    """

    expansion = 1

    def __init__(
        self,
        in_planes: int,
        planes: int,
        *,
        stride: int = 1,
        norm_layer: Callable[[int], nn.Module],
    ) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = norm_layer(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=1, padding=1, bias=False)
        self.bn2 = norm_layer(planes)
        self.shortcut: nn.Module = nn.Sequential()
        if stride != 1 or in_planes != planes:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_planes, planes, 1, stride=stride, bias=False),
                norm_layer(planes),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + self.shortcut(x))


class CifarResNet(nn.Module):
    """ResNet for small images: 3x3 stride-1 stem, no max-pool, four stages of blocks.

    Parameters
    ----------
    num_blocks : sequence of 4 ints
        Blocks per stage; ``(2, 2, 2, 2)`` is ResNet-18.
    num_classes : int
        Number of output logits.
    in_channels : int
        Number of input channels.
    norm : {"batch", "group"}
        Normalisation layer; see :func:`resnet18_cifar`.
    num_groups : int
        Groups per GroupNorm layer when ``norm="group"``.
    width : int
        Channels of the first stage (64 in ResNet-18); the stages have width, 2, 4 and 8
        times width.
    """

    def __init__(
        self,
        num_blocks: Sequence[int],
        num_classes: int,
        *,
        in_channels: int = 3,
        norm: Literal["batch", "group"] = "batch",
        num_groups: int = 32,
        width: int = 64,
    ) -> None:
        super().__init__()

        def norm_layer(channels: int) -> nn.Module:
            return _norm_layer(norm, channels, num_groups)

        self.conv1 = nn.Conv2d(in_channels, width, 3, stride=1, padding=1, bias=False)
        self.bn1 = norm_layer(width)
        stages = []
        in_planes = width
        for i, (planes, blocks) in enumerate(zip((width, 2 * width, 4 * width, 8 * width), num_blocks)):
            layers = []
            for j in range(blocks):
                stride = 2 if (i > 0 and j == 0) else 1
                layers.append(
                    BasicBlock(in_planes, planes, stride=stride, norm_layer=norm_layer)
                )
                in_planes = planes
            stages.append(nn.Sequential(*layers))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.pool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(8 * width * BasicBlock.expansion, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.layer4(self.layer3(self.layer2(self.layer1(out))))
        return self.fc(torch.flatten(self.pool(out), 1))


def resnet18_cifar(
    num_classes: int,
    *,
    in_channels: int = 3,
    norm: Literal["batch", "group"] = "batch",
    num_groups: int = 32,
    width: int = 64,
) -> CifarResNet:
    """ResNet-18 for CIFAR-sized images (He et al. 2016; layout of kuangliu/pytorch-cifar).

    3x3 stride-1 stem convolution, no max-pool, BasicBlocks ``[2, 2, 2, 2]`` with 64, 128,
    256 and 512 channels, adaptive average pool, one linear layer: 11,173,962 parameters
    for 3 input channels and 10 classes.

    Parameters
    ----------
    num_classes : int
        Number of output logits (>= 2).
    in_channels : int, optional
        Input channels; 3 for CIFAR.
    norm : {"batch", "group"}, optional
        ``"batch"``: BatchNorm. Its running mean and variance are *buffers*, so they appear
        in ``state_dict()`` and FedAvg averages them like weights, although each client
        computed them on its own (non-IID) data; under strong label skew the averaged
        statistics can match no client, which hurts accuracy. ``"group"``: GroupNorm, no
        running statistics, a common FL alternative (Hsieh et al. 2020, *The Non-IID Data
        Quagmire of Decentralized Machine Learning*). Same parameter count either way.
    num_groups : int, optional
        Groups per GroupNorm layer (ignored for ``"batch"``); must divide ``width``. 32 is
        the default of Wu & He 2018; Hsieh et al. use 2.
    width : int, optional
        Channels of the first stage, 64 in ResNet-18; a smaller width (model name
        ``resnet18-wN``) keeps the architecture at a fraction of the compute.

    Returns
    -------
    CifarResNet

    Examples
    --------
    >>> model = resnet18_cifar(10, norm="group")
    >>> model(torch.zeros(2, 3, 32, 32)).shape
    torch.Size([2, 10])
    """
    num_classes = _check_num_classes(num_classes)
    if not _is_int(in_channels) or in_channels < 1:
        raise ValueError(f"in_channels must be an integer >= 1, got {in_channels!r}")
    if norm not in _NORMS:
        raise ValueError(f"norm must be one of {_NORMS}, got {norm!r}")
    if not _is_int(width) or not 1 <= width <= 512:
        raise ValueError(f"width must be an integer in 1..512, got {width!r}")
    if norm == "group" and (not _is_int(num_groups) or num_groups < 1 or width % num_groups):
        raise ValueError(
            f"num_groups must be a positive divisor of width={width} (e.g. 2 or 32), got {num_groups!r}"
        )
    return CifarResNet(
        (2, 2, 2, 2), num_classes, in_channels=in_channels, norm=norm, num_groups=num_groups, width=width
    )


# ---------------------------------------------------------------------------
# Factory
# ---------------------------------------------------------------------------


def _construct(name: str, shape: tuple[int, ...], num_classes: int) -> nn.Module:
    if name == "mlp":
        return MLP(math.prod(shape), num_classes)
    if name in ("cnn", "cnn-bn"):
        _check_image_shape(name, shape, min_side=8)
        return CNN(shape[0], num_classes, batch_norm=name == "cnn-bn")
    if name == "cnn-fedavg":
        _check_image_shape(name, shape, min_side=4)
        return FedAvgCNN(shape, num_classes)
    # resnet18: three stride-2 stages shrink 8x8 to 1x1; smaller inputs would be all padding.
    _check_image_shape(name, shape, min_side=8)
    return resnet18_cifar(num_classes, in_channels=shape[0], width=resnet_width(name) or 64)


def build_model(
    name: str,
    *,
    input_shape: tuple[int, ...],
    num_classes: int,
    seed: int | None = None,
) -> nn.Module:
    """Build one of :data:`MODELS` for inputs of ``input_shape`` and ``num_classes``.

    Parameters
    ----------
    name : str
        ``"mlp"`` (any input shape), ``"cnn"`` (images ``(C, H, W)``, ``H, W >= 8``),
        ``"cnn-bn"`` (the same CNN with BatchNorm),
        ``"cnn-fedavg"`` (images with ``H, W >= 4``) or
        ``"resnet18"`` (CIFAR ResNet-18 with BatchNorm; for GroupNorm call
        :func:`resnet18_cifar` directly) or ``"resnet18-wN"`` (the same with N channels
        in the first stage instead of 64, e.g. ``"resnet18-w16"``).
    input_shape : tuple of int
        Shape of one example, without the batch dimension: ``(1, 8, 8)`` for digits,
        ``(1, 28, 28)`` for MNIST, ``(3, 32, 32)`` for CIFAR, ``(features,)`` for tables.
    num_classes : int
        Number of output logits (>= 2).
    seed : int or None, optional
        Seed for the initial weights. With a seed the model is built inside
        ``torch.random.fork_rng``, so the same seed gives identical weights and the
        caller's global RNG state is left untouched. Every client and the server can then
        build the same initial model without sending it. ``None`` draws from the global RNG
        as torch does by default.

    Returns
    -------
    torch.nn.Module
        A CPU model in training mode.

    Raises
    ------
    ValueError
        Unknown ``name``, ``num_classes < 2``, a malformed ``input_shape`` or one the
        model cannot take (e.g. a flat shape for ``"cnn"``), or a negative ``seed``.

    Examples
    --------
    >>> a = build_model("mlp", input_shape=(64,), num_classes=10, seed=1)
    >>> b = build_model("mlp", input_shape=(64,), num_classes=10, seed=1)
    >>> all(torch.equal(a.state_dict()[k], b.state_dict()[k]) for k in a.state_dict())
    True
    """
    if not is_model_name(name):
        raise ValueError(f"name must be one of {MODELS} or resnet18-wN (N in 1..512), got {name!r}")
    shape = _check_input_shape(input_shape)
    num_classes = _check_num_classes(num_classes)
    if seed is None:
        return _construct(name, shape, num_classes)
    if not _is_int(seed) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer or None, got {seed!r}")
    # Parameters are initialised on the CPU, so only the CPU generator is seeded (and
    # forked, so the caller's state comes back). torch.manual_seed would also seed every
    # CUDA generator (lazily, if CUDA is not up yet), changing the caller's CUDA RNG.
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)
        return _construct(name, shape, num_classes)


def count_parameters(model: nn.Module, *, trainable_only: bool = False) -> int:
    """Number of parameters in ``model`` (buffers such as BatchNorm statistics excluded).

    Parameters
    ----------
    model : torch.nn.Module
        The model; shared parameters are counted once.
    trainable_only : bool, optional
        Count only parameters with ``requires_grad`` (e.g. when layers are frozen).

    Returns
    -------
    int

    Examples
    --------
    >>> count_parameters(MLP(784, 10))
    199210
    """
    return sum(
        p.numel() for p in model.parameters() if p.requires_grad or not trainable_only
    )
