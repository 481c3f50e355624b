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
