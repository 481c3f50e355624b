"""fededge.models: plain-torch models built by name; never imports Flower.

See :func:`build_model` and :data:`MODELS`.
"""

from fededge.models.zoo import (
    CNN,
    FedAvgCNN,
    MLP,
    MODELS,
    BasicBlock,
    CifarResNet,
    build_model,
    count_parameters,
    resnet18_cifar,
)

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
