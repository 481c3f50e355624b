import pytest
import torch
import torch.nn.functional as F

from fededge.clients.train import BatchSampler, evaluate, local_sgd
from fededge.models.zoo import build_model


def _data(n=100, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 1, 8, 8, generator=g)
    y = torch.randint(0, 10, (n,), generator=g)
    return x, y


def test_sampler_is_deterministic_and_resumable():
    a = BatchSampler(50, 8, seed=1, stream=3)
    first = [a.next_batch() for _ in range(10)]
    b = BatchSampler(50, 8, seed=1, stream=3)
    for _ in range(4):
        b.next_batch()
    c = BatchSampler(50, 8, seed=1, stream=3)
    c.load_state_dict(b.state_dict())
    assert all(torch.equal(x, y) for x, y in zip(first[4:], [c.next_batch() for _ in range(6)]))
    other = BatchSampler(50, 8, seed=1, stream=4)
    assert not torch.equal(first[0], other.next_batch())


def test_sampler_covers_each_epoch_without_repeats():
    s = BatchSampler(40, 8, seed=0)
    epoch0 = torch.cat([s.next_batch() for _ in range(5)])
    assert sorted(epoch0.tolist()) == list(range(40))
    assert s.epoch == 0
    s.next_batch()
    assert s.epoch == 1


def test_small_partition_is_one_batch():
    s = BatchSampler(5, 32, seed=0)
    assert sorted(s.next_batch().tolist()) == list(range(5))


def test_local_sgd_equals_a_hand_written_loop():
    x, y = _data()
    m1 = build_model("cnn", input_shape=(1, 8, 8), num_classes=10, seed=0)
    m2 = build_model("cnn", input_shape=(1, 8, 8), num_classes=10, seed=0)
    res = local_sgd(m1, x, y, steps=6, lr=0.05, momentum=0.9, weight_decay=1e-4,
                    sampler=BatchSampler(100, 16, seed=5, stream=2))
    ref = BatchSampler(100, 16, seed=5, stream=2)
    opt = torch.optim.SGD(m2.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    losses = []
    m2.train()
    for _ in range(6):
        idx = ref.next_batch()
        opt.zero_grad()
        loss = F.cross_entropy(m2(x[idx]), y[idx])
        losses.append(loss.item())
        loss.backward()
        opt.step()
    for (k, a), b in zip(m1.state_dict().items(), m2.state_dict().values()):
        assert torch.equal(a, b), k
    assert abs(res.mean_loss - sum(losses) / 6) < 1e-6
    assert res.steps == 6 and res.examples_seen == 96


def test_kept_momentum_buffers_make_two_calls_one_bit_for_bit():
    x, y = _data()
    one = build_model("cnn", input_shape=(1, 8, 8), num_classes=10, seed=0)
    two = build_model("cnn", input_shape=(1, 8, 8), num_classes=10, seed=0)
    fresh = build_model("cnn", input_shape=(1, 8, 8), num_classes=10, seed=0)
    local_sgd(one, x, y, steps=6, lr=0.05, momentum=0.9, sampler=BatchSampler(100, 16, seed=5))
    kept: dict[str, torch.Tensor] = {}
    sampler = BatchSampler(100, 16, seed=5)
    for _ in range(2):
        local_sgd(two, x, y, steps=3, lr=0.05, momentum=0.9, sampler=sampler, momentum_buffers=kept)
    sampler = BatchSampler(100, 16, seed=5)
    for _ in range(2):  # buffers restarted at the second call: a different model
        local_sgd(fresh, x, y, steps=3, lr=0.05, momentum=0.9, sampler=sampler)
    names = [n for n, p in two.named_parameters()]
    assert sorted(kept) == sorted(names)
    for (k, a), b, c in zip(one.state_dict().items(), two.state_dict().values(), fresh.state_dict().values()):
        assert torch.equal(a, b), k
    assert any(not torch.equal(a, c) for a, c in zip(one.state_dict().values(), fresh.state_dict().values()))
    # The dict holds copies: the next call starts from them without having aliased them.
    saved = {k: v.clone() for k, v in kept.items()}
    local_sgd(two, x, y, steps=1, lr=0.05, momentum=0.9, sampler=sampler, momentum_buffers=dict(saved))
    assert all(torch.equal(saved[k], kept[k]) for k in kept)


def test_a_momentum_buffer_of_another_shape_is_refused_by_name():
    x, y = _data()
    m = build_model("cnn", input_shape=(1, 8, 8), num_classes=10, seed=0)
    name, p = next(iter(m.named_parameters()))
    try:
        local_sgd(m, x, y, steps=1, lr=0.05, momentum=0.9, sampler=BatchSampler(100, 16, seed=5),
                  momentum_buffers={name: torch.zeros(p.numel() + 1)})
    except ValueError as err:
        assert name in str(err) and "another model" in str(err)
    else:
        raise AssertionError("a buffer of the wrong shape was accepted")


def test_proximal_term_pulls_towards_received_weights():
    x, y = _data()
    base = build_model("mlp", input_shape=(1, 8, 8), num_classes=10, seed=0)
    start = [p.detach().clone() for p in base.parameters()]

    def drift(mu):
        m = build_model("mlp", input_shape=(1, 8, 8), num_classes=10, seed=0)
        local_sgd(m, x, y, steps=20, lr=0.1, sampler=BatchSampler(100, 16, seed=0), proximal_mu=mu)
        return sum(float((p.detach() - s).pow(2).sum()) for p, s in zip(m.parameters(), start))

    assert drift(10.0) < 0.5 * drift(0.0)


def test_evaluate_counts_correct_predictions():
    class Fixed(torch.nn.Module):
        def forward(self, x):
            return torch.nn.functional.one_hot(x[:, 0].long(), 3).float() * 10

    x = torch.tensor([[0.0], [1.0], [2.0], [1.0]])
    y = torch.tensor([0, 1, 1, 1])
    loss, acc = evaluate(Fixed(), x, y)
    assert acc == 0.75
    assert loss > 0


def test_sgd_step_is_torch_sgd_bit_for_bit_without_momentum_and_with_unused_parameters():
    from fededge.clients.train import sgd_step

    g = torch.Generator().manual_seed(3)
    ours = [torch.randn(5, 3, generator=g, requires_grad=True), torch.randn(4, generator=g, requires_grad=True)]
    theirs = [p.detach().clone().requires_grad_(True) for p in ours]
    for momentum, wd in ((0.0, 0.0), (0.9, 0.0), (0.5, 1e-3)):
        buffers = [None, None]
        opt = torch.optim.SGD(theirs, lr=0.1, momentum=momentum, weight_decay=wd)
        for step in range(4):
            for params in (ours, theirs):
                for p in params:
                    p.grad = None
                # the second parameter gets no gradient on odd steps: both skip it
                loss = (params[0] ** 2).sum() + (0 if step % 2 else (params[1] ** 3).sum())
                loss.backward()
            sgd_step(ours, buffers, lr=0.1, momentum=momentum, weight_decay=wd)
            opt.step()
            assert all(torch.equal(a, b) for a, b in zip(ours, theirs)), (momentum, wd, step)


@pytest.mark.parametrize("momentum,wd", [(0.0, 0.0), (0.9, 0.0), (0.5, 1e-3)])
def test_sgd_step_foreach_is_torch_sgd_foreach_bit_for_bit(momentum, wd):
    """The multi-tensor form (torch's default on a GPU) against torch.optim.SGD(foreach=
    True), step by step, with a parameter that has no gradient on odd steps (it joins
    the momentum buffers late: the mixed first-step case)."""
    from fededge.clients.train import sgd_step

    g = torch.Generator().manual_seed(4)
    ours = [torch.randn(5, 3, generator=g, requires_grad=True), torch.randn(4, generator=g, requires_grad=True),
            torch.randn(2, 2, generator=g, requires_grad=True)]
    theirs = [p.detach().clone().requires_grad_(True) for p in ours]
    buffers = [None] * 3
    opt = torch.optim.SGD(theirs, lr=0.1, momentum=momentum, weight_decay=wd, foreach=True)
    for step in range(5):
        for params in (ours, theirs):
            for p in params:
                p.grad = None
            loss = (params[0] ** 2).sum() + (params[2] ** 3).sum() + (0 if step % 2 == 0 else (params[1] ** 3).sum())
            loss.backward()
        sgd_step(ours, buffers, lr=0.1, momentum=momentum, weight_decay=wd, foreach=True)
        opt.step()
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs)), (momentum, wd, step)
        if momentum:
            assert all(b is None or torch.equal(b, opt.state[t]["momentum_buffer"]) for b, t in zip(buffers, theirs))


def test_sgd_step_takes_torchs_default_form_by_device(monkeypatch):
    from fededge.clients import train

    seen = []
    monkeypatch.setattr(train, "_sgd_step_foreach", lambda *a, **k: seen.append("foreach"))
    p = torch.zeros(3, requires_grad=True)
    p.grad = torch.ones(3)
    train.sgd_step([p], [None], lr=0.1)  # the CPU: the loop, as torch.optim.SGD's default there
    assert seen == [] and torch.equal(p, torch.full((3,), -0.1))
    monkeypatch.setattr(train, "FOREACH_DEVICE_TYPES", ("cpu",))  # as if the CPU were a GPU
    train.sgd_step([p], [None], lr=0.1)
    assert seen == ["foreach"]
    # parameters of two dtypes (torch would split them by dtype): the loop, the same arithmetic
    q = torch.zeros(2, dtype=torch.float64, requires_grad=True)
    q.grad = torch.ones(2, dtype=torch.float64)
    train.sgd_step([p, q], [None, None], lr=0.1)
    assert seen == ["foreach"] and torch.equal(q, torch.full((2,), -0.1, dtype=torch.float64))


def test_local_training_does_not_import_torch_dynamo():
    # torch.optim's constructors import torch._dynamo (seconds, paid on every message by
    # a SuperNode's fresh flwr-clientapp process); fededge's client path must not.
    import subprocess
    import sys

    code = ("import sys, torch\n"
            "from fededge.clients.train import BatchSampler, local_sgd\n"
            "from fededge.models.zoo import build_model\n"
            "m = build_model('cnn', input_shape=(1, 8, 8), num_classes=10, seed=0)\n"
            "x, y = torch.randn(40, 1, 8, 8), torch.randint(0, 10, (40,))\n"
            "local_sgd(m, x, y, steps=2, lr=0.1, momentum=0.9, weight_decay=1e-4, "
            "sampler=BatchSampler(40, 8, seed=0))\n"
            "print('torch._dynamo' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_scheduled_lr_warmup_cosine_and_step_to_the_number():
    from fededge.clients.train import scheduled_lr

    assert [scheduled_lr(0.4, t, 10, warmup_rounds=4) for t in (1, 2, 3, 4, 5, 10)] == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.4, 0.4], abs=1e-15)
    # cosine: base at the first round after the warm-up, half way at the middle, nearly 0 at the end
    cos = [scheduled_lr(1.0, t, 6, schedule="cosine", warmup_rounds=2) for t in range(1, 7)]
    assert cos[:3] == [0.5, 1.0, 1.0]
    assert abs(cos[4] - 0.5) < 1e-15 and 0 < cos[5] < 0.15
    assert all(a > b for a, b in zip(cos[2:], cos[3:]))
    # step: x0.1 after half the rounds (ceil), x0.01 after three quarters (ceil)
    assert [scheduled_lr(2.0, t, 7, schedule="step") for t in range(1, 8)] == [2.0] * 4 + [0.2, 0.2, 0.02]
    # an asynchronous strategy's version past num_rounds keeps the last rate
    assert scheduled_lr(1.0, 99, 6, schedule="cosine") == scheduled_lr(1.0, 6, 6, schedule="cosine")


def test_scheduled_lr_refuses_what_cannot_work():
    from fededge.clients.train import scheduled_lr

    with pytest.raises(ValueError, match="one of constant, cosine, step; got 'linear'"):
        scheduled_lr(0.1, 1, 5, schedule="linear")
    with pytest.raises(ValueError, match="warmup_rounds < num_rounds"):
        scheduled_lr(0.1, 1, 5, warmup_rounds=5)
    with pytest.raises(ValueError, match="rounds count from 1"):
        scheduled_lr(0.1, 0, 5)


def test_round_lr_reads_the_servers_schedule_and_names_a_missing_key():
    from flwr.app import ConfigRecord

    from fededge.clients.app import round_lr
    from fededge.config import RunConfig
    from fededge.server.runner import train_config

    plain = train_config(RunConfig.from_mapping({}))
    assert set(plain) == {"local-steps", "local-lr", "momentum", "weight-decay", "batch-size"}  # unchanged bytes
    assert round_lr(ConfigRecord({**plain, "server-round": 7}), 1.0) == 0.05
    assert round_lr(ConfigRecord(), 0.3) == 0.3

    conf = train_config(RunConfig.from_mapping({"num-rounds": 8, "lr-schedule": "step", "lr-warmup-rounds": 2}))
    assert [round_lr(ConfigRecord({**conf, "server-round": t}), 1.0) for t in (1, 2, 4, 5, 7)] == \
        pytest.approx([0.025, 0.05, 0.05, 0.005, 0.0005], rel=1e-12)
    with pytest.raises(ValueError, match="no 'server-round'"):
        round_lr(conf, 1.0)


def test_lr_schedule_config_errors_name_the_key_and_the_fix():
    from fededge.config import ConfigError, RunConfig

    with pytest.raises(ConfigError, match="'lr-schedule' must be one of constant, cosine, step"):
        RunConfig.from_mapping({"lr-schedule": "exp"})
    with pytest.raises(ConfigError, match="'lr-warmup-rounds' \\(20\\) must be below 'num-rounds' \\(20\\).*raise num-rounds"):
        RunConfig.from_mapping({"lr-warmup-rounds": 20})
    with pytest.raises(ConfigError, match="'lr-warmup-rounds' must be >= 0"):
        RunConfig.from_mapping({"lr-warmup-rounds": -1})


def test_cnn_bn_refuses_batches_of_one_by_name():
    from fededge.config import ConfigError, RunConfig

    with pytest.raises(ConfigError, match="'cnn-bn' needs batches of at least 2.*batch-size=1.*set both >= 2"):
        RunConfig.from_mapping({"model": "cnn-bn", "batch-size": 1})
    with pytest.raises(ConfigError, match="min-partition-size=1"):
        RunConfig.from_mapping({"model": "cnn-bn", "min-partition-size": 1})
    RunConfig.from_mapping({"model": "cnn", "batch-size": 1})
    # a ResNet-18's last stage is 1x1 on 8x8 digits: the same (it failed in round 1)
    with pytest.raises(ConfigError, match="'resnet18-w4' needs batches of at least 2 .*8x8 digits.*batch-size=1"):
        RunConfig.from_mapping({"model": "resnet18-w4", "dataset": "digits", "batch-size": 1})
    RunConfig.from_mapping({"model": "resnet18-w4", "dataset": "synthetic-images", "batch-size": 1})


def test_a_resnet_on_digits_cannot_train_on_one_example_which_is_why_it_is_refused():
    """The property the refusal rests on: on 8x8 inputs the last stage is 1x1 and
    BatchNorm2d fails on one example; on 32x32 it trains."""
    from fededge.models.zoo import build_model

    for side, fails in ((8, True), (32, False)):
        model = build_model("resnet18-w4", input_shape=(1 if side == 8 else 3, side, side), num_classes=10, seed=0)
        model.train()
        x = torch.zeros(1, 1 if side == 8 else 3, side, side)
        if fails:
            with pytest.raises(ValueError, match="Expected more than 1 value per channel"):
                model(x)
        else:
            model(x)
