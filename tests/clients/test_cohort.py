"""Cohort training (fededge/clients/cohort.py) against the per-client path, to float rounding.

Tolerance: a batched matmul rounds differently from C separate ones, so the weights
agree to float32 rounding, not bit for bit. After 10-20 SGD steps on these models the
largest difference seen is ~1e-7; the tests allow ATOL = 1e-5 (absolute and relative) on weights and buffers and
1e-5 relative on the mean loss, far below any difference a wrong step would make (one
step of lr 0.05 moves weights by ~1e-3).
"""

from __future__ import annotations

import copy
import dataclasses
import threading
import time

import pytest
import torch

from fededge.clients import cohort
from fededge.clients.cohort import CohortJob, cohort_refusal, cohort_sgd, local_sgd, run_together
from fededge.clients.train import BatchSampler
from fededge.clients.train import local_sgd as per_client_sgd
from fededge.models.zoo import build_model

ATOL = 1e-5
#: BatchNorm divides by each batch's standard deviation, which amplifies the rounding
#: where a channel's variance is small: 3.2e-5 after 6 steps with torch's scalar kernels
#: (ATEN_CPU_CAPABILITY=default, scripts/test_portable.sh). Still 30x below one step's
#: change; the float64 test holds both paths to 1e-10.
BN_ATOL = 2e-4
#: On CUDA a batched GEMM (cuBLAS) sums in another order than C separate ones: 3.2e-5
#: after 12 steps of the MLP without momentum on an H100 (2026-11-27), where the float64
#: test below held both paths to 1e-10 on the same GPU, so the difference is rounding.
CUDA_ATOL = 1e-4
#: ... and its mean loss over the steps differed by 1.04e-4 relative there (4.43516
#: against 4.43469: a loss that high comes from steps that move the weights far).
CUDA_LOSS_RTOL = 1e-3


@pytest.fixture(autouse=True)
def _no_strict_determinism():
    """A CUDA run earlier in the process (fededge's ClientApp sets ``deterministic``) may
    leave torch's deterministic mode on; these tests compare two paths' arithmetic, and
    strict mode would make a CNN's backward pass raise on CUDA (no deterministic
    adaptive_avg_pool2d kernel). Each test runs with it off, and the mode is put back."""
    mode = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(False)
    yield
    torch.use_deterministic_algorithms(mode[0], warn_only=mode[1])


@pytest.fixture(autouse=True)
def _fresh_timings():
    """Each test sees its groups for the first time (run_together times a group's first
    client alone, once per process)."""
    cohort.reset_measurements()
    yield
    cohort.reset_measurements()


def _clients(sizes, seed=0, shape=(1, 8, 8)):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, *shape, generator=g), torch.randint(0, 10, (n,), generator=g)) for n in sizes]


def _weights(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _per_client(model, start, x, y, sampler, buffers=None, **kw):
    m = copy.deepcopy(model)
    with torch.no_grad():
        for n, p in m.named_parameters():
            p.copy_(start[n])
    res = per_client_sgd(m, x, y, sampler=sampler, momentum_buffers=buffers, **kw)
    return _weights(m), res


CUDA = pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                     reason="no CUDA device here: this case runs on a GPU machine"))


@pytest.mark.parametrize("name", ["mlp", "cnn-bn"])
def test_one_gather_or_one_per_client_give_the_same_cohort(name, monkeypatch):
    """The clients' data laid end to end (one index_select a step) and one gather per
    client (data over GATHER_COPY_BYTES) pick the same rows: the cohorts are equal bit
    for bit, with momentum and weight decay (the stacks updated in place)."""
    model = build_model(name, input_shape=(1, 8, 8), num_classes=10, seed=0)
    data = _clients([40, 75, 120, 33])
    kw = dict(steps=6, lr=0.05, momentum=0.9, weight_decay=5e-4, proximal_mu=0.0)

    def trained(limit):
        monkeypatch.setattr(cohort, "GATHER_COPY_BYTES", limit)
        jobs = [CohortJob(model=model, weights={n: t + 0.01 * c for n, t in _weights(model).items()}, x=x, y=y,
                          sampler=BatchSampler(len(x), 16, seed=7, stream=c), momentum_buffers={}, **kw)
                for c, (x, y) in enumerate(data)]
        cohort_sgd(jobs)
        return jobs

    flat, apart = trained(2**40), trained(0)
    for a, b in zip(flat, apart):
        for n in a.trained:
            assert torch.equal(a.trained[n], b.trained[n])
            assert torch.equal(a.momentum_buffers[n], b.momentum_buffers[n])
        for n in a.trained_buffers:
            assert torch.equal(a.trained_buffers[n], b.trained_buffers[n])
        assert a.result.mean_loss == b.result.mean_loss
        assert a.sampler.state_dict() == b.sampler.state_dict()


@pytest.mark.parametrize("weight_decay", [0.0, 5e-4])
def test_the_fused_update_is_sgd_step(weight_decay, monkeypatch):
    """The cohort's update (torch's fused SGD kernel where it has one, else foreach
    lists) is train.sgd_step's on each client's slice: three steps from a zero buffer,
    to float32 rounding (a fused kernel may contract a multiply and an add)."""
    from fededge.clients.train import sgd_step

    g = torch.Generator().manual_seed(3)
    shapes = [(4, 7, 5), (4, 5)]
    start = [torch.randn(s, generator=g) for s in shapes]
    grads = [[torch.randn(s, generator=g) for s in shapes] for _ in range(3)]
    for fused in (True, False):
        if not fused:
            monkeypatch.delattr(torch, "_fused_sgd_", raising=False)
        p_list = [t.clone() for t in start]
        b_list = [torch.zeros_like(t) for t in start]
        for step in grads:
            cohort._update([t.clone() for t in step], p_list, b_list, lr=0.05, momentum=0.9, weight_decay=weight_decay)
        for c in range(4):
            params = [torch.nn.Parameter(t[c].clone()) for t in start]
            buffers = [None] * len(params)
            for step in grads:
                for p, t in zip(params, step):
                    p.grad = t[c].clone()
                sgd_step(params, buffers, lr=0.05, momentum=0.9, weight_decay=weight_decay)
            for p, q, b, buf in zip(params, p_list, b_list, buffers):
                torch.testing.assert_close(q[c], p.detach(), atol=1e-6, rtol=1e-6)
                torch.testing.assert_close(b[c], buf, atol=1e-6, rtol=1e-6)


def test_the_update_reads_a_strided_gradient_as_it_is():
    """A gradient that is a transposed view (a model of one's own may give one) is
    applied by its values, not by its memory order: torch's CPU fused kernel would read
    the latter, so such lists take the foreach path."""
    g = torch.randn(3, 4, 5).transpose(1, 2)  # [3, 5, 4], not contiguous
    p_list, b_list = [torch.zeros(3, 5, 4)], [torch.zeros(3, 5, 4)]
    cohort._update([g], p_list, b_list, lr=1.0, momentum=0.9, weight_decay=0.0)
    assert torch.equal(p_list[0], -g) and torch.equal(b_list[0], g)


def test_a_failing_fused_kernel_falls_back_to_foreach(monkeypatch):
    """torch before 2.4 has no CPU kernel for fused SGD (it raises at dispatch): the
    update then takes the foreach path, the same numbers, and remembers it."""
    def missing(*args, **kwargs):
        raise NotImplementedError("Could not run 'aten::_fused_sgd_' with arguments from the 'CPU' backend")

    monkeypatch.setattr(torch, "_fused_sgd_", missing, raising=False)
    monkeypatch.setattr(cohort, "_fused_works", {})
    p_list, b_list, g = [torch.zeros(2, 3)], [torch.zeros(2, 3)], torch.randn(2, 3)
    for _ in range(2):
        cohort._update([g], p_list, b_list, lr=0.5, momentum=0.9, weight_decay=0.0)
    assert cohort._fused_works == {"cpu": False}
    torch.testing.assert_close(b_list[0], g * 0.9 + g)
    torch.testing.assert_close(p_list[0], -0.5 * g - 0.5 * (g * 0.9 + g))


def test_a_sampler_row_outside_a_clients_data_is_refused():
    """Laid end to end, an index past a client's data would read its neighbour's rows;
    the gather refuses it, as the per-client index_select would."""
    xs, ys = [torch.zeros(4, 2), torch.ones(6, 2)], [torch.zeros(4, dtype=torch.long), torch.ones(6, dtype=torch.long)]
    with pytest.raises(IndexError, match="outside its data"):
        cohort._Gather(xs, ys, [torch.tensor([[0, 4]]), torch.tensor([[0, 1]])])


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("name", ["mlp", "cnn", "cnn-bn"])
@pytest.mark.parametrize("momentum,weight_decay,mu", [(0.0, 0.0, 0.0), (0.9, 5e-4, 0.0), (0.9, 0.0, 0.1)])
def test_cohort_equals_per_client(name, momentum, weight_decay, mu, device, monkeypatch):
    """Partitions of different sizes, each with its own sampler (some mid-epoch), start
    weights that differ per client: each client's trained weights, loss and sampler
    position are the per-client path's, on the CPU and (where there is one) on CUDA
    (with TF32 off: cuDNN's convolutions use it by default, 1e-3 rounding)."""
    if device == "cuda":
        monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
        monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    model = build_model(name, input_shape=(1, 8, 8), num_classes=10, seed=0).to(device)
    data = [(x.to(device), y.to(device)) for x, y in _clients([40, 75, 120, 33])]
    kw = dict(steps=12, lr=0.05, momentum=momentum, weight_decay=weight_decay, proximal_mu=mu)
    jobs, expected = [], []
    for c, (x, y) in enumerate(data):
        start = {n: t + 0.01 * c for n, t in _weights(model).items()}
        sampler = BatchSampler(len(x), 16, seed=7, stream=c)
        for _ in range(c):  # clients at different places in their epochs
            sampler.next_batch()
        twin = copy.deepcopy(sampler)
        expected.append((*_per_client(model, start, x, y, twin, **kw), twin.state_dict()))
        jobs.append(CohortJob(model=model, weights=start, x=x, y=y, sampler=sampler, momentum_buffers=None, **kw))
    cohort_sgd(jobs)
    tol = BN_ATOL if name == "cnn-bn" else CUDA_ATOL if device == "cuda" else ATOL
    for (w, res, pos), job in zip(expected, jobs):
        for n in w:
            torch.testing.assert_close(job.trained[n], w[n], atol=tol, rtol=tol)
        assert job.result.mean_loss == pytest.approx(res.mean_loss, rel=CUDA_LOSS_RTOL if device == "cuda" else tol)
        assert job.result.steps == res.steps and job.result.examples_seen == res.examples_seen
        assert job.sampler.state_dict() == pos
        assert job.result.compute_s is not None and job.result.compute_s >= 0


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("name", ["mlp", "cnn", "cnn-bn"])
def test_cohort_is_the_per_client_arithmetic_in_float64(name, device):
    """In float64 the rounding differences vanish (1e-16 per operation): the cohort's
    weights and statistics equal the per-client path's to 1e-10 after 20 steps with
    momentum, so every float32 difference the other tests allow is rounding, not a
    different step. (In float32, BatchNorm amplifies the rounding of its variance:
    1e-5 relative after 20 steps, more over rounds with a compressed uplink.)"""
    model = build_model(name, input_shape=(1, 8, 8), num_classes=10, seed=0).double().to(device)
    data = [(x.double().to(device), y.to(device)) for x, y in _clients([100, 150, 120], seed=5)]
    kw = dict(steps=20, lr=0.05, momentum=0.9, weight_decay=1e-4, proximal_mu=0.0)
    jobs, expected = [], []
    for c, (x, y) in enumerate(data):
        m = copy.deepcopy(model)
        start, buffers = _weights(m), {n: b.clone() for n, b in m.named_buffers()}
        per_client_sgd(m, x, y, sampler=BatchSampler(len(x), 32, seed=0, stream=c), **kw)
        expected.append((_weights(m), {n: b.clone() for n, b in m.named_buffers()}))
        jobs.append(CohortJob(model=model, weights=start, buffers=buffers, x=x, y=y,
                              sampler=BatchSampler(len(x), 32, seed=0, stream=c), momentum_buffers=None, **kw))
    cohort_sgd(jobs)
    for (w, buffers), job in zip(expected, jobs):
        for n in w:
            torch.testing.assert_close(job.trained[n], w[n], atol=1e-10, rtol=1e-10)
        for n, b in buffers.items():
            torch.testing.assert_close(job.trained_buffers[n], b, atol=1e-10, rtol=1e-10)


def test_kept_momentum_continues_per_client():
    """keep-momentum: a client with kept buffers continues them, a client without starts
    from its first gradient; the buffers after the last step are the per-client ones."""
    model = build_model("mlp", input_shape=(1, 8, 8), num_classes=10, seed=1)
    data = _clients([50, 60, 70], seed=1)
    start = _weights(model)
    kw = dict(steps=8, lr=0.05, momentum=0.9, weight_decay=0.0, proximal_mu=0.0)
    kept = [{}, {n: torch.randn_like(t) * 0.01 for n, t in start.items()}, {}]
    jobs, expected = [], []
    for c, ((x, y), buffers) in enumerate(zip(data, kept)):
        theirs = {n: t.clone() for n, t in buffers.items()}
        expected.append((*_per_client(model, start, x, y, BatchSampler(len(x), 16, seed=0, stream=c), theirs, **kw),
                         theirs))
        jobs.append(CohortJob(model=model, weights=dict(start), x=x, y=y, sampler=BatchSampler(len(x), 16, seed=0,
                                                                                               stream=c),
                              momentum_buffers={n: t.clone() for n, t in buffers.items()}, **kw))
    cohort_sgd(jobs)
    for (w, _, buffers), job in zip(expected, jobs):
        assert set(job.momentum_buffers) == set(buffers) == set(w)
        for n in w:
            torch.testing.assert_close(job.trained[n], w[n], atol=ATOL, rtol=ATOL)
            torch.testing.assert_close(job.momentum_buffers[n], buffers[n], atol=ATOL, rtol=ATOL)


def test_jobs_of_two_groups_are_refused_together():
    model = build_model("mlp", input_shape=(1, 8, 8), num_classes=10, seed=0)
    (x, y), = _clients([40])
    kw = dict(model=model, weights=_weights(model), x=x, y=y, lr=0.05, momentum=0.0, weight_decay=0.0,
              proximal_mu=0.0, momentum_buffers=None)
    jobs = [CohortJob(steps=5, sampler=BatchSampler(40, 16, seed=0), **kw),
            CohortJob(steps=6, sampler=BatchSampler(40, 16, seed=0), **kw)]
    with pytest.raises(ValueError, match="one group"):
        cohort_sgd(jobs)


def test_dropout_is_refused_by_name_and_batchnorm_is_not():
    drop = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 32), torch.nn.Dropout(0.5),
                               torch.nn.Linear(32, 10))
    reason = cohort_refusal(drop)
    assert reason is not None and "'2'" in reason and "Dropout" in reason
    assert cohort_refusal(build_model("cnn-bn", input_shape=(1, 8, 8), num_classes=10, seed=0)) is None
    assert cohort_refusal(build_model("cnn", input_shape=(1, 8, 8), num_classes=10, seed=0)) is None


def test_batchnorm_statistics_are_each_clients_own():
    """cnn-bn: each client's running mean, variance and counter start from its own
    received values and follow its own batches, as on the per-client path."""
    model = build_model("cnn-bn", input_shape=(1, 8, 8), num_classes=10, seed=0)
    data = _clients([40, 64, 50], seed=4)
    kw = dict(steps=6, lr=0.05, momentum=0.9, weight_decay=0.0, proximal_mu=0.0)
    jobs, expected = [], []
    for c, (x, y) in enumerate(data):
        m = copy.deepcopy(model)
        with torch.no_grad():  # different statistics received by each client
            for name, b in m.named_buffers():
                if b.is_floating_point():
                    b.add_(0.1 * (c + 1))
        start, buffers = _weights(m), {n: b.clone() for n, b in m.named_buffers()}
        per_client_sgd(m, x, y, sampler=BatchSampler(len(x), 16, seed=0, stream=c), **kw)
        expected.append((_weights(m), {n: b.clone() for n, b in m.named_buffers()}))
        jobs.append(CohortJob(model=model, weights=start, buffers=buffers, x=x, y=y,
                              sampler=BatchSampler(len(x), 16, seed=0, stream=c), momentum_buffers=None, **kw))
    cohort_sgd(jobs)
    for (w, buffers), job in zip(expected, jobs):
        for n in w:
            torch.testing.assert_close(job.trained[n], w[n], atol=BN_ATOL, rtol=BN_ATOL)
        assert set(job.trained_buffers) == set(buffers)
        for n, b in buffers.items():
            torch.testing.assert_close(job.trained_buffers[n], b, atol=BN_ATOL, rtol=BN_ATOL)


def _client_call(model, start, x, y, stream, log, i, steps=6, fail=False, lr=0.05):
    """What a ClientApp's train does around local SGD: load, train, read the weights."""
    def call():
        log.append(("start", i, threading.get_ident()))
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(start[n])
        sampler = BatchSampler(len(x), 16, seed=3, stream=stream)
        res = local_sgd(model, x, y, steps=steps, lr=lr, momentum=0.9, sampler=sampler)
        if fail:
            raise RuntimeError(f"client {i} failed after training")
        log.append(("end", i, threading.get_ident()))
        return _weights(model), res, sampler.state_dict()
    return call


def test_run_together_runs_calls_in_order_and_trains_them_as_cohorts():
    """One call at a time, in order (all reach local SGD, then all finish, in order); a
    client whose batch size differs (a partition smaller than the batch) is a group of
    one and trains per client from its own weights, not the model's last ones; the
    results equal the per-client path's."""
    model = build_model("mlp", input_shape=(1, 8, 8), num_classes=10, seed=2)
    data = _clients([50, 64, 10, 90], seed=2)
    starts = [{n: t * (1 + 0.1 * c) for n, t in _weights(model).items()} for c in range(len(data))]
    log: list = []
    calls = [_client_call(model, s, x, y, c, log, c) for c, (s, (x, y)) in enumerate(zip(starts, data))]
    sizes = []
    real = cohort.cohort_sgd

    def spy(jobs, **kw):
        sizes.append(len(jobs))
        return real(jobs, **kw)

    cohort.cohort_sgd = spy
    try:
        out = run_together(calls)
        again = run_together([_client_call(model, s, x, y, c, [], c) for c, (s, (x, y)) in enumerate(zip(starts, data))])
    finally:
        cohort.cohort_sgd = real
    # The 10-example client (batch 10) trains on its own; of the other three, the first
    # trains alone in the group's first TIMING_SAMPLES cohorts (timed: the least of those
    # timings is every cohort client's compute_s).
    assert cohort.TIMING_SAMPLES == 3 and sizes == [2, 2]
    key = next(iter(cohort._alone_s))
    assert cohort._alone_n[key] == 2
    assert all(res.compute_s == cohort._alone_s[key] for c, (_, res, _) in enumerate(again) if c not in (0, 2))
    assert again[0][1].compute_s >= cohort._alone_s[key]
    assert [(e, i) for e, i, _ in log] == [("start", i) for i in range(4)] + [("end", i) for i in range(4)]
    for c, ((w, res, pos), s, (x, y)) in enumerate(zip(out, starts, data)):
        sampler = BatchSampler(len(x), 16, seed=3, stream=c)
        ref_w, ref = _per_client(model, s, x, y, sampler, steps=6, lr=0.05, momentum=0.9)
        for n in w:
            torch.testing.assert_close(w[n], ref_w[n], atol=ATOL, rtol=ATOL)
        assert res.mean_loss == pytest.approx(ref.mean_loss, rel=1e-5)
        assert pos == sampler.state_dict()


def test_run_together_reraises_after_every_call_ended():
    model = build_model("mlp", input_shape=(1, 8, 8), num_classes=10, seed=0)
    data = _clients([40, 40, 40])
    log: list = []
    calls = [_client_call(model, _weights(model), x, y, c, log, c, fail=(c == 1)) for c, (x, y) in enumerate(data)]
    with pytest.raises(RuntimeError, match="client 1 failed"):
        run_together(calls)
    assert [(e, i) for e, i, _ in log if e == "end"] == [("end", 0), ("end", 2)]


def test_a_dropout_model_trains_per_client_inside_run_together():
    """A model the cohort refuses never pauses: each call trains on its own, bit for
    bit the per-client path."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                torch.nn.Linear(32, 10))
    data = _clients([40, 50])
    start = {k: v.clone() for k, v in model.state_dict().items()}

    def call_for(c, x, y):
        def call():
            model.load_state_dict(start)
            torch.manual_seed(c)
            local_sgd(model, x, y, steps=4, lr=0.05, sampler=BatchSampler(len(x), 16, seed=0, stream=c))
            return {k: v.clone() for k, v in model.state_dict().items()}
        return call

    out = run_together([call_for(c, x, y) for c, (x, y) in enumerate(data)])
    for c, ((x, y), got) in enumerate(zip(data, out)):
        model.load_state_dict(start)
        torch.manual_seed(c)
        per_client_sgd(model, x, y, steps=4, lr=0.05, sampler=BatchSampler(len(x), 16, seed=0, stream=c))
        for k, v in model.state_dict().items():
            assert torch.equal(got[k], v), k


def _train_and_encode_call(model, start, x, y, c, encoder, log, poison=False):
    """A ClientApp's train with a compressed uplink: local SGD, then its delta encoded
    (fededge.clients.mods.CompressionMod does this through encode_update)."""
    def call():
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(start[n])
        local_sgd(model, x, y, steps=3, lr=0.05, momentum=0.9, sampler=BatchSampler(len(x), 16, seed=3, stream=c))
        delta = {n: p.detach() - start[n] for n, p in model.named_parameters()}
        if poison:
            delta["net.5.weight"][0, 0] = float("nan")  # the last matrix: the others were batched first
        log.append(("encode", c))
        try:
            payloads, waited = cohort.encode_update(encoder, delta, round=0)
        except ValueError as err:
            log.append(("refused", c))
            return err
        log.append(("encoded", c))
        return payloads, waited, {n: t.clone() for n, t in delta.items()}
    return call


def test_run_together_encodes_the_clients_uplinks_as_one_batch():
    """After training, the calls pause again at their encoder: signSGD + EF is encoded
    as one batch (the group's first client alone, timed, the first time), to each
    client's own bytes and residuals; a client whose update holds a NaN is refused with
    its own error while the others go on."""
    from fededge.compress.update import UpdateConfig, UpdateEncoder

    cfg = UpdateConfig(compressor="signsgd", error_feedback=True, min_numel=64)
    model = build_model("mlp", input_shape=(1, 8, 8), num_classes=10, seed=4)
    data = _clients([40, 48, 56, 64, 40], seed=4)
    start = _weights(model)
    assert list(start)[-2] == "net.5.weight"
    batches = []
    real = cohort.encode_batch

    def spy(encoders, deltas, **kw):
        batches.append(len(encoders))
        return real(encoders, deltas, **kw)

    for poisoned in (None, 3):
        encoders = [UpdateEncoder(cfg, stream=c) for c in range(len(data))]
        log: list = []
        batches.clear()
        cohort.encode_batch = spy
        try:
            out = run_together([_train_and_encode_call(model, start, x, y, c, encoders[c], log, poison=c == poisoned)
                                for c, (x, y) in enumerate(data)])
        finally:
            cohort.encode_batch = real
        # Every call reached its encoder before any was encoded (one batch, in order).
        assert [e for e in log if e[0] == "encode"] == [("encode", c) for c in range(5)]
        assert log.index(("encode", 4)) < min(i for i, e in enumerate(log) if e[0] != "encode")
        if poisoned is None:
            assert batches == [4]  # client 0 alone (its seconds: every batched client's charge)
        else:
            # client 0 alone again (the second of the TIMING_SAMPLES timings); the batch
            # of the other four refused, each of them encoded alone
            assert batches == [4] and cohort._encode_alone_n[next(iter(cohort._encode_alone_n))] == 2
            assert isinstance(out[poisoned], ValueError) and "NaN" in str(out[poisoned])
            assert ("refused", poisoned) in log
        for c, got in enumerate(out):
            if c == poisoned:
                continue
            payloads, waited, delta = got
            assert waited >= -max(cohort._encode_alone_s.values())  # charged one client alone at least
            alone = UpdateEncoder(cfg, stream=c)
            assert payloads == alone.encode(delta, round=0)
            own = alone.state_dict()
            assert sorted(own) == sorted(encoders[c].state_dict())
            assert all(torch.equal(v, encoders[c].state_dict()[k]) for k, v in own.items())
        assert len(cohort._encode_alone_s) == 1


def test_local_sgd_outside_run_together_is_the_per_client_one():
    model = build_model("mlp", input_shape=(1, 8, 8), num_classes=10, seed=0)
    twin = copy.deepcopy(model)
    (x, y), = _clients([40])
    a = local_sgd(model, x, y, steps=5, lr=0.05, sampler=BatchSampler(40, 16, seed=0))
    b = per_client_sgd(twin, x, y, steps=5, lr=0.05, sampler=BatchSampler(40, 16, seed=0))
    assert a.compute_s is None and a.mean_loss == b.mean_loss
    for (n, p), q in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(p, q), n


@pytest.mark.parametrize("carrier", ["greenlet", "threads"])
def test_both_coroutine_carriers_give_the_same_clients(monkeypatch, carrier):
    """Greenlets (where installed) and the threads fallback run the same protocol: the
    same order, the same cohorts, the same results; with greenlets every call runs on
    the caller's thread (one OpenMP team)."""
    if carrier == "threads":
        monkeypatch.setattr(cohort, "greenlet", None)
    elif cohort.greenlet is None:
        pytest.skip("greenlet is not installed here (fededge's x86-64 and aarch64 installs have it)")
    model = build_model("mlp", input_shape=(1, 8, 8), num_classes=10, seed=3)
    start = _weights(model)
    data = _clients([50, 60, 70], seed=3)
    log: list = []
    out = run_together([_client_call(model, start, x, y, c, log, c) for c, (x, y) in enumerate(data)])
    assert [(e, i) for e, i, _ in log] == [("start", i) for i in range(3)] + [("end", i) for i in range(3)]
    here = threading.get_ident()
    assert all((t == here) == (carrier == "greenlet") for _, _, t in log)
    for c, ((w, res, _), (x, y)) in enumerate(zip(out, data)):
        ref_w, ref = _per_client(model, start, x, y, BatchSampler(len(x), 16, seed=3, stream=c), steps=6, lr=0.05,
                                 momentum=0.9)
        for n in w:
            torch.testing.assert_close(w[n], ref_w[n], atol=ATOL, rtol=ATOL)
        assert res.mean_loss == pytest.approx(ref.mean_loss, rel=1e-5)


@pytest.mark.parametrize("schedule", [False, True], ids=["constant-lr", "lr-schedule"])
def test_a_group_whose_cohort_is_slower_than_alone_trains_per_client(monkeypatch, caplog, schedule):
    """Judged once its alone timings are in: slower per client than one client alone, and
    the group's clients train per client from then on (logged once, naming the times).
    The timing and the verdict go by what the group's cost depends on: with a new lr every
    round (a schedule) the group was timed alone again every round and never judged."""
    model = build_model("mlp", input_shape=(1, 8, 8), num_classes=10, seed=0)
    data = _clients([40, 40, 40], seed=6)
    real = cohort.cohort_sgd
    sizes = []

    def slow(jobs, **kw):
        sizes.append(len(jobs))
        real(jobs, **kw)
        return 1e3  # seconds: far slower than any client alone

    monkeypatch.setattr(cohort, "cohort_sgd", slow)
    start = _weights(model)
    lr = 0.05
    for r in range(5):
        lr = 0.05 * 0.9**r if schedule else 0.05
        out = run_together([_client_call(model, start, x, y, c, [], c, lr=lr) for c, (x, y) in enumerate(data)])
    # one alone + two, three times (the alone timings); judged slower on the third; then none
    assert sizes == [2, 2, 2]
    assert "train one by one from now on" in caplog.text and len(cohort._alone_s) == 1
    for c, ((w, res, _), (x, y)) in enumerate(zip(out, data)):
        ref_w, _ = _per_client(model, start, x, y, BatchSampler(len(x), 16, seed=3, stream=c), steps=6, lr=lr,
                               momentum=0.9)
        assert res.compute_s is not None and res.compute_s > 0  # its own training's seconds, timed alone
        for n in w:
            assert torch.equal(w[n], ref_w[n]), n


def test_a_client_trained_on_its_own_in_run_together_is_charged_its_own_seconds(monkeypatch):
    """Groups of one (each client its own lr) train per client after every call has
    paused: the caller's clock ran through the others' work too, which made client k's
    charge about k + 1 times its own. Each result carries its own training's seconds."""
    real = cohort._train.local_sgd
    own = 0.2

    def slow(*a, **k):  # each client's training: `own` seconds, whatever ran before it
        time.sleep(own)
        return real(*a, **k)

    monkeypatch.setattr(cohort._train, "local_sgd", slow)
    model = build_model("mlp", input_shape=(1, 8, 8), num_classes=10, seed=0)
    start = _weights(model)
    data = _clients([40, 40, 40, 40], seed=8)
    t0 = time.perf_counter()
    out = run_together([_client_call(model, start, x, y, c, [], c, lr=0.01 * (c + 1))
                        for c, (x, y) in enumerate(data)])
    assert time.perf_counter() - t0 >= 4 * own
    charged = [res.compute_s for _, res, _ in out]
    assert all(own <= s < 1.75 * own for s in charged), charged  # the fourth was charged 4x before


def test_a_client_resumed_in_run_together_trains_with_its_own_threads(monkeypatch):
    """torch's thread count is the process's: each call set its client-threads and
    paused; another call's ``finally`` put back the process's before this one resumed."""
    real = cohort._train.local_sgd
    seen = []

    def spy(*a, **k):
        seen.append(torch.get_num_threads())
        return real(*a, **k)

    monkeypatch.setattr(cohort._train, "local_sgd", spy)
    model = build_model("mlp", input_shape=(1, 8, 8), num_classes=10, seed=0)
    data = _clients([48, 48, 48], seed=9)

    def call(c):
        def f():  # as fededge.clients.app.train with client-threads = 1
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                x, y = data[c]
                local_sgd(model, x, y, steps=2, lr=0.01 * (c + 1), sampler=BatchSampler(48, 16, seed=0, stream=c))
                return torch.get_num_threads()
            finally:
                torch.set_num_threads(threads)
        return f

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        after = run_together([call(c) for c in range(3)])
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert seen == [1, 1, 1] and after == [1, 1, 1]


def test_a_cohort_that_fails_leaves_each_client_its_own_outcome(caplog):
    """One client's kept momentum buffer of another model failed every client of its
    cohort; now the group trains one by one, from where each sampler stood, and only
    that client fails (with the per-client path's own error)."""
    model = build_model("mlp", input_shape=(1, 8, 8), num_classes=10, seed=0)
    start = _weights(model)
    data = _clients([48, 48, 48, 48], seed=10)
    name = next(n for n, _ in model.named_parameters())
    bad = {name: torch.zeros(3, 3)}

    def call(c):
        def f():
            with torch.no_grad():
                for n, p in model.named_parameters():
                    p.copy_(start[n])
            sampler = BatchSampler(48, 16, seed=0, stream=c)
            try:
                local_sgd(model, *data[c], steps=3, lr=0.05, momentum=0.9, sampler=sampler,
                          momentum_buffers=dict(bad) if c == 3 else {})
            except (ValueError, RuntimeError) as err:
                return type(err).__name__
            return _weights(model), sampler.state_dict()
        return f

    together = run_together([call(c) for c in range(4)])
    alone = [call(c)() for c in range(4)]
    assert isinstance(together[3], str) and together[3] == alone[3]
    for c in range(3):
        (w, drawn), (ref_w, ref_drawn) = together[c], alone[c]
        assert drawn == ref_drawn
        for n in w:
            torch.testing.assert_close(w[n], ref_w[n], atol=ATOL, rtol=ATOL)
    assert "failed" in caplog.text and "one by one from now on" in caplog.text


def test_a_cohort_that_fails_after_drawing_its_batches_trains_each_client_from_its_own_sampler(monkeypatch):
    """A failure of the stack itself (the GPU's memory, say) once the clients' batches are
    drawn: each client trains on its own from where its sampler stood before the cohort,
    so the results are the per-client path's, batch for batch."""
    def oom(self, k):
        raise RuntimeError("CUDA out of memory (a stand-in)")

    monkeypatch.setattr(cohort._Gather, "__call__", oom)
    model = build_model("mlp", input_shape=(1, 8, 8), num_classes=10, seed=1)
    start = _weights(model)
    data = _clients([40, 56, 48], seed=11)
    out = run_together([_client_call(model, start, x, y, c, [], c) for c, (x, y) in enumerate(data)])
    for c, ((w, res, drawn), (x, y)) in enumerate(zip(out, data)):
        sampler = BatchSampler(len(x), 16, seed=3, stream=c)
        ref_w, ref = _per_client(model, start, x, y, sampler, steps=6, lr=0.05, momentum=0.9)
        assert drawn == sampler.state_dict()
        assert all(torch.equal(w[n], ref_w[n]) for n in w)
        assert res.mean_loss == ref.mean_loss


def _momentum_call(model, start, x, y, stream, kept):
    """A client with keep-momentum: its buffers dict is its state across rounds."""
    def call():
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(start[n])
        sampler = BatchSampler(len(x), 16, seed=3, stream=stream)
        res = local_sgd(model, x, y, steps=4, lr=0.05, momentum=0.9, sampler=sampler, momentum_buffers=kept)
        return _weights(model), res
    return call


def _reference(model, start, data, kept_before):
    out = []
    for c, (x, y) in enumerate(data):
        kept = {n: t.clone() for n, t in kept_before[c].items()}
        w, _ = _per_client(model, start, x, y, BatchSampler(len(x), 16, seed=3, stream=c), buffers=kept, steps=4,
                           lr=0.05, momentum=0.9)
        out.append((w, kept))
    return out


def test_a_group_larger_than_the_memory_budget_trains_as_several_cohorts(monkeypatch):
    """A group was stacked whole: about ten copies of the model a client (1.6 GB for 64
    clients of a 2.5 MB MLP). Now at most COHORT_MAX_BYTES a cohort; the same results."""
    model = build_model("mlp", input_shape=(1, 8, 8), num_classes=10, seed=4)
    per_client = cohort.COHORT_COPIES * sum(p.numel() * p.element_size() for p in model.parameters())
    monkeypatch.setattr(cohort, "COHORT_MAX_BYTES", 2 * per_client)  # two clients a cohort
    data = _clients([40] * 6, seed=4)
    start = _weights(model)
    sizes = []
    real = cohort.cohort_sgd
    monkeypatch.setattr(cohort, "cohort_sgd", lambda jobs, **kw: sizes.append(len(jobs)) or real(jobs, **kw))
    kept = [{} for _ in data]
    out = run_together([_momentum_call(model, start, x, y, c, kept[c]) for c, (x, y) in enumerate(data)])
    # one client alone (timed), five left: 2 + 3 (a single left over joins the last cohort:
    # trained per client, it was charged its own seconds, not the group's)
    assert sizes == [2, 3]
    for (w, _), (ref_w, ref_kept), mine in zip(out, _reference(model, start, data, [{}] * len(data)), kept):
        for n in w:
            torch.testing.assert_close(w[n], ref_w[n], atol=ATOL, rtol=ATOL)
            torch.testing.assert_close(mine[n], ref_kept[n], atol=ATOL, rtol=ATOL)


def test_a_failed_cohort_puts_back_the_kept_momentum_before_the_clients_train_alone(monkeypatch, caplog):
    """The fallback restored the samplers only: buffers a failing cohort had already
    written (a clone that ran out of memory halfway) were a round ahead of the weights."""
    model = build_model("mlp", input_shape=(1, 8, 8), num_classes=10, seed=5)
    data = _clients([40] * 4, seed=5)
    start = _weights(model)
    before = [{n: 0.01 * (c + 1) * torch.ones_like(t) for n, t in start.items()} for c in range(len(data))]
    kept = [{n: t.clone() for n, t in b.items()} for b in before]

    def failing(jobs, **kw):
        for j in jobs[:2]:  # written, then the failure
            for n in j.momentum_buffers:
                j.momentum_buffers[n] = torch.full_like(j.momentum_buffers[n], 7.0)
        raise MemoryError("a clone of the kept buffers")

    monkeypatch.setattr(cohort, "cohort_sgd", failing)
    out = run_together([_momentum_call(model, start, x, y, c, kept[c]) for c, (x, y) in enumerate(data)])
    assert "a cohort of 3 MLP clients failed (MemoryError" in caplog.text
    for (w, _), (ref_w, ref_kept), mine in zip(out, _reference(model, start, data, before), kept):
        for n in w:
            torch.testing.assert_close(w[n], ref_w[n], atol=ATOL, rtol=ATOL)
            torch.testing.assert_close(mine[n], ref_kept[n], atol=ATOL, rtol=ATOL)


def test_every_client_is_charged_the_least_of_the_first_alone_timings(monkeypatch):
    """One timing of a client alone was every client's compute_s for the whole run (one
    outlier, 30x the usual, became every client's seconds)."""
    model = build_model("mlp", input_shape=(1, 8, 8), num_classes=10, seed=6)
    data = _clients([40] * 3, seed=6)
    start = _weights(model)
    real = cohort._train_alone
    timings = iter([5.0, 1.0, 3.0])

    def alone(job):
        real(job)
        job.result = dataclasses.replace(job.result, compute_s=next(timings))
        return job.result.compute_s

    monkeypatch.setattr(cohort, "_train_alone", alone)
    charged = []
    for _ in range(4):
        out = run_together([_client_call(model, start, x, y, c, [], c) for c, (x, y) in enumerate(data)])
        charged.append([res.compute_s for _, res, _ in out])
    assert charged[0] == [5.0, 5.0, 5.0] and charged[1] == [1.0, 1.0, 1.0] and charged[2] == [3.0, 1.0, 1.0]
    assert charged[3] == [1.0, 1.0, 1.0]  # no more timings alone: the least of three


def test_cohort_keys_tell_apart_the_trainable_tensors_and_the_threads():
    model = build_model("mlp", input_shape=(1, 8, 8), num_classes=10, seed=0)
    x, y = _clients([40], seed=0)[0]

    def job(weights, threads=1):  # noqa: ANN001, ANN202
        return CohortJob(model=model, weights=weights, x=x, y=y, sampler=BatchSampler(40, 16, seed=0), steps=2,
                         lr=0.1, momentum=0.0, weight_decay=0.0, proximal_mu=0.0, momentum_buffers=None,
                         threads=threads)

    w = _weights(model)
    fewer = {n: t for n, t in w.items() if n != next(iter(w))}
    assert job(w).group_key() != job(fewer).group_key()
    assert job(w).cost_key() != job(w, threads=2).cost_key()
