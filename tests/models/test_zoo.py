"""Properties of fededge.models: shapes, seeded construction, trainability, sizes, errors."""

from __future__ import annotations


import pytest
import torch
from torch import nn

from fededge.models import (
    CNN,
    MLP,
    MODELS,
    CifarResNet,
    build_model,
    count_parameters,
    resnet18_cifar,
)


DIGITS, MNIST, CIFAR, TABULAR = (1, 8, 8), (1, 28, 28), (3, 32, 32), (30,)

# Every shape each model is meant to take; (3, 8, 12) checks non-square images.
SHAPES = {
    "mlp": [TABULAR, DIGITS, MNIST, CIFAR],
    "cnn": [DIGITS, MNIST, CIFAR, (3, 8, 12)],
    "cnn-bn": [DIGITS, CIFAR],
    "cnn-fedavg": [DIGITS, MNIST, CIFAR, (3, 8, 12)],
    "resnet18": [CIFAR, MNIST, DIGITS],
    "resnet18-w16": [CIFAR, DIGITS],
}
CASES = [(name, shape) for name in MODELS for shape in SHAPES[name]]


def _inputs(shape: tuple[int, ...], batch: int = 4, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn((batch, *shape), generator=gen)


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    # Randomly initialised tensors only: BN/GN weights start at 1 and biases of norms at 0.
    return {
        k: v
        for k, v in model.state_dict().items()
        if k.endswith("weight") and v.dim() > 1
    }


def test_models_names_every_shape_table_entry() -> None:
    assert set(SHAPES) == set(MODELS)


@pytest.mark.parametrize(("name", "shape"), CASES)
def test_forward_gives_one_finite_logit_per_class(name: str, shape: tuple[int, ...]) -> None:
    model = build_model(name, input_shape=shape, num_classes=7, seed=0)
    out = model(_inputs(shape))
    assert out.shape == (4, 7)
    assert out.dtype == torch.float32
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("name", MODELS)
def test_same_seed_gives_identical_state_and_leaves_global_rng_alone(name: str) -> None:
    before = torch.get_rng_state()
    a = build_model(name, input_shape=CIFAR, num_classes=10, seed=123)
    assert torch.equal(torch.get_rng_state(), before)

    # Advance the global RNG (inside a fork, so other tests see no change) before the
    # second build: a seeded build must not depend on the global state.
    with torch.random.fork_rng(devices=[]):
        torch.rand(1000)
        b = build_model(name, input_shape=CIFAR, num_classes=10, seed=123)

    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_different_seeds_give_different_weights(name: str) -> None:
    a = _weights(build_model(name, input_shape=DIGITS, num_classes=10, seed=1))
    b = _weights(build_model(name, input_shape=DIGITS, num_classes=10, seed=2))
    assert a and a.keys() == b.keys()
    assert all(not torch.equal(a[k], b[k]) for k in a)


def test_different_seeds_give_different_resnet_weights() -> None:
    a = _weights(build_model("resnet18", input_shape=DIGITS, num_classes=10, seed=1))
    b = _weights(build_model("resnet18", input_shape=DIGITS, num_classes=10, seed=2))
    assert all(not torch.equal(a[k], b[k]) for k in a)


def test_unseeded_build_draws_from_global_rng() -> None:
    with torch.random.fork_rng(devices=[]):
        before = torch.get_rng_state()
        build_model("mlp", input_shape=TABULAR, num_classes=3)
        assert not torch.equal(torch.get_rng_state(), before)


@pytest.mark.parametrize(("name", "shape", "lr"), [("mlp", DIGITS, 0.1), ("cnn", DIGITS, 0.05)])
def test_sgd_on_a_fixed_batch_reduces_the_loss(
    name: str, shape: tuple[int, ...], lr: float
) -> None:
    # A learnable batch: each class has its own mean image, plus noise.
    gen = torch.Generator().manual_seed(0)
    num_classes, batch = 4, 32
    means = torch.randn((num_classes, *shape), generator=gen)
    y = torch.arange(batch) % num_classes
    x = means[y] + 0.5 * torch.randn((batch, *shape), generator=gen)

    model = build_model(name, input_shape=shape, num_classes=num_classes, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    with torch.no_grad():
        initial = loss_fn(model(x), y).item()
    for _ in range(30):
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    with torch.no_grad():
        final = loss_fn(model(x), y).item()
        accuracy = (model(x).argmax(1) == y).float().mean().item()
    assert final < 0.25 * initial
    assert accuracy == 1.0


def test_resnet18_has_the_cifar_parameter_count() -> None:
    model = build_model("resnet18", input_shape=CIFAR, num_classes=10)
    assert isinstance(model, CifarResNet)
    assert abs(count_parameters(model) - 11_173_962) <= 0.01 * 11_173_962
    # kuangliu/pytorch-cifar's ResNet18 has exactly this many.
    assert count_parameters(model) == 11_173_962


def test_cnn_fedavg_has_the_papers_parameter_count() -> None:
    # McMahan et al. 2017, section 3: "a CNN with two 5x5 convolution layers ... (a total
    # of 1,663,370 parameters)" on MNIST.
    assert count_parameters(build_model("cnn-fedavg", input_shape=MNIST, num_classes=10)) == 1_663_370
    # On CIFAR the fc layer sees 64 x 8 x 8 features: 2,156,490 in all, 97% in one matrix.
    model = build_model("cnn-fedavg", input_shape=CIFAR, num_classes=10)
    assert count_parameters(model) == 2_156_490
    assert model.classifier[1].weight.shape == (512, 4096)


def test_cnn_fedavg_rejects_images_too_small_to_pool_twice() -> None:
    with pytest.raises(ValueError, match="H and W >= 4"):
        build_model("cnn-fedavg", input_shape=(1, 3, 8), num_classes=10)


def test_resnet18_norm_choice_changes_buffers_not_parameters() -> None:
    bn = resnet18_cifar(10)
    gn = resnet18_cifar(10, norm="group", num_groups=2)
    assert count_parameters(bn) == count_parameters(gn)
    assert any("running_mean" in k for k in bn.state_dict())
    assert not any("running" in k for k in gn.state_dict())
    assert any(isinstance(m, nn.GroupNorm) and m.num_groups == 2 for m in gn.modules())
    assert not any(isinstance(m, nn.BatchNorm2d) for m in gn.modules())


def test_resnet18_stem_follows_in_channels() -> None:
    model = build_model("resnet18", input_shape=MNIST, num_classes=10)
    assert model.conv1.in_channels == 1
    assert model.conv1.stride == (1, 1)
    assert not any(isinstance(m, nn.MaxPool2d) for m in model.modules())


def test_cnn_is_small_and_size_independent_of_image_side() -> None:
    digits = build_model("cnn", input_shape=DIGITS, num_classes=10)
    mnist = build_model("cnn", input_shape=MNIST, num_classes=10)
    assert isinstance(digits, CNN)
    assert count_parameters(digits) < 150_000
    assert count_parameters(digits) == count_parameters(mnist)
    assert not list(digits.buffers())


def test_cnn_bn_is_the_cnn_with_batchnorm_after_each_hidden_layer() -> None:
    plain = build_model("cnn", input_shape=DIGITS, num_classes=10, seed=0)
    bn = build_model("cnn-bn", input_shape=DIGITS, num_classes=10, seed=0)
    assert count_parameters(bn) == 94_410 == count_parameters(plain) + 2 * (32 + 64 + 128)
    norms = [m for m in bn.modules() if isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d))]
    assert [m.num_features for m in norms] == [32, 64, 128]
    assert sum(1 for k in bn.state_dict() if k.endswith("num_batches_tracked")) == 3


def test_mlp_is_mcmahan_2nn() -> None:
    model = build_model("mlp", input_shape=MNIST, num_classes=10)
    assert isinstance(model, MLP)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linears] == [
        (784, 200),
        (200, 200),
        (200, 10),
    ]
    assert count_parameters(model) == 199_210


def test_count_parameters_trainable_only_skips_frozen() -> None:
    model = MLP(10, 3, hidden=4)
    total = count_parameters(model)
    first = model.net[1]
    for p in first.parameters():
        p.requires_grad_(False)
    assert count_parameters(model) == total
    assert count_parameters(model, trainable_only=True) == total - (10 * 4 + 4)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"name": "vgg"}, "name must be one of ('mlp', 'cnn', 'cnn-bn', 'cnn-fedavg', 'resnet18', 'resnet18-w16') or resnet18-wN"),
        ({"num_classes": 1}, "num_classes"),
        ({"num_classes": 2.0}, "num_classes"),
        ({"num_classes": True}, "num_classes"),
        ({"input_shape": ()}, "input_shape"),
        ({"input_shape": (1, 0, 8)}, "input_shape"),
        ({"input_shape": (1, 8.0, 8)}, "input_shape"),
        ({"input_shape": "1x8x8"}, "input_shape"),
        ({"input_shape": 64}, "input_shape"),
        ({"seed": -1}, "seed"),
        ({"seed": 1.5}, "seed"),
        ({"name": "cnn", "input_shape": (64,)}, 'use "mlp"'),
        ({"name": "cnn", "input_shape": (8, 8)}, 'or use "mlp"'),
        ({"name": "cnn", "input_shape": (1, 4, 8)}, "H and W >= 8"),
        ({"name": "resnet18", "input_shape": (64,)}, 'use "mlp"'),
    ],
)
def test_bad_arguments_raise_value_error_naming_them(kwargs: dict, needle: str) -> None:
    args = {"name": "cnn", "input_shape": DIGITS, "num_classes": 10, "seed": 0} | kwargs
    name = args.pop("name")
    with pytest.raises(ValueError) as excinfo:
        build_model(name, **args)
    assert needle in str(excinfo.value)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"norm": "layer"}, "norm"),
        ({"norm": "group", "num_groups": 3}, "num_groups"),
        ({"in_channels": 0}, "in_channels"),
        ({"num_classes": 0}, "num_classes"),
    ],
)
def test_bad_resnet_arguments_raise_value_error_naming_them(kwargs: dict, needle: str) -> None:
    args = {"num_classes": 10} | kwargs
    with pytest.raises(ValueError, match=needle):
        resnet18_cifar(**args)


def test_width_reduced_resnet18_keeps_the_architecture() -> None:
    """resnet18-wN is ResNet-18 with N, 2N, 4N and 8N channels: the same tensors by name,
    each conv's channels scaled, and 1/16 of the parameters' order at N = 16."""
    full = build_model("resnet18", input_shape=CIFAR, num_classes=10, seed=0).state_dict()
    narrow = build_model("resnet18-w16", input_shape=CIFAR, num_classes=10, seed=0).state_dict()
    assert list(full) == list(narrow)
    assert narrow["layer4.1.conv2.weight"].shape == (128, 128, 3, 3)
    assert narrow["fc.weight"].shape == (10, 128)
    assert count_parameters(build_model("resnet18-w16", input_shape=CIFAR, num_classes=10)) == 701_466
    assert resnet18_cifar(10, width=8).fc.in_features == 64
    for bad in ("resnet18-w0", "resnet18-w513", "resnet18-wide", "resnet18-w"):
        with pytest.raises(ValueError, match="resnet18-wN"):
            build_model(bad, input_shape=CIFAR, num_classes=10)
    with pytest.raises(ValueError, match="width must be an integer in 1..512"):
        resnet18_cifar(10, width=0)
