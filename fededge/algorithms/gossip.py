"""Gossip arithmetic on per-node models: D-PSGD mixing, CHOCO-SGD's compressed gossip,
push-sum, and the consensus distance.

Decentralized training keeps one model per node and no global average. After its local
steps, node i mixes with the nodes it hears, using row i of a mixing matrix W
(:mod:`fededge.topology`):

- **D-PSGD** (Lian et al., 2017): ``x_i <- sum_j W[i, j] x_j`` (:func:`mix`, :func:`mix_row`).
- **CHOCO-SGD** (Koloskova, Stich & Jaggi, ICML 2019, Algorithm 1 with CHOCO-GOSSIP):
  every node keeps public estimates ``x̂_j`` of itself and of the nodes it hears, the
  same copies everywhere. Per round, with ``x_i`` the model after the local steps::

      q_i  = Q(x_i - x̂_i)                                 (sent to the neighbours)
      x̂_j <- x̂_j + q_j        for j = i and every neighbour j
      x_i  <- x_i + gamma * sum_j W[i, j] (x̂_j - x̂_i)

  Only the compressed ``q_i`` travels. With the identity compressor and ``gamma = 1`` this
  is D-PSGD. For symmetric doubly stochastic W the average of the models is preserved
  whatever Q does, since the mixing terms cancel in pairs. Q should be contractive
  (``||Q(x) - x||^2 <= (1 - delta) ||x||^2``): top-k is; the unbiased codecs (qsgd,
  random-k with its d/k rescaling) are not unless scaled down, and then need a smaller
  ``gamma``. The paper tunes ``gamma`` per compressor; a smaller Q ratio wants a smaller
  gamma.
- **Push-sum** (Kempe et al., 2003; SGP, Assran et al., 2019), for directed graphs
  whose mixing is only column stochastic: :func:`push_sum_step`. The one-peer exponential
  graph is doubly stochastic and does not need it.

Only floating-point tensors are mixed and compressed; integer buffers (BatchNorm's
``num_batches_tracked``) stay each node's own, since an average of counters means
nothing.

Gradient tracking (for strongly non-IID data) is left out of this module.

:class:`ChocoNode` is one node's state, as a ClientApp keeps it in ``context.state``;
:func:`choco_step` runs all nodes at once, as a simulation or a reference does. The two
give identical results.

Pure torch and numpy: no Flower.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from fededge.compress import decode_any
from fededge.compress.codec import Codec
from fededge.netem.clock import SimClock

__all__ = [
    "CHOCO_STATEFUL",
    "GOSSIP_ALGORITHMS",
    "check_choco_codec",
    "ChocoConfig",
    "GossipConfig",
    "ChocoNode",
    "Compressor",
    "GossipError",
    "GossipTimeline",
    "GossipWork",
    "Weights",
    "choco_step",
    "codec_compressor",
    "compress_model",
    "consensus_distance",
    "effective_row",
    "identity",
    "mean_model",
    "mix",
    "mix_row",
    "mixing_row",
    "push_sum_estimates",
    "push_sum_step",
]

Weights = dict[str, torch.Tensor]
#: A compressor Q: a tensor in, its lossy reconstruction (encode then decode) out.
Compressor = Callable[[torch.Tensor], torch.Tensor]


class GossipError(ValueError):
    """Gossip inputs that do not fit together: a node missing a neighbour's message, models
    with different tensors, a mixing matrix of the wrong size."""


def _floating(t: torch.Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


def _same_keys(models: Sequence[Mapping[str, torch.Tensor]], what: str) -> list[str]:
    if not models:
        raise GossipError(f"{what}: need at least one model")
    keys = list(models[0])
    for i, m in enumerate(models):
        if set(m) != set(keys):
            diff = sorted(set(m) ^ set(keys))
            raise GossipError(f"{what}: model {i} has different tensors from model 0 ({diff[:5]}); "
                              f"every node must hold the same architecture")
    return keys


def mix_row(models: Mapping[int, Weights], weights: Mapping[int, float], *, own: int) -> Weights:
    """One node's gossip: ``sum_j weights[j] * models[j]``, the D-PSGD step of node ``own``.

    Parameters
    ----------
    models : mapping of node -> model
        The models of the nodes the row weights (the node's own included).
    weights : mapping of node -> float
        Row ``own`` of W, its nonzero entries (see :func:`mixing_row`).
    own : int
        The node itself: its integer buffers are kept.
    """
    missing = sorted(set(weights) - set(models))
    if missing:
        raise GossipError(f"node {own} weights node(s) {missing} but has no model from them; "
                          f"relay every in-neighbour's model to it")
    if own not in models:
        raise GossipError(f"node {own} has no model of its own among {sorted(models)}; pass it too")
    nodes = list(weights)
    keys = _same_keys([models[j] for j in nodes], f"node {own}'s mixing")
    mine = models[own]
    return {k: sum(models[j][k] * float(weights[j]) for j in nodes) if _floating(mine[k]) else mine[k]
            for k in keys}


def mixing_row(w: np.ndarray, i: int) -> dict[int, float]:
    """Row i of W as ``{node: weight}`` for its nonzero entries (what node i needs)."""
    row = np.asarray(w)[i]
    return {int(j): float(row[j]) for j in np.flatnonzero(row)}


def effective_row(row: Mapping[int, float], available: Iterable[int], *, own: int) -> dict[int, float]:
    """Row ``own`` of W restricted to the nodes whose message arrived, in node order.

    A missing neighbour's weight goes to the node's own model (the row still sums to 1).
    Columns then no longer sum to 1 for that round, so a round with a failure moves the
    average a little; the next full round is exact again. Node and relay call this same
    function, so both form the same mixed model, bit for bit.
    """
    have = set(available) | {own}
    out: dict[int, float] = {}
    spare = 0.0
    for j in sorted(row):
        if j in have:
            out[j] = float(row[j])
        else:
            spare += float(row[j])
    out[own] = out.get(own, 0.0) + spare
    return out


def _check_w(w: np.ndarray, n: int) -> np.ndarray:
    w = np.asarray(w, dtype=np.float64)
    if w.shape != (n, n):
        raise GossipError(f"mixing matrix has shape {w.shape} but there are {n} models; build W "
                          f"for these n nodes")
    return w


def mix(models: Sequence[Weights], w: np.ndarray) -> list[Weights]:
    """D-PSGD's gossip step for every node: ``x_i <- sum_j W[i, j] x_j``.

    W comes from :mod:`fededge.topology` (checked there); any (n, n) matrix is applied as
    given, so the same function serves push-sum's column-stochastic weights.

    Examples
    --------
    >>> import numpy as np, torch
    >>> xs = [{"w": torch.tensor([0.0])}, {"w": torch.tensor([2.0])}]
    >>> mix(xs, np.full((2, 2), 0.5))[0]["w"]
    tensor([1.])
    """
    w = _check_w(w, len(models))
    _same_keys(models, "mix")
    table = dict(enumerate(models))
    return [mix_row(table, mixing_row(w, i), own=i) for i in range(len(models))]


def mean_model(models: Sequence[Weights]) -> Weights:
    """The plain average of the nodes' models (FedAvg with equal weights): the model whose
    accuracy decentralized runs report. Integer buffers are node 0's."""
    n = len(models)
    return mix_row(dict(enumerate(models)), {i: 1.0 / n for i in range(n)}, own=0)


def consensus_distance(models: Sequence[Weights]) -> float:
    """``(1/n) sum_i ||x_i - x̄||^2`` over every floating-point tensor, in float64.

    0 when all nodes agree; gossip without training shrinks it by about ``|lambda_2|^2``
    per round.
    """
    keys = _same_keys(models, "consensus_distance")
    total = 0.0
    for k in keys:
        if not _floating(models[0][k]):
            continue
        stack = torch.stack([m[k].detach().to(torch.float64) for m in models])
        total += float(((stack - stack.mean(dim=0)) ** 2).sum())
    return total / len(models)


# ------------------------------------------------------------------ compressors
def identity(x: torch.Tensor) -> torch.Tensor:
    """The lossless compressor: CHOCO-SGD with it (and gamma = 1) is D-PSGD."""
    return x


def codec_compressor(codec: Codec, *, generator: torch.Generator | None = None) -> Compressor:
    """A :mod:`fededge.compress` codec as a compressor: encode, then decode, back in the
    input's dtype and device (what the receiving neighbours reconstruct).

    ``generator`` seeds the random codecs (qsgd, randk, terngrad). The Flower layer sends
    the payload itself and counts its bytes; this is the arithmetic both ends agree on.

    Examples
    --------
    >>> import torch
    >>> from fededge.compress import build_codec
    >>> q = codec_compressor(build_codec("topk", ratio=0.5))
    >>> q(torch.tensor([1.0, -3.0, 0.5, 2.0]))
    tensor([ 0., -3.,  0.,  2.])
    """
    def compress(x: torch.Tensor) -> torch.Tensor:
        return decode_any(codec.encode(x, generator=generator)).to(dtype=x.dtype, device=x.device)

    return compress


def compress_model(delta: Weights, compressor: Compressor) -> Weights:
    """``Q`` applied to every floating-point tensor of a model-shaped difference; integer
    tensors are left out (they are not gossiped)."""
    out = {}
    for k, v in delta.items():
        if _floating(v):
            q = compressor(v)
            if q.shape != v.shape:
                raise GossipError(f"the compressor turned {k!r} of shape {tuple(v.shape)} into "
                                  f"{tuple(q.shape)}; it must return a tensor of the input's shape")
            out[k] = q
    return out


# ------------------------------------------------------------------ CHOCO-SGD
#: Compressors that keep encoder state of their own (DGC's buffers, PowerSGD's Q): CHOCO's
#: ``q`` must be a stateless function of ``x - x̂``, whose estimates already carry what
#: the compressor dropped (so error feedback is refused too). The run config and
#: :class:`fededge.clients.mods.GossipMod` both refuse them.
CHOCO_STATEFUL: tuple[str, ...] = ("dgc", "powersgd")


def check_choco_codec(compressor: str, error_feedback: bool) -> None:
    """Raise ValueError unless CHOCO-SGD can use this codec setting: a stateless codec
    (not :data:`CHOCO_STATEFUL`) and no error feedback. The one check behind the run
    config's and :class:`~fededge.clients.mods.GossipMod`'s refusals."""
    if compressor in CHOCO_STATEFUL:
        raise ValueError(f"compressor {compressor!r} keeps encoder state of its own, which CHOCO-SGD does not "
                         "support; use a stateless codec (topk, signsgd, qsgd, int8, fp16, ...)")
    if error_feedback:
        raise ValueError("error_feedback must be false with CHOCO-SGD: its public estimates already carry "
                         "what the compressor dropped into the next message")


#: Decentralised algorithms (:attr:`GossipConfig.algorithm`).
GOSSIP_ALGORITHMS: tuple[str, ...] = ("dpsgd", "choco")


#: Why CHOCO-SGD refuses a time-varying topology (the run config, GossipConfig and Gossip say it).
TIME_VARYING_CHOCO = ("'one-peer-exponential' changes peers every round, but CHOCO's public estimates assume a "
                      "static graph (a node keeps estimates of the nodes it hears, not of the next round's); use "
                      "algorithm 'dpsgd' with it, or a static topology such as 'exponential'")


@dataclass(frozen=True, kw_only=True)
class GossipConfig:
    """Who gossips with whom, and how. Run-config keys in brackets; this class declares
    each knob once (default, check, meaning) for the library and for fededge's app.

    Parameters
    ----------
    algorithm : str
        [gossip-algorithm] ``dpsgd`` (Lian et al., 2017: local steps, then
        ``x_i <- sum_j W_ij x_j``; the models travel whole) or ``choco`` (CHOCO-SGD,
        Koloskova et al., 2019: nodes send ``Q(x_i - x̂_i)`` and mix through public
        estimates; :class:`ChocoConfig`).
    topology : str
        [topology] Who hears whom, one of :data:`fededge.topology.TOPOLOGIES` (``ring``,
        ``torus``, ``complete``, ``star``, ``hypercube``, ``erdos-renyi``, ``k-regular``,
        ``exponential``, ``one-peer-exponential``, ``file``). Node i of the graph is the
        i-th connected node in increasing node-id order. A graph the node count cannot
        form (a hypercube of 10) stops the run before training with the TopologyError.
    mixing : str
        [mixing] ``metropolis`` (Metropolis-Hastings, local degrees only) or
        ``max-degree`` (uniform ``1 / (1 + d_max)``). They agree on regular graphs; on the
        complete graph both are the exact average.
    topology_degree : int
        [topology-degree] ``topology="k-regular"``: k, each node's number of neighbours.
    topology_p : float
        [topology-p] ``topology="erdos-renyi"``: the edge probability, in [0, 1]; 0 keeps
        the family's default ``2 ln(n) / n`` (twice the connectivity threshold).
    topology_file : str
        [topology-file] ``topology="file"``: a text file of ``u v`` edges (0-based, ``#``
        comments).
    """

    algorithm: str = "dpsgd"
    topology: str = "ring"
    mixing: str = "metropolis"
    topology_degree: int = 4
    topology_p: float = 0.0
    topology_file: str = ""

    def __post_init__(self) -> None:
        from fededge.topology import MIXINGS, TOPOLOGIES

        for name, value, allowed in (("algorithm", self.algorithm, GOSSIP_ALGORITHMS),
                                     ("topology", self.topology, TOPOLOGIES), ("mixing", self.mixing, MIXINGS)):
            if value not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)}; got {value!r}")
        if self.topology_degree < 1:
            raise ValueError(f"topology_degree must be >= 1, got {self.topology_degree}")
        if not 0.0 <= self.topology_p <= 1.0:
            raise ValueError(f"topology_p must be in [0, 1] (0: the family's default), got {self.topology_p}")
        if self.topology == "file" and not self.topology_file:
            raise ValueError("topology='file' needs topology_file, a file of 'u v' edge lines")
        if self.algorithm == "choco" and self.topology == "one-peer-exponential":
            raise ValueError(TIME_VARYING_CHOCO)

    def topology_params(self) -> dict[str, object]:
        """The knobs the named family takes, as :func:`fededge.topology.build_topology`
        keyword arguments."""
        if self.topology == "k-regular":
            return {"k": self.topology_degree}
        if self.topology == "erdos-renyi" and self.topology_p > 0:
            return {"p": self.topology_p}
        if self.topology == "file":
            return {"path": self.topology_file}
        return {}


@dataclass(frozen=True, kw_only=True)
class ChocoConfig:
    """CHOCO-SGD's knobs. Run-config keys in brackets; declared here once for the
    library (:class:`~fededge.strategies.gossip.Gossip`, :class:`~fededge.clients.mods.GossipMod`)
    and fededge's app.

    Parameters
    ----------
    gamma : float
        [gossip-gamma] The consensus step size, in (0, 1]. With a lossless compressor 1
        is D-PSGD. Koloskova et al. (2019) tune it per compressor (their theory asks for
        a step that shrinks with the compression quality delta and the spectral gap).
        The default 0.05 is for the harshest usual case, top-1%: averaging random vectors
        over a 16-node ring with top-1% (no training), gamma = 1, 0.5 and 0.2 diverged
        within 300 rounds and 0.05 converged. Raise it towards 1 for mild compressors
        (fp16, int8, qsgd with many levels) and with no compression; lower it if the
        consensus distance grows from round to round. On the digits benchmark the scaled
        sign (``signsgd``, about 28x fewer bytes than D-PSGD) trained best at 0.8, within
        a point of D-PSGD (BENCHMARKS.md).
    scale : float
        [choco-scale] What each node scales the difference it compresses by, in [0, 1].
        0 is automatic: ``1 / (1 + omega)`` per tensor for the unbiased codecs (qsgd,
        randk, terngrad: their variance factor omega, see
        ``UpdateConfig.variance_factor``), which makes ``Q`` a contraction as CHOCO's
        analysis needs (Koloskova et al., 2019), and 1 for the others. The codecs are
        positively homogeneous, so scaling before encoding is scaling what every node
        adds to its estimate.
    """

    gamma: float = 0.05
    scale: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 < self.gamma <= 1.0:
            raise ValueError(f"gamma must be in (0, 1], got {self.gamma}")
        if not 0.0 <= self.scale <= 1.0:
            raise ValueError(f"scale must be in [0, 1] (0: automatic), got {self.scale}")


def _apply(hat: Weights, q: Weights) -> Weights:
    if set(hat) != set(q):
        raise GossipError(f"a CHOCO message has tensors {sorted(q)[:5]}, the estimate "
                          f"{sorted(hat)[:5]}; both must cover the model's floating tensors")
    return {k: v + q[k].to(v.dtype) for k, v in hat.items()}  # (a decoded q is float32: the estimate's dtype, everywhere)


class ChocoNode:
    """One node's CHOCO-SGD state: its public estimates ``x̂_j`` of itself and the nodes
    it hears. The one implementation of CHOCO's arithmetic: :func:`choco_step`, the Flower
    client mod (:class:`fededge.clients.mods.GossipMod`) and the relay's evaluation
    (:class:`fededge.strategies.gossip.Gossip`) all drive it.

    Per round, after the local steps give ``x``: ``q = node.message(x, compressor)`` goes
    to the neighbours; once it has every neighbour's ``q_j`` (and its own),
    ``x = node.step(x, messages, row)``. ``state_dict()`` is what goes in
    ``context.state``.

    A runtime where a message can be lost, or where the node encodes ``q`` itself as wire
    payloads, uses the parts of a round: :meth:`difference` (what ``Q`` compresses),
    :meth:`receive` (apply the ``q_j`` that arrived; a lost one is a zero update, which
    keeps every copy of ``x̂_j`` equal) and :meth:`mix` (the consensus step).

    Parameters
    ----------
    config : ChocoConfig
        gamma.
    index : int
        This node.
    neighbours : iterable of int
        The nodes it hears (fixed: CHOCO's estimates assume a static graph).
    init : Weights
        The starting estimate of every ``x̂_j``. Koloskova et al. start from 0; when all
        nodes start from one seeded model, that model is as good a shared start, and the
        first messages are then updates rather than whole models. It must be the same
        at every node.

    Examples
    --------
    >>> import torch
    >>> a = ChocoNode(ChocoConfig(gamma=1.0), index=0, neighbours=[1], init={"w": torch.zeros(1)})
    >>> b = ChocoNode(ChocoConfig(gamma=1.0), index=1, neighbours=[0], init={"w": torch.zeros(1)})
    >>> xa, xb = {"w": torch.tensor([0.0])}, {"w": torch.tensor([2.0])}
    >>> qa, qb = a.message(xa, identity), b.message(xb, identity)
    >>> a.step(xa, {0: qa, 1: qb}, {0: 0.5, 1: 0.5})["w"]
    tensor([1.])
    """

    def __init__(self, config: ChocoConfig, *, index: int, neighbours: Sequence[int],
                 init: Weights) -> None:
        self.config = config
        self.index = int(index)
        nodes = sorted({self.index, *map(int, neighbours)})
        start = {k: v.detach().clone() for k, v in init.items() if _floating(v)}
        self.hats: dict[int, Weights] = {j: {k: v.clone() for k, v in start.items()} for j in nodes}

    @classmethod
    def from_estimates(cls, config: ChocoConfig, index: int, hats: Mapping[int, Mapping[str, torch.Tensor]]
                       ) -> ChocoNode:
        """A node holding the given estimates ``x̂_j`` (its own included), as they are:
        one node's share of shared copies, or the relay's copies after a lost message."""
        if int(index) not in hats:
            raise GossipError(f"the CHOCO state has no estimate of node {index} itself (it holds "
                              f"{sorted(hats)}); it belongs to another node")
        node = cls(config, index=index, neighbours=[], init={})
        # the floating tensors only, as __init__ keeps them (a model's integer buffers are
        # not estimated: its messages never carry them)
        node.hats = {int(j): {k: v for k, v in h.items() if _floating(v)} for j, h in hats.items()}
        return node

    def difference(self, x: Weights) -> Weights:
        """``x_i - x̂_i`` over the floating-point tensors: what ``Q`` compresses."""
        return {k: x[k] - v for k, v in self.hats[self.index].items()}

    def message(self, x: Weights, compressor: Compressor) -> Weights:
        """``q_i = Q(x_i - x̂_i)``: what this node sends. Does not change the state."""
        return compress_model(self.difference(x), compressor)

    def receive(self, messages: Mapping[int, Weights]) -> None:
        """``x̂_j <- x̂_j + q_j`` for every message given (its own ``q_i`` among them).

        A node it hears that sent nothing keeps its estimate: a lost ``q_j`` is a zero
        update, the same at every node that holds a copy of ``x̂_j``. A message from a
        node it does not hear is refused.
        """
        stray = sorted(set(messages) - set(self.hats))
        if stray:
            raise GossipError(f"node {self.index} got messages from {stray}, which it does not hear "
                              f"(it holds estimates of {sorted(self.hats)})")
        self.hats = {j: _apply(h, messages[j]) if j in messages else h for j, h in self.hats.items()}

    def mix(self, x: Weights, row: Mapping[int, float]) -> Weights:
        """The consensus step ``x_i + gamma * sum_j W[i, j] (x̂_j - x̂_i)`` (the diagonal
        term is zero), with row ``index`` of W as ``{node: weight}``."""
        self._check_row(row)
        mine = self.hats[self.index]
        out = dict(x)
        for k in mine:
            drift = sum((self.hats[j][k] - mine[k]) * float(wij) for j, wij in row.items() if j != self.index)
            out[k] = x[k] + self.config.gamma * drift
        return out

    def step(self, x: Weights, messages: Mapping[int, Weights], row: Mapping[int, float]) -> Weights:
        """Apply every ``q_j`` to ``x̂_j`` and return the mixed model.

        Parameters
        ----------
        x : Weights
            This node's model after its local steps (the one :meth:`message` was given).
        messages : mapping of node -> q
            This node's own ``q`` and each neighbour's, every one exactly once.
        row : mapping of node -> float
            Row ``index`` of W, e.g. ``mixing_row(W, index)``.
        """
        if set(messages) != set(self.hats):
            raise GossipError(f"node {self.index} needs the messages of {sorted(self.hats)} (its own "
                              f"included), got {sorted(messages)}; relay each neighbour's message "
                              f"every round")
        self._check_row(row)
        self.receive(messages)
        return self.mix(x, row)

    def _check_row(self, row: Mapping[int, float]) -> None:
        stray = sorted(set(row) - set(self.hats))
        if stray:
            raise GossipError(f"node {self.index}'s mixing row weights {stray}, which it does not hear; "
                              f"build the row from the same topology as the neighbours")

    def state_dict(self) -> Weights:
        return {f"hat/{j}/{k}": v for j, h in self.hats.items() for k, v in h.items()}

    @classmethod
    def from_state_dict(cls, config: ChocoConfig, index: int, state: Mapping[str, torch.Tensor]) -> ChocoNode:
        hats: dict[int, Weights] = {}
        for key, v in state.items():
            kind, _, rest = key.partition("/")
            j, _, name = rest.partition("/")
            if kind != "hat" or not j.isdigit() or not name:
                raise GossipError(f"unknown CHOCO state key {key!r}; expected 'hat/<node>/<tensor>'")
            hats.setdefault(int(j), {})[name] = v
        return cls.from_estimates(config, index, hats)


def choco_step(models: Sequence[Weights], hats: Sequence[Weights], w: np.ndarray, *, gamma: float,
               compressor: Compressor) -> tuple[list[Weights], list[Weights]]:
    """One CHOCO-SGD gossip round for every node at once.

    ``hats[j]`` is the public estimate ``x̂_j``, the same at every node that hears j, so
    one copy per node suffices here. Returns the mixed models and the new estimates;
    the inputs are not modified. Start ``hats`` at zeros or at the common initial model.
    Each node is a :class:`ChocoNode` holding its share of the copies, so this is
    driving one ChocoNode per node, tensor for tensor.
    """
    config = ChocoConfig(gamma=gamma)
    n = len(models)
    w = _check_w(w, n)
    if len(hats) != n:
        raise GossipError(f"{len(hats)} estimates for {n} models; keep one x̂ per node")
    rows = [mixing_row(w, i) for i in range(n)]
    nodes = [ChocoNode.from_estimates(config, i, {j: hats[j] for j in sorted({i, *rows[i]})}) for i in range(n)]
    qs = [node.message(models[i], compressor) for i, node in enumerate(nodes)]
    mixed = [node.step(models[i], {j: qs[j] for j in node.hats}, rows[i]) for i, node in enumerate(nodes)]
    return mixed, [node.hats[i] for i, node in enumerate(nodes)]


# ------------------------------------------------------------------ push-sum
def push_sum_step(models: Sequence[Weights], weights: Sequence[float],
                  p: np.ndarray) -> tuple[list[Weights], list[float]]:
    """One push-sum round with column-stochastic P (``P[i, j]``: share of j's mass i gets).

    The models and the scalar weights (start them at 1) are mixed alike; the de-biased
    model of node i is ``models[i] / weights[i]`` (:func:`push_sum_estimates`), which
    converges to the average of the initial models on any strongly connected directed
    graph. Build P with :func:`fededge.topology.mixing.push_sum_weights`.
    """
    if len(weights) != len(models):
        raise GossipError(f"{len(weights)} push-sum weights for {len(models)} models; keep one per node")
    mixed = mix(models, p)
    return mixed, (np.asarray(p, dtype=np.float64) @ np.asarray(weights, dtype=np.float64)).tolist()


def push_sum_estimates(models: Sequence[Weights], weights: Sequence[float]) -> list[Weights]:
    """Each node's de-biased model ``x_i / w_i`` (integer buffers as they are)."""
    return [{k: v / w if _floating(v) else v for k, v in m.items()} for m, w in zip(models, weights)]


# ------------------------------------------------------------------ the simulated clock
@dataclass(frozen=True)
class GossipWork:
    """What one node did in a gossip round, as measured (for :class:`GossipTimeline`).

    Parameters
    ----------
    client : int
        The node's place on the clock (its partition id: links are assigned by it).
    compute_s : float
        Measured local computation of the round.
    bytes_up : int
        Its gossip message (what each out-neighbour receives).
    bytes_down : int
        What it must receive before it can start, apart from its neighbours' messages:
        the round's config, the initial model in round 1, a resynchronisation.
    """

    client: int
    compute_s: float
    bytes_up: int
    bytes_down: int = 0


class GossipTimeline:
    """When each gossip round happens on the simulated clock, edge by edge.

    Node c's round t starts when its round t-1 compute is done, its round-t extras
    (``bytes_down``, sent when its previous compute ended) have arrived, and the round
    t-1 messages of its in-neighbours have arrived. Its message then goes up its own
    uplink, and the relay forwards it down each out-neighbour's downlink as soon as it
    is in: an edge j -> i costs j's uplink then i's downlink, with both endpoints'
    profiles. Messages arriving at one node queue on its downlink in the order they
    reach the relay. There is no global barrier: a slow node delays only its
    neighbours, and them only through its message.

    The round's end, what ``round_sim_s`` reports, is when every node has what its next
    round needs (its own compute done and its in-neighbours' messages in): the mixing of
    round t is then complete everywhere.

    Flower's lock-step loop (all replies in before any forwarding) is only how the
    simulation executes; the clock models a relay that forwards each message on arrival,
    the timing a peer-to-peer transport or a pipelined relay would give.

    Built only from the clock's primitives (``send_down``, ``compute``, ``send_up``).
    """

    def __init__(self, clock: SimClock) -> None:
        self.clock = clock
        self.free: dict[int, float] = {}  # node -> end of its last compute
        self.ready: dict[int, float] = {}  # node -> its in-neighbours' last messages arrived
        self.started: dict[tuple[int, int], float] = {}  # (round, node) -> compute start
        self.waited: dict[tuple[int, int], float] = {}  # time idle between its computes
        self.at_relay: dict[tuple[int, int], float] = {}  # (round, node) -> message at the relay
        self.end: dict[int, float] = {0: 0.0}

    def run_round(self, t: int, work: Sequence[GossipWork], edges: Iterable[tuple[int, int]]) -> float:
        """Schedule round ``t`` and return its end.

        ``edges`` are the round's deliveries ``(sender, receiver)`` (clients), one per
        logical directed edge whose sender's message exists; each carries the sender's
        ``bytes_up``.
        """
        size = {}
        for w in work:
            c = w.client
            free = self.free.get(c, 0.0)
            got = self.clock.send_down(c, w.bytes_down, free) if w.bytes_down else free
            begin = max(free, got, self.ready.get(c, 0.0))
            self.started[(t, c)] = begin
            self.waited[(t, c)] = begin - free
            self.free[c] = self.clock.compute(c, w.compute_s, begin)
            self.at_relay[(t, c)] = self.clock.send_up(c, w.bytes_up, self.free[c])
            size[c] = w.bytes_up
        incoming: dict[int, list[int]] = {}
        for s, r in edges:
            if s not in size:
                raise GossipError(f"round {t}: an edge from node {s}, which sent no message this round")
            incoming.setdefault(r, []).append(s)
        end = self.end.get(t - 1, 0.0)
        for r in sorted(set(incoming) | set(size)):
            arrived = [self.clock.send_down(r, size[s], self.at_relay[(t, s)])
                       for s in sorted(incoming.get(r, []), key=lambda s: (self.at_relay[(t, s)], s))]
            self.ready[r] = max([self.free.get(r, 0.0), *arrived])
            end = max(end, self.ready[r])
        self.end[t] = end
        self.clock.now = max(self.clock.now, end)
        return end
