"""Cohort training: the clients of a round trained as one batched program (plain torch).

A round's clients that share a model and their local-SGD settings run the same
arithmetic on different weights and data. :func:`cohort_sgd` runs them together: their
parameters are stacked along a new leading axis and each SGD step is one
``torch.func.vmap`` of ``grad`` over the clients (one batched matmul where the per-client
path does C small ones), followed by the step of :func:`~fededge.clients.train.sgd_step`
on the stacked tensors: the same element-wise operations in the same order. Each client
keeps its own data, its own :class:`~fededge.clients.train.BatchSampler` (so partitions
of different sizes each draw their own batches), its own momentum buffers
(``keep-momentum``) and its own FedProx anchor.

How a ClientApp gets there without knowing about other clients: :func:`run_together`
runs several calls (one message each) as coroutines (greenlets, or threads where
greenlet is not installed), **one at a time and in order**. A call that reaches :func:`local_sgd` (this module's, with
:func:`fededge.clients.train.local_sgd`'s signature and effects) while
:func:`run_together` runs it leaves its job and pauses; when every call has paused or
finished, the jobs are trained as cohorts (one per group of equal settings) and the
paused calls resume, in order, each finding its model, sampler and buffers as the
per-client path would have left them. A call whose mods then encode its reply through
:func:`encode_update` pauses a second time: the paused calls' uplinks are encoded as
batches (:func:`fededge.compress.batch.encode_batch`, each client's own bytes and
encoder state) and the calls resume again. Everything else before and after local SGD
(decoding, DGA's correction, state) runs per client exactly as it does otherwise.
Outside :func:`run_together`, :func:`local_sgd` and :func:`encode_update` are the
per-client ones.

Normalisation statistics (BatchNorm's running mean, variance and counter) are stacked
per client like the weights, and each client's are updated by its own batches. Models
with dropout are not stacked (their masks would come from another generator): their
clients train one by one, on the per-client path, and :func:`cohort_refusal` names why.
A group of one client also takes the per-client path.

Float tolerance: a batched matmul does not round exactly as C separate ones do, so the
weights agree with the per-client path to float32 rounding (tests/clients/test_cohort.py
states the tolerance), not bit for bit.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

try:  # the coroutines' carrier: greenlets where installed, threads otherwise (see _Slot)
    import greenlet
except ImportError:  # pragma: no cover - a platform without a greenlet wheel
    greenlet = None

from fededge.clients import train as _train
from fededge.clients.train import BatchSampler, LocalResult
from fededge.compress.batch import batchable, encode_batch
from fededge.compress.update import UpdateEncoder

__all__ = ["CohortJob", "EncodeJob", "cohort_refusal", "cohort_sgd", "encode_update", "local_sgd", "run_together"]

log = logging.getLogger(__name__)

T = TypeVar("T")


def cohort_refusal(model: nn.Module) -> str | None:
    """Why ``model``'s clients cannot be stacked into a cohort, or None when they can.

    Normalisation layers with running statistics (BatchNorm) are handled: each client's
    statistics are stacked like its weights and updated by its own batches. Dropout is
    not: its random masks would be drawn from another generator than the per-client
    path's, so such models train per client."""
    for name, m in model.named_modules():
        if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0:
            return f"its layer '{name}' ({type(m).__name__}) draws random masks, which a cohort would draw differently"
    return None


@dataclass
class CohortJob:
    """One client's local SGD, as :func:`local_sgd` hands it over: the arguments of
    :func:`fededge.clients.train.local_sgd`, with the weights the client starts from."""

    model: nn.Module
    weights: dict[str, torch.Tensor]  # trainable parameters at the start, by name
    x: torch.Tensor
    y: torch.Tensor
    steps: int
    lr: float
    momentum: float
    weight_decay: float
    sampler: BatchSampler
    proximal_mu: float
    momentum_buffers: dict[str, torch.Tensor] | None
    #: The model's buffers at the start (BatchNorm's running statistics and counter),
    #: by name: each client's own, updated by its own batches.
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    # Filled by cohort_sgd:
    trained: dict[str, torch.Tensor] | None = None
    trained_buffers: dict[str, torch.Tensor] | None = None
    result: LocalResult | None = None
    error: BaseException | None = None
    per_client: bool = False  # left to the per-client path (a group of one)
    threads: int = 1  # the torch threads the client trains with on its own (client-threads)

    def group_key(self) -> tuple:
        """Jobs with equal keys train as one cohort."""
        return (id(self.model), self.steps, self.sampler.batch_size, self.lr, self.momentum, self.weight_decay,
                self.proximal_mu, self.x.device, self.x.dtype, tuple(self.x.shape[1:]),
                self.momentum_buffers is not None, tuple(self.weights))

    def cost_key(self) -> tuple:
        """What a group's seconds depend on: its key without the values of its rates (an
        lr schedule makes every round's key a new one), only whether each term is there.
        The timing of one client alone and the verdict on the group's cohorts go by it."""
        return (id(self.model), self.steps, self.sampler.batch_size, self.momentum != 0, self.weight_decay != 0,
                self.proximal_mu != 0, self.x.device, self.x.dtype, tuple(self.x.shape[1:]),
                self.momentum_buffers is not None, tuple(self.weights), self.threads)


def cohort_sgd(jobs: Sequence[CohortJob], *, charge_s: float | None = None) -> float:
    """Train ``jobs`` (same model object and settings: :meth:`CohortJob.group_key`) as
    one batched program; fill each job's ``trained``, ``result`` and (keep-momentum)
    ``momentum_buffers``, and advance its sampler as ``steps`` calls of
    :func:`~fededge.clients.train.local_sgd` would. Returns the wall seconds it took.

    The arithmetic is :func:`~fededge.clients.train.local_sgd`'s: cross-entropy on each
    client's own mini-batch, FedProx's ``mu/2 ||w - w_received||^2`` added, then heavy-ball
    momentum (a buffer that starts as the first gradient; a kept one continues) and
    weight decay as in :func:`~fededge.clients.train.sgd_step`.

    Each result's ``compute_s`` is ``charge_s`` when given (:func:`run_together` gives
    the seconds one client of the group took on its own), else the client's share of the
    cohort's seconds.
    """
    from torch.func import functional_call, grad_and_value, vmap

    first = jobs[0]
    if any(j.group_key() != first.group_key() for j in jobs):
        raise ValueError("cohort_sgd takes jobs of one group (the same model and settings)")
    model = first.model
    refusal = cohort_refusal(model)
    if refusal is not None:
        raise ValueError(f"this model cannot train as a cohort: {refusal}")
    device = first.x.device
    _warm_up()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    names = list(first.weights)
    params = {n: torch.stack([j.weights[n] for j in jobs]) for n in names}
    # Buffers (running statistics) per client, stacked like the weights: a training
    # forward pass updates each client's in place, under vmap, as it would its own model's.
    # A job without a buffer (a model object shared with no snapshot) uses the model's.
    stats = {n: torch.stack([j.buffers[n] if n in j.buffers else t for j in jobs]).clone()
             for n, t in model.named_buffers()}
    frozen = {n: p.detach() for n, p in model.named_parameters() if n not in params}
    anchor = {n: t.clone() for n, t in params.items()} if first.proximal_mu > 0 else None
    mu, lr, momentum, wd = first.proximal_mu, first.lr, first.momentum, first.weight_decay
    bufs: dict[str, torch.Tensor] | None = None
    if momentum != 0:
        # A client without a kept buffer starts from zero: 0 * momentum + g is g exactly,
        # the per-client path's first buffer (a clone of the gradient).
        bufs = {}
        for n in names:
            kept = [None if j.momentum_buffers is None else j.momentum_buffers.get(n) for j in jobs]
            shape = params[n].shape[1:]
            for k in kept:
                if k is not None and tuple(k.shape) != tuple(shape):
                    raise ValueError(f"momentum buffer '{n}' has shape {tuple(k.shape)}, the parameter "
                                     f"{tuple(shape)}: a buffer kept for another model")
            bufs[n] = torch.stack([torch.zeros(shape, device=device, dtype=params[n].dtype) if k is None
                                   else k.detach().to(device=device, dtype=params[n].dtype) for k in kept])

    def loss_of(p: dict[str, torch.Tensor], b: dict[str, torch.Tensor], xb: torch.Tensor, yb: torch.Tensor,
                a: dict[str, torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor]:
        data = F.cross_entropy(functional_call(model, {**frozen, **b, **p}, (xb,)), yb)
        loss = data
        if a is not None:
            loss = data + 0.5 * mu * sum((p[n] - a[n]).pow(2).sum() for n in names)
        return loss, data

    step = vmap(grad_and_value(loss_of, has_aux=True), in_dims=(0, 0, 0, 0, 0 if anchor is not None else None))
    # Every client's K mini-batches, drawn from its own sampler in the per-client order;
    # gathered a step at a time (a CNN cohort's K batches at once would be gigabytes).
    idx = [torch.stack([j.sampler.next_batch() for _ in range(first.steps)]).to(device) for j in jobs]
    gather = _Gather([j.x for j in jobs], [j.y for j in jobs], idx)
    total = torch.zeros(len(jobs), device=device)
    model.train()
    p_list = [params[n] for n in names]
    b_list = None if bufs is None else [bufs[n] for n in names]
    for k in range(first.steps):
        xb, yb = gather(k)
        grads, (_, data_loss) = step(params, stats, xb, yb, anchor)
        total += data_loss.detach()
        with torch.no_grad():
            _update([grads[n] for n in names], p_list, b_list, lr=lr, momentum=momentum, weight_decay=wd)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    losses = [t / first.steps for t in total.tolist()]  # as float(total) / steps per client
    # Every client's kept buffers copied before any is written: a copy that failed halfway
    # (memory) left the first clients' buffers a round ahead of their weights.
    kept = [None if bufs is None or j.momentum_buffers is None else {n: bufs[n][c].clone() for n in names}
            for c, j in enumerate(jobs)]
    for c, j in enumerate(jobs):
        j.trained = {n: params[n][c] for n in names}
        j.trained_buffers = {n: t[c] for n, t in stats.items()}
        if kept[c] is not None:
            j.momentum_buffers.update(kept[c])
        j.result = LocalResult(mean_loss=losses[c], steps=first.steps,
                               examples_seen=first.steps * first.sampler.batch_size,
                               compute_s=seconds / len(jobs) if charge_s is None else charge_s)
    return seconds


#: device type -> False once torch's fused SGD kernel failed there (no kernel for it)
_fused_works: dict[str, bool] = {}


def _update(g_list: list[torch.Tensor], p_list: list[torch.Tensor], b_list: list[torch.Tensor] | None, *,
            lr: float, momentum: float, weight_decay: float) -> None:
    """:func:`~fededge.clients.train.sgd_step` on the stacks, in place: weight decay, then
    heavy-ball momentum into ``b_list`` (buffers that start at zero: ``0 * m + g`` is the
    per-client path's first buffer, ``g``), then the step. With momentum, in one pass
    over the stacks where torch has its fused SGD kernel (a cohort's stacks outgrow the
    caches that one client's weights fit in, so passes over memory are what the update
    costs); otherwise with ``torch._foreach`` lists (:func:`~fededge.clients.train.foreach_sgd`,
    the per-client path's form on a GPU; ``b_list`` is None exactly when momentum is 0)."""
    fused = getattr(torch, "_fused_sgd_", None)
    kind = p_list[0].device.type if p_list else "cpu"
    # The CPU kernel reads each tensor's memory in order (a strided gradient would be
    # misread), and torch before 2.4 has no CPU kernel at all (it fails at dispatch,
    # before writing anything): then the foreach path, from then on.
    if (b_list is not None and fused is not None and _fused_works.get(kind, True)
            and all(t.is_contiguous() for t in (*g_list, *p_list, *b_list))):
        try:
            fused(p_list, g_list, b_list, weight_decay=weight_decay, momentum=momentum, lr=lr, dampening=0.0,
                  nesterov=False, maximize=False, is_first_step=False)
            return
        except (NotImplementedError, RuntimeError):
            _fused_works[kind] = False
    _train.foreach_sgd(p_list, g_list, b_list, lr=lr, momentum=momentum, weight_decay=weight_decay)


class _Gather:
    """Each step's mini-batches of every client, stacked ``[C, batch, ...]``: one
    ``index_select`` over the clients' data laid end to end (copied once per cohort when
    that is at most :data:`GATHER_COPY_BYTES`), else one per client. The same rows either
    way."""

    def __init__(self, xs: list[torch.Tensor], ys: list[torch.Tensor], idx: list[torch.Tensor]) -> None:
        self.xs, self.ys, self.idx = xs, ys, idx
        self.flat = sum(x.numel() * x.element_size() for x in xs) <= GATHER_COPY_BYTES
        if self.flat:
            self.x, self.y = torch.cat(xs), torch.cat(ys)
            lengths = torch.tensor([len(x) for x in xs], device=idx[0].device, dtype=idx[0].dtype).view(1, -1, 1)
            local = torch.stack(idx, dim=1)  # [K, C, batch]: step k's rows of every client
            if bool(((local < 0) | (local >= lengths)).any()):  # would read a neighbour's rows
                raise IndexError("a client's sampler drew a row outside its data")
            self.rows = local + (lengths.cumsum(1) - lengths)  # as indices into the laid-out data

    def __call__(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.flat:
            rows = self.rows[k]
            flat = rows.reshape(-1)
            return (self.x.index_select(0, flat).view(*rows.shape, *self.x.shape[1:]),
                    self.y.index_select(0, flat).view(*rows.shape, *self.y.shape[1:]))
        return (torch.stack([x.index_select(0, i[k]) for x, i in zip(self.xs, self.idx)]),
                torch.stack([y.index_select(0, i[k]) for y, i in zip(self.ys, self.idx)]))


#: The most bytes of client data a cohort copies end to end to gather each step's
#: mini-batches at once (a CNN cohort's data may be far larger: then one gather a client).
GATHER_COPY_BYTES = 64 * 2**20

_warm = False


def _warm_up() -> None:
    """The first ``vmap`` of ``grad`` in a process sets torch.func up (about 3 s on a
    2-core x86 machine, once): done here on a tiny model, outside the timed region, as
    :func:`fededge.clients.app` warms its model up, so that round 1's compute is not
    charged for it."""
    global _warm
    if _warm:
        return
    from torch.func import functional_call, grad, vmap

    tiny = nn.Linear(2, 2)
    weights = {n: p.detach()[None].expand(2, *p.shape) for n, p in tiny.named_parameters()}
    vmap(grad(lambda p, x: functional_call(tiny, p, (x,)).sum()))(weights, torch.zeros(2, 1, 2))
    _warm = True


# -- the rendezvous: per-client ClientApps meeting at local SGD ----------------------------

class _Slot:
    """One call of :func:`run_together` as a coroutine: :meth:`start` runs it until it
    pauses (in :func:`local_sgd` or :func:`encode_update`, with its job) or ends, and
    each :meth:`resume` runs it on to its next pause or its end.

    On a greenlet where ``greenlet`` is installed (fededge's x86-64 and aarch64 installs
    have it): the calls then run on this thread, and torch's OpenMP team stays this
    thread's. Otherwise on a thread of its own, handed the turn by events; each such
    thread starts an OpenMP team of its own, which made the clients' own work (decoding,
    error feedback, encoding) about twice as slow on 2 cores (benchmarks/bench_scale.py,
    issue 35), so threads are the fallback only."""

    def __init__(self, body: Callable[[_Slot], None], index: int) -> None:
        self.job: CohortJob | EncodeJob | None = None  # what the call paused with
        self.trained = False  # its message has had its local SGD (a cohort's or refused one)
        self.done = False
        self._body = body
        if greenlet is not None:
            self._parent = greenlet.getcurrent()
            self._green = greenlet.greenlet(lambda: body(self), parent=self._parent)
        else:
            self._paused, self._resume = threading.Event(), threading.Event()
            self._thread = threading.Thread(target=self._run_thread, name=f"fededge-cohort-{index}", daemon=True)

    def _run_thread(self) -> None:
        try:
            self._body(self)
        finally:
            self._paused.set()

    def start(self) -> None:
        with _own_threads():
            if greenlet is not None:
                self._green.switch()
            else:
                self._thread.start()
                self._paused.wait()
                self._paused.clear()

    def pause(self) -> None:
        """Called by the coroutine itself: hand the turn back until :meth:`resume`. The
        torch threads it had (its ``client-threads``) are its own again on its return:
        they are the process's, set by every call and the coordinator meanwhile."""
        with _own_threads():
            if greenlet is not None:
                self._parent.switch()
            else:
                self._paused.set()
                self._resume.wait()
                self._resume.clear()

    def resume(self) -> None:
        """Run the call on to its next pause or its end; at its end, drop what it held
        (the greenlet, its body and job refer back to this slot: left to the cyclic
        collector, a round's jobs, with their weights, stayed in memory for many rounds)."""
        self.job = None
        with _own_threads():
            if greenlet is not None:
                if not self._green.dead:
                    self._green.switch()
            else:
                if not self.done:
                    self._resume.set()
                    self._paused.wait()
                    self._paused.clear()
        if self.done:
            self.close()

    def close(self) -> None:
        if greenlet is not None:
            self._green = None
        elif self._thread is not None and self.done:  # (a paused thread is left, daemonic)
            self._thread.join()
            self._thread = None
        self._body = None
        self.job = None


@contextlib.contextmanager
def _own_threads() -> Iterator[None]:
    """Around a switch between the coordinator and a call: torch's thread count is the
    process's, and each side sets its own (a call its ``client-threads``, the coordinator
    the cohort's), so each side has its own back when the turn returns to it."""
    threads = torch.get_num_threads()
    try:
        yield
    finally:
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)


_SLOT: contextvars.ContextVar[_Slot | None] = contextvars.ContextVar("fededge_cohort_slot", default=None)
_refused_logged: set[str] = set()


def local_sgd(model: nn.Module, x: torch.Tensor, y: torch.Tensor, *, steps: int, lr: float, momentum: float = 0.0,
              weight_decay: float = 0.0, sampler: BatchSampler, proximal_mu: float = 0.0,
              momentum_buffers: dict[str, torch.Tensor] | None = None) -> LocalResult:
    """:func:`fededge.clients.train.local_sgd`, trained in a cohort when the caller runs
    inside :func:`run_together` (and the model can be stacked), else on its own.

    The effects are the per-client path's: ``model`` holds the trained weights,
    ``sampler`` has advanced ``steps`` batches, ``momentum_buffers`` (when given) holds
    the buffers after the last step. In a cohort the result's ``compute_s`` is the
    seconds one client of the cohort's group took training on its own (the least of its
    first :data:`TIMING_SAMPLES` timings, :func:`run_together`), so the simulated clock
    charges what a device would, whichever path trained it."""
    kwargs = dict(steps=steps, lr=lr, momentum=momentum, weight_decay=weight_decay, sampler=sampler,
                  proximal_mu=proximal_mu, momentum_buffers=momentum_buffers)
    slot = _SLOT.get()
    if slot is None or slot.trained:  # not in a cohort run (or a second call in one message)
        return _train.local_sgd(model, x, y, **kwargs)
    slot.trained = True
    refusal = cohort_refusal(model)
    if refusal is not None:
        key = type(model).__name__
        if key not in _refused_logged:
            _refused_logged.add(key)
            log.info("cohort training: the model (%s) trains per client: %s", key, refusal)
        return _train.local_sgd(model, x, y, **kwargs)
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    weights = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    job = CohortJob(model=model, weights=weights, buffers=buffers, x=x, y=y, sampler=sampler,
                    threads=torch.get_num_threads(), **{
        k: v for k, v in kwargs.items() if k not in ("sampler",)})
    slot.job = job
    slot.pause()  # back to the coordinator, until the cohort has run
    if job.error is not None:
        raise job.error
    if job.per_client:  # the model holds another client's weights by now: this one's first
        _load(model, weights, buffers)
        # Timed here: the caller's clock also ran while the other calls and cohorts did.
        return _timed(lambda: _train.local_sgd(model, x, y, **kwargs), x.device)
    assert job.trained is not None and job.result is not None and job.trained_buffers is not None
    _load(model, job.trained, job.trained_buffers)
    model.train()
    return job.result


#: How many times a group's first client trains (or uplink is encoded) alone, timed, in
#: the group's first cohorts: the least of them is what every client of the group is
#: charged (one sample made one outlier, 30x the usual once, every client's seconds for
#: the whole run).
TIMING_SAMPLES = 3

#: group key -> the least seconds one client of that group took training on its own (its
#: ``compute_s`` in every cohort of the group), and how many times it was timed.
_alone_s: dict[tuple, float] = {}
_alone_n: dict[tuple, int] = {}


#: group key -> whether its cohorts train faster per client than one client alone, judged
#: once its alone timings are in (:data:`TIMING_SAMPLES`), on the best of its cohorts
#: after the first (which also traces the model). False sends the group to the
#: per-client path for the rest of the run (a CNN on a CPU: vmap's batched convolutions
#: there ran at half the per-client speed, benchmarks/bench_cohort.py).
_faster: dict[tuple, bool] = {}
_seen: dict[tuple, int] = {}
_cohort_best: dict[tuple, float] = {}  # group key -> the least per-client seconds of its cohorts after the first

#: The most bytes one cohort's stacks may take: about :data:`COHORT_COPIES` copies of the
#: model per client (weights, FedProx's anchor, momentum, gradients, the paused calls'
#: snapshots). A larger group trains as several cohorts (a CUDA device: half its free memory).
COHORT_MAX_BYTES = 2 * 2**30
COHORT_COPIES = 10


def reset_measurements() -> None:
    """Forget every group's timings and verdicts (a new run: its own settings, threads and
    model objects; :class:`~fededge.server.grid.InProcessGrid` calls it)."""
    for table in (_alone_s, _alone_n, _faster, _seen, _cohort_best, _encode_alone_s, _encode_alone_n):
        table.clear()


def _cohort_size_cap(job: CohortJob) -> int:
    """The most clients of ``job``'s group that train as one cohort (:data:`COHORT_MAX_BYTES`)."""
    per_client = COHORT_COPIES * sum(w.numel() * w.element_size() for w in job.weights.values())
    budget = COHORT_MAX_BYTES
    if job.x.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(job.x.device)
        # (memory torch holds in its cache for the next cohort counts as free: without it
        # the cap shrank after the first cohort)
        cached = torch.cuda.memory_reserved(job.x.device) - torch.cuda.memory_allocated(job.x.device)
        budget = (free + cached) // 2
    return max(2, int(budget // max(1, per_client)))


def _judge(key: tuple, per_client_s: float, alone_s: float, model: nn.Module) -> None:
    _seen[key] = _seen.get(key, 0) + 1
    if key in _faster or _seen[key] < 2:
        return
    best = _cohort_best[key] = min(per_client_s, _cohort_best.get(key, per_client_s))
    if _alone_n.get(key, 0) < TIMING_SAMPLES:
        return
    per_client_s = best
    _faster[key] = per_client_s < alone_s
    device = next(model.parameters()).device
    if _faster[key]:
        log.info("cohort training: %s on %s, %.1f ms a client in a cohort against %.1f ms alone: cohorts it is",
                 type(model).__name__, device, 1e3 * per_client_s, 1e3 * alone_s)
    else:
        log.warning("cohort training: %s on %s took %.1f ms a client in a cohort against %.1f ms alone: its clients "
                    "train one by one from now on (cohort = true pays where batched kernels are fast: GPUs, "
                    "small dense models)", type(model).__name__, device, 1e3 * per_client_s, 1e3 * alone_s)


def _timed(train: Callable[[], LocalResult], device: torch.device) -> LocalResult:
    """``train()``'s result with its own seconds as ``compute_s`` (a GPU's queue drained
    on both sides)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    res = train()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return LocalResult(mean_loss=res.mean_loss, steps=res.steps, examples_seen=res.examples_seen,
                       compute_s=time.perf_counter() - t0)


def _train_alone(job: CohortJob) -> float:
    """Train ``job`` on the per-client path (its result is that path's, exactly), with
    the threads it would have had, and return its seconds: what the simulated clock
    charges every client of its group, so that a cohort does not change ``sim_s``."""
    model = job.model
    _load(model, job.weights, job.buffers)
    torch.set_num_threads(job.threads)
    job.result = _timed(lambda: _train.local_sgd(
        model, job.x, job.y, steps=job.steps, lr=job.lr, momentum=job.momentum, weight_decay=job.weight_decay,
        sampler=job.sampler, proximal_mu=job.proximal_mu, momentum_buffers=job.momentum_buffers), job.x.device)
    job.trained = {n: p.detach().clone() for n, p in model.named_parameters() if n in job.weights}
    job.trained_buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    return job.result.compute_s


def _train_cohorts(waiting: list[CohortJob], threads_before: int) -> None:
    """Train the paused calls' jobs: one cohort per :meth:`CohortJob.group_key` (see
    :func:`run_together`), a group of one (or one measured slower) per client."""
    groups: dict[tuple, list[CohortJob]] = {}
    for job in waiting:
        groups.setdefault(job.group_key(), []).append(job)
    threads_now = torch.get_num_threads()
    try:
        for jobs in groups.values():
            key = jobs[0].cost_key()
            if len(jobs) == 1:
                jobs[0].per_client = True
                continue
            if _faster.get(key) is False:  # measured slower than per client (or failed): not again
                for j in jobs:
                    j.per_client = True
                continue
            if _alone_n.get(key, 0) < TIMING_SAMPLES:  # its first cohorts: the first client alone, timed
                try:
                    took = _train_alone(jobs[0])
                except Exception as err:  # noqa: BLE001 - that client's own failure, as on its own
                    jobs[0].error = err
                    for j in jobs[1:]:
                        j.per_client = True
                    continue
                _alone_s[key] = min(took, _alone_s.get(key, took))
                _alone_n[key] = _alone_n.get(key, 0) + 1
                jobs = jobs[1:]
                if len(jobs) == 1:
                    jobs[0].per_client = True
                    continue
            alone = _alone_s[key]
            torch.set_num_threads(threads_before)  # a client may have set its own (client-threads)
            cap = _cohort_size_cap(jobs[0])
            for chunk in _chunks(jobs, cap):
                if len(chunk) == 1 or _faster.get(key) is False:
                    for j in chunk:
                        j.per_client = True
                    continue
                _train_one_cohort(chunk, key, alone)
    finally:
        torch.set_num_threads(threads_now)


def _chunks(jobs: list[CohortJob], cap: int) -> list[list[CohortJob]]:
    """``jobs`` in cohorts of at most about ``cap``, as even as can be, none of one client
    (trained per client, it was charged its own seconds, not the group's): a single left
    over joins the last cohort.

    >>> [len(c) for c in _chunks(list(range(7)), 3)], [len(c) for c in _chunks(list(range(5)), 2)]
    ([3, 2, 2], [2, 3])
    """
    n = len(jobs)
    count = -(-n // max(1, cap))
    sizes = [n // count + (1 if i < n % count else 0) for i in range(count)]
    if len(sizes) > 1 and sizes[-1] == 1:
        single = sizes.pop()
        sizes[-1] += single
    out, start = [], 0
    for s in sizes:
        out.append(jobs[start:start + s])
        start += s
    return out


def _train_one_cohort(jobs: list[CohortJob], key: tuple, alone: float) -> None:
    drawn = [j.sampler.state_dict() for j in jobs]
    kept = [None if j.momentum_buffers is None else dict(j.momentum_buffers) for j in jobs]
    try:
        seconds = cohort_sgd(jobs, charge_s=alone)
    except Exception as err:  # noqa: BLE001 - one client's (a buffer of another model) or the stack's (memory)
        # Each client trains on its own instead, from where its sampler and kept momentum
        # stood, and fails with its own error if it has one; the group does not try again.
        for j, state, buffers in zip(jobs, drawn, kept):
            j.sampler.load_state_dict(state)
            if buffers is not None:
                j.momentum_buffers.clear()
                j.momentum_buffers.update(buffers)
            j.trained = j.trained_buffers = j.result = None
            j.per_client = True
        _faster[key] = False
        log.warning("cohort training: a cohort of %d %s clients failed (%s: %s); its group's clients "
                    "train one by one from now on", len(jobs), type(jobs[0].model).__name__,
                    type(err).__name__, err)
        return
    _judge(key, seconds / len(jobs), alone, jobs[0].model)


# -- the clients' uplinks, encoded as one batch (fededge.compress.batch) -------------------

@dataclass
class EncodeJob:
    """One client's :meth:`UpdateEncoder.encode <fededge.compress.update.UpdateEncoder.encode>`
    call, as :func:`encode_update` hands it over."""

    encoder: UpdateEncoder
    delta: dict[str, torch.Tensor]
    round: int
    # Filled by _encode_batches:
    payloads: dict[str, bytes] | None = None
    charge_s: float = 0.0  # the seconds the simulated clock charges this client's encoding
    error: BaseException | None = None

    def group_key(self) -> tuple:
        """Jobs with equal keys are encoded as one batch."""
        return (self.encoder.config, self.round, tuple(
            (n, tuple(t.shape), t.dtype, t.device) for n, t in self.delta.items()))


_batch_failed_logged: list[bool] = []

#: group key (less the round) -> the least seconds one client of that group took to
#: encode on its own (every batched client's charge), and how many times it was timed
#: (:data:`TIMING_SAMPLES`).
_encode_alone_s: dict[tuple, float] = {}
_encode_alone_n: dict[tuple, int] = {}


def encode_update(encoder: UpdateEncoder, delta: dict[str, torch.Tensor], *,
                  round: int) -> tuple[dict[str, bytes], float]:
    """``encoder.encode(delta, round=round)``, encoded in one batch with the other
    clients' when the caller runs inside :func:`run_together` and the codec has a
    batched form (:func:`fededge.compress.batch.batchable`); the same bytes and encoder
    state either way (fededge/compress/batch.py).

    Returns the payloads and the seconds of this call that were not this client's
    encoding (the other clients' work while it waited, less its share as the simulated
    clock charges it: the least seconds one client took on its own, :data:`TIMING_SAMPLES`),
    which the caller takes off the compute seconds it charges."""
    slot = _SLOT.get()
    if slot is None or not batchable(encoder):
        return encoder.encode(delta, round=round), 0.0
    job = EncodeJob(encoder=encoder, delta=delta, round=round)
    t0 = time.perf_counter()
    slot.job = job
    slot.pause()  # back to the coordinator, until the batch has been encoded
    if job.error is not None:
        raise job.error
    if job.payloads is None:  # alone in its group: encoded here, on its own
        waited = time.perf_counter() - t0
        return encoder.encode(delta, round=round), waited
    # (Less than zero where the batch was quicker than the charge: the client is charged
    # one client's seconds whatever it waited.)
    return job.payloads, time.perf_counter() - t0 - job.charge_s


def _encode_batches(waiting: list[EncodeJob]) -> None:
    groups: dict[tuple, list[EncodeJob]] = {}
    for job in waiting:
        groups.setdefault(job.group_key(), []).append(job)
    for key, jobs in groups.items():
        if len(jobs) == 1:
            continue  # encoded per client, after it resumes
        per_process = (key[0], key[2])
        samples = _encode_alone_n.get(per_process, 0)
        if samples < TIMING_SAMPLES:  # the group's first batches: the first client encoded alone, timed
            first, jobs = jobs[0], jobs[1:]
            try:
                if samples == 0:
                    # Once untimed on a copy (the process's first encoding pays for cold
                    # caches and library start-up, which no later client would), then timed.
                    copy.deepcopy(first.encoder).encode(first.delta, round=first.round)
                t0 = time.perf_counter()
                first.payloads = first.encoder.encode(first.delta, round=first.round)
            except Exception as err:  # noqa: BLE001 - raised by its own call when it resumes
                first.error = err
                continue  # no measure: the others are encoded alone too
            took = first.charge_s = time.perf_counter() - t0
            _encode_alone_s[per_process] = min(took, _encode_alone_s.get(per_process, took))
            _encode_alone_n[per_process] = samples + 1
            if samples == 0:
                log.info("cohort encoding: the %s uplinks of a cohort are encoded as one batch (%d clients; "
                         "charged %.1f ms each, one client's alone, the least of %d timings)",
                         first.encoder.config.compressor, len(jobs) + 1, 1e3 * took, TIMING_SAMPLES)
            if len(jobs) == 1:
                continue
        alone = _encode_alone_s[per_process]
        try:
            payloads = encode_batch([j.encoder for j in jobs], [j.delta for j in jobs], round=jobs[0].round)
        except Exception as err:  # noqa: BLE001 - each client is then encoded alone (its own error, if any)
            if isinstance(err, ValueError):  # a client's update refused (a NaN, say): that client fails alone
                log.debug("batched encoding refused a client's update (%s): encoding the %d one by one",
                          err, len(jobs))
            elif not _batch_failed_logged:
                _batch_failed_logged.append(True)
                log.warning("batched encoding failed (%s: %s): the uplinks are encoded one client at a time "
                            "(logged once)", type(err).__name__, err)
            for j in jobs:
                j.payloads = None
            continue
        for j, p in zip(jobs, payloads):
            j.payloads, j.charge_s = p, alone


def _load(model: nn.Module, weights: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n in weights:
                p.copy_(weights[n])
        for n, b in model.named_buffers():
            if n in buffers:
                b.copy_(buffers[n])


def run_together(calls: Sequence[Callable[[], T]]) -> list[T]:
    """Run ``calls`` as the per-client path would, one after another in order, except
    that the local SGD they reach (this module's :func:`local_sgd`) trains as cohorts.

    Each call runs as a coroutine (:class:`_Slot`), never two at once: call i runs until it
    pauses in :func:`local_sgd` or returns, then call i+1 starts. When all have, the jobs
    train (one cohort per :meth:`CohortJob.group_key`, on this thread, with this
    thread's torch threads), and the paused calls resume one at a time, in order, each up
    to its next pause (:func:`encode_update`: the uplinks are then encoded as batches,
    one per :meth:`EncodeJob.group_key`) or its end; and so on until every call has
    ended. An exception a call raises is raised here (after every call has ended).

    In the first :data:`TIMING_SAMPLES` cohorts of a group (its settings: :meth:`CohortJob.cost_key`),
    its first client trains on its own (the per-client path, timed with the client's own
    threads) and the rest as the cohort; the least of those seconds is every cohort
    client's ``compute_s`` (a cohort's own seconds shared out would make the simulated
    clock depend on how many clients trained together). Then the best per-client seconds
    of its cohorts after the first are set against that: where the cohort is slower, the
    group trains per client for the rest of the run (logged once, as is the verdict either
    way). A group larger than :data:`COHORT_MAX_BYTES` allows trains as several cohorts."""
    n = len(calls)
    results: list[Any] = [None] * n
    errors: list[BaseException | None] = [None] * n
    threads_before = torch.get_num_threads()

    def body(i: int, slot: _Slot) -> None:
        _SLOT.set(slot)
        try:
            results[i] = calls[i]()
        except BaseException as err:  # noqa: BLE001 - re-raised by the coordinator
            errors[i] = err
        finally:
            slot.done = True

    slots = [_Slot(partial(body, i), i) for i in range(n)]
    try:
        for slot in slots:  # each call up to its first pause (its local SGD), in order
            slot.start()
        while True:
            waiting = [s for s in slots if not s.done and s.job is not None]
            if not waiting:
                break
            _train_cohorts([s.job for s in waiting if isinstance(s.job, CohortJob)], threads_before)
            _encode_batches([s.job for s in waiting if isinstance(s.job, EncodeJob)])
            for slot in waiting:  # the rest of each call, up to its next pause, in order
                slot.resume()
    finally:
        for slot in slots:
            slot.close()
    for err in errors:
        if err is not None:
            raise err
    return results
