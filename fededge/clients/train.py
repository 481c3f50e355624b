"""Local SGD on one client, in plain torch (no Flower).

The ClientApp (``fededge.clients.app``) is a thin wrapper around :func:`local_sgd`; the
benchmarks' no-framework floor calls the same function, so the two do exactly the same
arithmetic and any difference in time is the framework's.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

# The schedules are arithmetic over rounds (fededge.algorithms.schedules); named here too.
from fededge.algorithms.schedules import LR_SCHEDULES, scheduled_lr

__all__ = ["LR_SCHEDULES", "BatchSampler", "LocalResult", "local_sgd", "evaluate", "norm_statistics", "scheduled_lr",
           "sgd_step"]

class BatchSampler:
    """Seeded mini-batches over ``n`` local examples that continue across rounds.

    Each epoch is a fresh permutation drawn from ``SeedSequence([seed, stream, epoch])``,
    so the order depends only on (seed, client, epoch), never on the global RNG or on
    how many rounds the client sat out. A batch never spans two epochs: the remainder
    that does not fill a batch is skipped (drop-last). A partition smaller than the
    batch size is used whole as one batch.

    The position (epoch, cursor) is the client's only state between rounds; it lives in
    Flower's ``context.state`` through :meth:`state_dict` / :meth:`load_state_dict`.
    """

    def __init__(self, n: int, batch_size: int, *, seed: int, stream: int = 0) -> None:
        if n < 1:
            raise ValueError(f"a client needs at least one example, got n={n}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.n = n
        self.batch_size = min(batch_size, n)
        self.seed = seed
        self.stream = stream
        self.epoch = 0
        self.cursor = 0
        self._perm_epoch = -1
        self._perm: torch.Tensor | None = None

    def _permutation(self) -> torch.Tensor:
        if self._perm_epoch != self.epoch:
            rng = np.random.default_rng(np.random.SeedSequence([self.seed, self.stream, self.epoch]))
            self._perm = torch.from_numpy(rng.permutation(self.n).astype(np.int64))
            self._perm_epoch = self.epoch
        assert self._perm is not None
        return self._perm

    def next_batch(self) -> torch.Tensor:
        """Indices of the next mini-batch (int64)."""
        if self.cursor + self.batch_size > self.n:
            self.epoch += 1
            self.cursor = 0
        batch = self._permutation()[self.cursor : self.cursor + self.batch_size]
        self.cursor += self.batch_size
        return batch

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "cursor": self.cursor}

    def load_state_dict(self, state: dict[str, int]) -> None:
        epoch, cursor = int(state["epoch"]), int(state["cursor"])
        if epoch < 0 or not 0 <= cursor <= self.n:
            raise ValueError(f"invalid sampler state {state!r} for n={self.n}")
        self.epoch, self.cursor = epoch, cursor


@dataclass(frozen=True)
class LocalResult:
    """What one call of :func:`local_sgd` did."""

    mean_loss: float  # mean data loss over the steps (without the proximal term)
    steps: int
    examples_seen: int
    #: The seconds of compute this client is charged when it trained in a cohort
    #: (:mod:`fededge.clients.cohort`: what one client of its group takes on its own);
    #: None on its own, where the caller times the call.
    compute_s: float | None = None


def local_sgd(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    steps: int,
    lr: float,
    momentum: float = 0.0,
    weight_decay: float = 0.0,
    sampler: BatchSampler,
    proximal_mu: float = 0.0,
    momentum_buffers: dict[str, torch.Tensor] | None = None,
) -> LocalResult:
    """Run ``steps`` SGD steps (heavy-ball momentum) on ``(x, y)`` in place.

    ``x`` and ``y`` must already be on the model's device. With ``proximal_mu > 0`` the
    loss gets FedProx's term ``mu/2 * ||w - w_received||^2`` (Li et al., 2020), where
    ``w_received`` is the model as it was when this call started.

    The momentum buffers start empty (local SGD's usual restart every round) unless
    ``momentum_buffers`` is given: a dict from parameter name to buffer, read as the
    buffers to continue from (a name it lacks starts empty) and updated in place with
    the buffers after the last step. Two calls of K steps sharing it (and the sampler)
    are then one call of 2K steps, bit for bit (tests/clients/test_train.py): fededge's
    ``keep-momentum``, the optimizer of DGA's paper, whose momentum runs across the
    averaging points.

    Examples
    --------
    >>> sampler = BatchSampler(len(x), 32, seed=0, stream=client_id)
    >>> res = local_sgd(model, x, y, steps=20, lr=0.05, momentum=0.9, sampler=sampler)
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    model.train()
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    buffers: list[torch.Tensor | None] = [None] * len(params)
    if momentum_buffers is not None:
        for i, (name, p) in enumerate(named):
            buf = momentum_buffers.get(name)
            if buf is not None:
                if buf.shape != p.shape:
                    raise ValueError(f"momentum buffer '{name}' has shape {tuple(buf.shape)}, the parameter "
                                     f"{tuple(p.shape)}: a buffer kept for another model")
                # A copy on the parameter's device and dtype: the caller's dict is rewritten
                # at the end, never aliased by a step.
                buffers[i] = buf.detach().to(device=p.device, dtype=p.dtype, copy=True)
    anchor = [p.detach().clone() for p in params] if proximal_mu > 0 else None
    total = torch.zeros((), device=x.device)
    seen = 0
    for _ in range(steps):
        idx = sampler.next_batch().to(x.device, non_blocking=True)
        xb, yb = x.index_select(0, idx), y.index_select(0, idx)
        for p in params:
            p.grad = None
        loss = F.cross_entropy(model(xb), yb)
        total += loss.detach()
        if anchor is not None:
            prox = sum((p - a).pow(2).sum() for p, a in zip(params, anchor))
            loss = loss + 0.5 * proximal_mu * prox
        loss.backward()
        sgd_step(params, buffers, lr=lr, momentum=momentum, weight_decay=weight_decay)
        seen += len(idx)
    if momentum_buffers is not None:
        for (name, _), buf in zip(named, buffers):
            if buf is not None:
                momentum_buffers[name] = buf
    return LocalResult(mean_loss=float(total) / steps, steps=steps, examples_seen=seen)


#: Device types whose tensors torch.optim.SGD updates with its multi-tensor (foreach)
#: kernels by default (torch.utils._foreach_utils): a step is then a few kernel launches
#: instead of two or three per parameter, which on a GPU is what a small batch's step
#: waits for (ResNet-18: 62 parameters, 1.8 ms of launches a step on an H100 host).
FOREACH_DEVICE_TYPES = ("cuda", "xpu")


@torch.no_grad()
def sgd_step(params: list[torch.Tensor], buffers: list[torch.Tensor | None], *, lr: float, momentum: float = 0.0,
             weight_decay: float = 0.0, foreach: bool | None = None) -> None:
    """One step of ``torch.optim.SGD`` (heavy ball, no dampening, no Nesterov), the same
    tensor operations in the same order, so the weights match it bit for bit
    (tests/clients/test_train.py). ``buffers`` holds the momentum buffers, None before a
    parameter's first step; parameters without a gradient are skipped, as torch does.

    ``foreach``: torch's multi-tensor form (``torch.optim.SGD(foreach=True)``'s
    operations); None, as torch defaults: on for parameters on a GPU
    (:data:`FOREACH_DEVICE_TYPES`), off on the CPU.

    Why not ``torch.optim.SGD`` itself: constructing any torch optimizer imports
    ``torch._dynamo`` (about 1.5 s on a quiet x86 core, more on a Raspberry Pi), which a
    SuperNode's fresh ``flwr-clientapp`` process pays on every message
    (benchmarks/profile_clientapp.py).
    """
    if foreach is None:
        foreach = bool(params) and all(p.device.type in FOREACH_DEVICE_TYPES for p in params)
    if foreach and not _one_group(params):
        foreach = False  # torch splits such lists by device and dtype; the loop is the same arithmetic
    if foreach:
        _sgd_step_foreach(params, buffers, lr=lr, momentum=momentum, weight_decay=weight_decay)
        return
    for i, p in enumerate(params):
        grad = p.grad
        if grad is None:
            continue
        if weight_decay != 0:
            grad = grad.add(p, alpha=weight_decay)
        if momentum != 0:
            buf = buffers[i]
            if buf is None:
                buf = torch.clone(grad).detach()
                buffers[i] = buf
            else:
                buf.mul_(momentum).add_(grad, alpha=1.0)
            grad = buf
        p.add_(grad, alpha=-lr)


def _one_group(params: list[torch.Tensor]) -> bool:
    """Whether the parameters with a gradient share one device and dtype and no gradient is
    sparse: what one multi-tensor call takes on its fast path (torch.optim.SGD groups by
    device and dtype, and adds sparse gradients one by one)."""
    live = [p for p in params if p.grad is not None]
    return not live or (len({(p.device, p.dtype) for p in live}) == 1 and not any(p.grad.is_sparse for p in live))


def _sgd_step_foreach(params: list[torch.Tensor], buffers: list[torch.Tensor | None], *, lr: float,
                      momentum: float, weight_decay: float) -> None:
    """:func:`foreach_sgd` on the parameters that have a gradient, as torch skips the
    others (their buffers left alone)."""
    live = [i for i, p in enumerate(params) if p.grad is not None]
    if not live:
        return
    bufs = [buffers[i] for i in live]
    foreach_sgd([params[i] for i in live], [params[i].grad for i in live], bufs, lr=lr, momentum=momentum,
                weight_decay=weight_decay)
    for i, b in zip(live, bufs):
        buffers[i] = b


def foreach_sgd(params: list[torch.Tensor], grads: list[torch.Tensor], buffers: list[torch.Tensor | None] | None,
                *, lr: float, momentum: float, weight_decay: float) -> None:
    """torch.optim.SGD's ``_multi_tensor_sgd`` for one device and dtype, without
    dampening or Nesterov, in place: weight decay, momentum into ``buffers`` (one per
    parameter, read only with momentum; a None entry becomes a copy of its gradient, as
    torch starts a buffer), the step. The cohort's update uses it on its stacks too."""
    if weight_decay != 0:
        grads = torch._foreach_add(grads, params, alpha=weight_decay)
    if momentum != 0:
        if buffers is None:
            raise ValueError("foreach_sgd: momentum needs a list of buffers (None entries start them)")
        if all(b is not None for b in buffers):
            torch._foreach_mul_(buffers, momentum)
            torch._foreach_add_(buffers, grads, alpha=1.0)
        else:
            for i, g in enumerate(grads):
                if buffers[i] is None:
                    buffers[i] = torch.clone(g).detach()
                else:
                    buffers[i].mul_(momentum).add_(g, alpha=1.0)
        grads = buffers
    torch._foreach_add_(params, grads, alpha=-lr)


@torch.no_grad()
def norm_statistics(
    model: nn.Module, x: torch.Tensor, *, batches: int, batch_size: int, seed: int
) -> dict[str, torch.Tensor]:
    """The normalisation statistics (``running_mean``, ``running_var``) of ``model``'s
    own weights on local inputs ``x``, by state-dict name, as float32 CPU tensors.

    Every BatchNorm (and other ``_NormBase`` with running statistics) forgets its
    statistics and takes the cumulative average over ``batches`` mini-batches of
    ``batch_size`` examples drawn without replacement (seeded by ``seed``), forward
    passes in train mode without gradients; then its momentum and statistics are put back
    as they were: ``model`` leaves unchanged. Used where the statistics a client trained
    with do not describe the model the server will hold (compressed uplinks,
    :class:`fededge.clients.mods.CompressionMod`). Empty for a model without them.
    """
    norms = {name: m for name, m in model.named_modules()
             if isinstance(m, nn.modules.batchnorm._NormBase) and m.track_running_stats}
    if not norms or len(x) == 0:
        return {}
    saved = {name: (m.momentum, m.running_mean.clone(), m.running_var.clone(), m.num_batches_tracked.clone())
             for name, m in norms.items()}
    was_training = model.training
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(x), generator=g)[: max(1, batches) * batch_size].to(x.device)
    try:
        for m in norms.values():
            m.reset_running_stats()
            m.momentum = None  # the cumulative average of the batches
        model.train()
        with torch.no_grad():
            for i in range(0, len(order), batch_size):
                idx = order[i:i + batch_size]
                if len(idx) > 1 or i == 0:  # a batch of one gives BatchNorm no variance
                    model(x[idx])
        out = {}
        for name, m in norms.items():
            prefix = f"{name}." if name else ""
            out[prefix + "running_mean"] = m.running_mean.detach().float().cpu().clone()
            out[prefix + "running_var"] = m.running_var.detach().float().cpu().clone()
        return out
    finally:
        for name, m in norms.items():
            momentum, mean, var, count = saved[name]
            m.momentum = momentum
            m.running_mean.copy_(mean)
            m.running_var.copy_(var)
            m.num_batches_tracked.copy_(count)
        model.train(was_training)


def evaluate(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, *, batch_size: int = 256
) -> tuple[float, float]:
    """Mean cross-entropy loss and accuracy of ``model`` on ``(x, y)``, ``batch_size``
    examples at a time (256: a CIFAR-sized CNN's activations stay near 0.1 GB; at 2048 the
    server's evaluation alone peaked at ~1.5 GB, more than 10,000 clients' states)."""
    model.eval()
    loss_sum = torch.zeros((), device=x.device, dtype=torch.float64)
    correct = torch.zeros((), device=x.device, dtype=torch.int64)
    # Without no_grad the sum held every batch's autograd graph (all activations of the
    # whole test set) until the end: memory grew with the test set, for nothing.
    with torch.no_grad():
        for start in range(0, len(x), batch_size):
            xb, yb = x[start : start + batch_size], y[start : start + batch_size]
            logits = model(xb)
            loss_sum += F.cross_entropy(logits, yb, reduction="sum").double()
            correct += (logits.argmax(dim=1) == yb).sum()
    n = max(len(x), 1)
    return float(loss_sum) / n, float(correct) / n
