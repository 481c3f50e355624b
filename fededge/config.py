"""The run config: read once, into one typed and validated dataclass.

Flower hands a ServerApp and a ClientApp the run config as a flat mapping of kebab-case
keys (``[tool.flwr.app.config]`` in pyproject.toml, overridden with ``flwr run . \
--run-config "local-steps=10 alpha=0.1"``). :meth:`RunConfig.from_mapping` is the one
place that mapping is read. An unknown key or a bad value raises :class:`ConfigError`,
naming the key and what is allowed, before any training starts.

This module is pure: no Flower, no torch.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Union

if TYPE_CHECKING:
    from fededge.compress.update import UpdateConfig

from fededge.data.datasets import DATASETS
from fededge.errors import ConfigError  # raised here for the run config; defined apart for the library
from fededge.data.partition import PARTITIONS
from fededge.models.zoo import MODELS
from fededge.netem.assign import check_netem_spec, check_speed_spec
from fededge.topology import MIXINGS, TOPOLOGIES

__all__ = ["ConfigError", "RunConfig", "STRATEGIES", "DEVICES", "GOSSIP_ALGORITHMS"]

#: Strategies selectable with ``strategy=...``; fededge.strategies.registry builds them.
#: ``dga`` and ``diloco`` are fededge's (fededge.strategies); the others are Flower's own
#: classes from ``flwr.serverapp.strategy``.
STRATEGIES: tuple[str, ...] = (
    "fedavg",
    "fedavgm",
    "fedprox",
    "fedadam",
    "fedadagrad",
    "fedyogi",
    "fedmedian",
    "fedtrimmedavg",
    "krum",
    "dga",
    "diloco",
    "gossip",
    "fedasync",
    "fedbuff",
    "ssp",
    "backup",
)
STALENESS: tuple[str, ...] = ("constant", "polynomial", "hinge")
ASYNC_ORDER: tuple[str, ...] = ("auto", "clock", "arrival")
DGA_PIPELINE: tuple[str, ...] = ("auto", "on", "off")
GOSSIP_ALGORITHMS: tuple[str, ...] = ("dpsgd", "choco")
DEVICES: tuple[str, ...] = ("auto", "cpu", "cuda")
PROGRESS: tuple[str, ...] = ("auto", "bar", "lines", "off")

_DEVICE_RE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """Every knob of a fededge run. Field ``local_steps`` is run-config key ``local-steps``.

    Parameters
    ----------
    strategy : str
        Server strategy, one of :data:`STRATEGIES`. ``fedavg`` is FedAvg weighted by
        examples (McMahan et al., 2017); ``dga`` is Delayed Gradient Averaging (Zhu et
        al., 2021; ``dga-*`` keys); ``diloco`` is FedAvg with an outer Nesterov-momentum
        SGD step on the averaged update (the local SGD / DiLoCo line); ``gossip`` is
        decentralized training over a topology, with no global average (D-PSGD or
        CHOCO-SGD; ``topology``, ``mixing``, ``gossip-*`` keys; docs/topology.md); the
        others are Flower's classes.
    num_rounds : int
        Communication rounds.
    clients_per_round : int or float
        An int >= 1 selects that many clients per round; the run waits (up to
        ``round-timeout``) until that many nodes are connected and fails, saying so, if
        they never are. A float in (0, 1] selects that fraction of the connected nodes.
    min_available_nodes : int
        Before round 1, wait (up to ``round-timeout``) until this many nodes are
        connected. In a deployment where SuperNodes come up one by one, set it to their
        number so that round 1 does not train on whichever few are up. 0: do not wait.
    local_steps : int
        K, the SGD steps each selected client runs per round (local SGD). K = 1 is
        synchronous mini-batch SGD with a parameter average each step.
    local_lr, momentum, weight_decay : float
        The client's SGD optimiser. Momentum buffers restart every round.
    batch_size : int
        Mini-batch size on the client.
    dataset : str
        One of ``digits`` (bundled with scikit-learn), ``synthetic``, ``mnist`` (IDX
        files) or ``cifar10`` (python batches); the last two read ``data-dir``.
    data_dir : str
        Directory for on-disk data sets. A node's own ``data-dir`` wins
        (``flower-supernode --node-config 'partition-id=0 num-partitions=4
        data-dir="/data"'``; Flower parses node-config values as TOML, so quote strings).
    synthetic_samples : int
        Size of the ``synthetic`` and ``synthetic-images`` data sets.
    synthetic_amplitude : float
        ``synthetic-images``: the class template's amplitude against unit pixel noise
        (0.35; lower is harder, e.g. 0.1 with 12,000 samples for ``cnn-fedavg``).
    partition : str
        ``iid``, ``dirichlet`` (label skew with concentration ``alpha``) or ``shards``.
    alpha : float
        Dirichlet concentration: small (0.1) is very non-IID, large (100) near IID.
    shards_per_client : int
        Shards per client for ``partition=shards`` (2 in McMahan et al.).
    min_partition_size : int
        The Dirichlet split is redrawn until every client has at least this many
        examples.
    model : str
        ``mlp``, ``cnn``, ``cnn-fedavg`` (McMahan et al.'s CNN, 1.66M parameters on
        MNIST) or ``resnet18`` (CIFAR variant).
    seed : int
        Seeds the model initialisation, the partition, client sampling and batches.
    device : str
        Where clients train: ``auto`` (CUDA when available, else CPU), ``cpu``, ``cuda``
        or ``cuda:N``.
    server_device : str
        Where the server evaluates the global model; same values. Separate from
        ``device`` so that GPU clients can report to a CPU-only SuperLink host.
    client_threads : int
        torch intra-op threads for local training (``torch.set_num_threads``); 0 keeps
        torch's default (one per core). The default 1 suits simulation, where many
        clients share the machine, and small models, whose per-step threading
        overhead exceeds the work (8x slower with 2 threads on the digits CNN here).
        A real device training a large model may want all its cores.
    target_accuracy : float
        Accuracy at which rounds, time and bytes "to target" are recorded.
    results_dir : str
        Each run writes ``<results-dir>/<run-id>/``. A relative path is relative to the
        ServerApp's working directory: with ``fededge simulate`` and ``fededge run`` that
        is where you ran them; with a plain ``flwr run`` it is wherever the detached
        local SuperLink was first started. The absolute path is printed at the start.
    run_name : str
        Optional prefix of the run id.
    save_model : bool
        Write the final global model to ``<run-dir>/model.pt`` (a torch state_dict).
    server_lr : float
        Server learning rate of ``fedavgm`` / ``fedadam`` / ``fedadagrad`` / ``fedyogi``
        (Reddi et al., 2021) / ``diloco``. 0 keeps the strategy's own default (Flower's:
        1.0 for FedAvgM, 0.1 for the adaptive ones; 0.7 for ``diloco``, as in Douillard
        et al., 2023). Ignored by ``fedavg``.
    server_momentum : float
        Server momentum of ``fedavgm`` (heavy ball, Hsu et al., 2019) and ``diloco``
        (Nesterov).
    proximal_mu : float
        FedProx's proximal coefficient (Li et al., 2020); only with ``fedprox``.
    trimmed_beta : float
        Fraction trimmed at each end by ``fedtrimmedavg``.
    krum_byzantine : int
        Number of malicious clients Krum tolerates.
    fraction_evaluate : float
        Fraction of clients that also evaluate the global model on their local data
        each round (federated evaluation). Centralised evaluation on the held-out test
        set runs every round regardless.
    round_timeout : float
        Seconds the server waits for the replies of one round.
    netem : str
        The emulated network on the simulated clock (``sim_s``): ``""`` (ideal: compute
        only), a profile name for every client (``"4g"``; ``fededge netem profiles`` lists
        them), a seeded mix (``"wifi:0.5,4g:0.5"``) or ``"file"`` (the ``[assign]`` table of
        ``netem-file``). See :mod:`fededge.netem.assign`.
    netem_file : str
        A TOML file with extra profiles and optional ``[assign]`` / ``[speed]`` tables.
    compressor, error_feedback, lossless, qsgd_levels, qsgd_bucket, topk_ratio, topk_values, powersgd_rank, \
    int8_block, threshold_tau, dgc_sparsity, dgc_warmup_rounds, dgc_momentum, \
    dgc_clip_norm, compress_min_numel, compress_small_codec
        Uplink compression (``compressor = "none"`` sends full weights). See
        :class:`fededge.compress.update.UpdateConfig` for each knob, and docs/compression.md.
        Example: ``compressor="qsgd" qsgd-levels=16 error-feedback=true``.
    downlink_compressor : str
        ``none``, ``fp16`` or ``bf16``: cast the model the server broadcasts.
    compute_speed : str
        Device speed factors: ``"1.0"``, ``"lognormal:0.5"`` (heterogeneous, seeded) or
        ``"file"``. A factor of 2 computes twice as fast as the measuring machine.
    dga_delay : int
        ``strategy="dga"``: D, how many rounds (of K local steps) an average stays in
        flight before clients apply it. 0 is FedAvg with K local steps, bit for bit.
    dga_correction : bool
        DGA's correction: swap the client's own stale update for the average (Zhu et al.,
        2021). ``false`` is plain delayed averaging, for the ablation.
    dga_warmup_rounds : int
        The first rounds run with D = 0.
    dga_pipeline : str
        ``auto`` pushes rounds ahead (real overlap) where the grid runs each node's
        messages in order (a SuperLink deployment, the in-process runtime) and keeps one
        message per node in flight elsewhere (Ray simulation); ``on`` / ``off`` force it.
        See docs/algorithms.md.
    topology : str
        ``strategy="gossip"``: who hears whom, one of
        :data:`fededge.topology.TOPOLOGIES` (``ring``, ``torus``, ``complete``, ``star``,
        ``hypercube``, ``erdos-renyi``, ``k-regular``, ``exponential``,
        ``one-peer-exponential``, ``file``). Node i of the graph is the i-th connected
        node in increasing node-id order. A graph the node count cannot form (a
        hypercube of 10) stops the run before training with the TopologyError.
    topology_file : str
        ``topology="file"``: a text file of ``u v`` edges (0-based, ``#`` comments).
    topology_degree : int
        ``topology="k-regular"``: k, each node's number of neighbours.
    topology_p : float
        ``topology="erdos-renyi"``: the edge probability; 0 keeps the family's default
        ``2 ln(n) / n`` (twice the connectivity threshold).
    mixing : str
        ``metropolis`` (Metropolis-Hastings, local degrees only) or ``max-degree``
        (uniform ``1 / (1 + d_max)``). They agree on regular graphs; on the complete
        graph both are the exact average.
    gossip_algorithm : str
        ``dpsgd`` (Lian et al., 2017: local steps, then ``x_i <- sum_j W_ij x_j``; the
        models travel whole) or ``choco`` (CHOCO-SGD, Koloskova et al., 2019: nodes send
        ``Q(x_i - x̂_i)`` with the codec ``compressor`` names and mix through public
        estimates). D-PSGD with a compressor is refused: use ``choco``.
    gossip_gamma : float
        CHOCO's consensus step size, in (0, 1]. With a lossless compressor 1 is D-PSGD.
        Koloskova et al. (2019) tune it per compressor (their theory asks for a step that
        shrinks with the compression quality delta and the spectral gap). The default
        0.05 is for the harshest usual case, top-1%: averaging random vectors over a
        16-node ring with top-1% (no training), gamma = 1, 0.5 and 0.2 diverged within
        300 rounds and 0.05 converged. Raise it towards 1 for mild compressors (fp16,
        int8, qsgd with many levels) and with ``compressor="none"``; lower it if the
        consensus distance grows from round to round. On the digits benchmark the
        scaled sign (``compressor="signsgd"``, about 28x fewer bytes than D-PSGD) trained
        best at 0.8, within a point of D-PSGD (BENCHMARKS.md).
    choco_scale : float
        CHOCO-SGD: what each node scales the difference it compresses by, in [0, 1].
        0 (default) is automatic: ``1 / (1 + omega)`` per tensor for the unbiased codecs
        (qsgd, randk, terngrad: their variance factor omega, see
        ``UpdateConfig.variance_factor``), which makes ``Q`` a contraction as CHOCO's
        analysis needs (Koloskova et al., 2019), and 1 for the others. The codecs are
        positively homogeneous, so scaling before encoding is scaling what every node adds
        to its estimate.
    async_alpha : float
        ``strategy="fedasync"``: the mixing weight ``alpha`` in (0, 1]; an update ``tau``
        versions stale is mixed in with ``alpha * s(tau)`` (Xie et al., 2019, use 0.6).
    buffer_size : int
        ``strategy="fedbuff"``: K, the updates per aggregation (Nguyen et al., 2022, use
        10). K equal to the number of clients, with no staleness, is FedAvg.
    staleness : str
        How FedAsync and FedBuff weight a stale update: ``constant`` (1), ``polynomial``
        (``(1 + tau) ** -a``) or ``hinge`` (1 up to ``b``, then ``1 / (a (tau - b) + 1)``).
    staleness_a, staleness_b : float
        The staleness function's ``a`` and ``b`` (FedAsync: polynomial a = 0.5; hinge
        a = 10, b = 4).
    ssp_bound : int
        ``strategy="ssp"``: s, how many rounds a client may run ahead of the slowest
        active one. 0 is bulk-synchronous.
    async_concurrency : int
        fedasync / fedbuff / ssp: how many clients train at once (0: every participant).
    async_order : str
        ``auto``, ``clock`` (use arrivals in simulated-time order: simulation) or
        ``arrival`` (in real arrival order: a SuperLink deployment). ``auto`` picks
        ``arrival`` on a SuperLink.
    backup_workers : int or float
        ``strategy="backup"``: e, of the ``clients-per-round`` sampled each round, the
        replies not waited for: the first ``m = sampled - e`` are aggregated. A count, or
        a fraction of the sampled clients (0.1). 0 is FedAvg.
    dropout : float
        Fraction of the clients (partition ids, seeded) that never answer, in [0, 1):
        they reply at once that they dropped out and the simulated clock charges the
        server ``round-timeout`` for them, as a real silent node would cost. For testing
        what stragglers and dropouts do to a strategy.
    sim_step_s : float
        Seconds per local step on the simulated clock (divided by the client's speed
        factor); 0 uses each client's measured compute time. Set it to make ``sim_s``,
        and the order of asynchronous arrivals, exactly reproducible for a seed.
    progress : str
        ``auto`` (a live bar on a terminal, else one line per round), ``bar``,
        ``lines`` or ``off``.
    """

    strategy: str = "fedavg"
    num_rounds: int = 20
    clients_per_round: Union[int, float] = 1.0
    min_available_nodes: int = 0
    local_steps: int = 20
    local_lr: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 0.0
    batch_size: int = 32
    dataset: str = "digits"
    data_dir: str = ""
    synthetic_samples: int = 6000
    synthetic_amplitude: float = 0.35
    partition: str = "dirichlet"
    alpha: float = 0.5
    shards_per_client: int = 2
    min_partition_size: int = 10
    model: str = "cnn"
    seed: int = 0
    device: str = "auto"
    server_device: str = "auto"
    client_threads: int = 1
    target_accuracy: float = 0.9
    results_dir: str = "results"
    run_name: str = ""
    save_model: bool = True
    server_lr: float = 0.0
    server_momentum: float = 0.9
    proximal_mu: float = 0.01
    trimmed_beta: float = 0.2
    krum_byzantine: int = 0
    fraction_evaluate: float = 0.0
    round_timeout: float = 3600.0
    netem: str = ""
    netem_file: str = ""
    compute_speed: str = "1.0"
    compressor: str = "none"
    error_feedback: bool = False
    lossless: bool = False
    qsgd_levels: int = 16
    qsgd_bucket: int = 512
    topk_ratio: float = 0.01
    topk_values: str = "fp32"
    powersgd_rank: int = 2
    int8_block: int = 0
    threshold_tau: float = 1e-3
    dgc_sparsity: float = 0.999
    dgc_warmup_rounds: int = 4
    dgc_momentum: float = 0.9
    dgc_clip_norm: float = 0.0
    compress_min_numel: int = 256
    compress_small_codec: str = "raw"
    downlink_compressor: str = "none"
    dga_delay: int = 0
    dga_correction: bool = True
    dga_warmup_rounds: int = 0
    dga_pipeline: str = "auto"
    topology: str = "ring"
    topology_file: str = ""
    topology_degree: int = 4
    topology_p: float = 0.0
    mixing: str = "metropolis"
    gossip_algorithm: str = "dpsgd"
    gossip_gamma: float = 0.05
    choco_scale: float = 0.0
    async_alpha: float = 0.6
    buffer_size: int = 10
    staleness: str = "polynomial"
    staleness_a: float = 0.5
    staleness_b: float = 4.0
    ssp_bound: int = 2
    async_concurrency: int = 0
    async_order: str = "auto"
    backup_workers: Union[int, float] = 0
    dropout: float = 0.0
    sim_step_s: float = 0.0
    progress: str = "auto"

    def __post_init__(self) -> None:
        _choice("strategy", self.strategy, STRATEGIES)
        _choice("dataset", self.dataset, DATASETS)
        _choice("partition", self.partition, PARTITIONS)
        _choice("model", self.model, MODELS)
        _choice("progress", self.progress, PROGRESS)
        for key, value in (("device", self.device), ("server-device", self.server_device)):
            if not _DEVICE_RE.match(value):
                raise ConfigError(
                    f"run-config key '{key}' must be one of auto, cpu, cuda or cuda:N, "
                    f"got {value!r}"
                )
        if not 0 <= self.seed < 2**32:
            raise ConfigError(f"run-config key 'seed' must be in [0, 2**32), got {self.seed}")
        _int_at_least("num-rounds", self.num_rounds, 1)
        _int_at_least("local-steps", self.local_steps, 1)
        _int_at_least("batch-size", self.batch_size, 1)
        _int_at_least("synthetic-samples", self.synthetic_samples, 20)
        _positive("synthetic-amplitude", self.synthetic_amplitude)
        _int_at_least("shards-per-client", self.shards_per_client, 1)
        _int_at_least("min-partition-size", self.min_partition_size, 1)
        _int_at_least("krum-byzantine", self.krum_byzantine, 0)
        _int_at_least("client-threads", self.client_threads, 0)
        _int_at_least("min-available-nodes", self.min_available_nodes, 0)
        cpr = self.clients_per_round
        if isinstance(cpr, bool) or not isinstance(cpr, (int, float)):
            raise ConfigError(
                "run-config key 'clients-per-round' must be an int >= 1 (a count) or a "
                f"float in (0, 1] (a fraction), got {cpr!r}"
            )
        if isinstance(cpr, int) and cpr < 1:
            raise ConfigError(
                f"run-config key 'clients-per-round' must be >= 1 as a count, got {cpr}; "
                "write a float such as 0.5 for a fraction"
            )
        if isinstance(cpr, float) and not 0.0 < cpr <= 1.0:
            raise ConfigError(
                "run-config key 'clients-per-round' as a fraction must be in (0, 1], "
                f"got {cpr}; write an int such as 10 for a count"
            )
        _positive("local-lr", self.local_lr)
        _positive("alpha", self.alpha)
        _positive("round-timeout", self.round_timeout)
        _in_range("momentum", self.momentum, 0.0, 1.0, hi_open=True)
        _in_range("server-momentum", self.server_momentum, 0.0, 1.0, hi_open=True)
        _in_range("target-accuracy", self.target_accuracy, 0.0, 1.0, lo_open=True)
        _in_range("fraction-evaluate", self.fraction_evaluate, 0.0, 1.0)
        _in_range("trimmed-beta", self.trimmed_beta, 0.0, 0.5, hi_open=True)
        if self.server_lr < 0:
            raise ConfigError(f"run-config key 'server-lr' must be >= 0 (0 = strategy default), got {self.server_lr}")
        if self.weight_decay < 0:
            raise ConfigError(f"run-config key 'weight-decay' must be >= 0, got {self.weight_decay}")
        if self.proximal_mu < 0:
            raise ConfigError(f"run-config key 'proximal-mu' must be >= 0, got {self.proximal_mu}")
        try:
            check_netem_spec(self.netem)
        except ValueError as err:
            raise ConfigError(f"run-config key 'netem': {err}") from None
        try:
            check_speed_spec(self.compute_speed)
        except ValueError as err:
            raise ConfigError(f"run-config key 'compute-speed': {err}") from None
        if "file" in (self.netem, self.compute_speed) and not self.netem_file:
            raise ConfigError("run-config key 'netem-file' must name a TOML file when netem or "
                              "compute-speed is 'file'")
        try:
            self.update_config()
        except ValueError as err:
            msg = str(err)
            raise ConfigError(f"run-config {msg}" if msg.startswith("'") else
                              f"run-config key 'compressor': {msg}") from None
        _choice("downlink-compressor", self.downlink_compressor, ("none", "fp16", "bf16"))
        _int_at_least("dga-delay", self.dga_delay, 0)
        _int_at_least("dga-warmup-rounds", self.dga_warmup_rounds, 0)
        _choice("dga-pipeline", self.dga_pipeline, DGA_PIPELINE)
        if self.strategy == "dga" and self.downlink_compressor != "none" and self.compressor == "none":
            raise ConfigError(
                "run-config key 'downlink-compressor' with strategy='dga' needs a 'compressor' too: "
                "the clients start from the rounded G(g) and the server keeps the exact one, so "
                "replies must be deltas (compressed uplinks, rebuilt on the exact G(g)); a full-"
                "weight reply would carry the rounding into every later global model. Set "
                "compressor (e.g. \"raw\", lossless) or downlink-compressor=\"none\""
            )
        self._check_gossip()
        self._check_async()
        if not self.results_dir:
            raise ConfigError("run-config key 'results-dir' must not be empty")
        if not re.fullmatch(r"[A-Za-z0-9._-]*", self.run_name):
            raise ConfigError(
                "run-config key 'run-name' may hold only letters, digits, '.', '_' and '-', "
                f"got {self.run_name!r}"
            )

    def _check_gossip(self) -> None:
        _choice("topology", self.topology, TOPOLOGIES)
        _choice("mixing", self.mixing, MIXINGS)
        _choice("gossip-algorithm", self.gossip_algorithm, GOSSIP_ALGORITHMS)
        _int_at_least("topology-degree", self.topology_degree, 1)
        _in_range("topology-p", self.topology_p, 0.0, 1.0)
        _in_range("gossip-gamma", self.gossip_gamma, 0.0, 1.0, lo_open=True)
        _in_range("choco-scale", self.choco_scale, 0.0, 1.0)
        if self.topology == "file" and not self.topology_file:
            raise ConfigError("run-config key 'topology-file' must name a file of 'u v' edge lines "
                              "when topology='file'")
        if self.strategy != "gossip":
            return
        if self.clients_per_round != 1.0 or isinstance(self.clients_per_round, int):
            raise ConfigError(
                "run-config key 'clients-per-round' must be 1.0 with strategy='gossip': every "
                f"connected node is a node of the graph and trains every round (got "
                f"{self.clients_per_round!r}); use min-available-nodes to wait for N nodes")
        if self.fraction_evaluate > 0:
            raise ConfigError(
                "run-config key 'fraction-evaluate' must be 0 with strategy='gossip': there is no "
                "global model to send; the server evaluates every node's model and their average "
                "on the test set each round")
        if self.downlink_compressor != "none":
            raise ConfigError(
                "run-config key 'downlink-compressor' must be 'none' with strategy='gossip': the "
                "relay forwards the nodes' own messages; compress them with gossip-algorithm="
                "'choco' and 'compressor'")
        if self.gossip_algorithm == "dpsgd" and self.compressor != "none":
            raise ConfigError(
                f"run-config key 'compressor' is {self.compressor!r} but gossip-algorithm='dpsgd' "
                "sends whole models (compressing them without CHOCO's estimates drifts); use "
                "gossip-algorithm='choco' for compressed gossip, or compressor='none'")
        if self.gossip_algorithm == "choco":
            from fededge.algorithms.gossip import CHOCO_STATEFUL  # torch is loaded already (update_config)

            if self.compressor in CHOCO_STATEFUL:
                raise ConfigError(
                    f"run-config key 'compressor': {self.compressor!r} keeps encoder state of its "
                    "own and is not supported by gossip-algorithm='choco'; use a stateless codec "
                    "(topk, qsgd, int8, fp16, ...)")
            if self.error_feedback:
                raise ConfigError(
                    "run-config key 'error-feedback' must be false with gossip-algorithm='choco': "
                    "CHOCO's public estimates already carry what the compressor dropped into the "
                    "next message")
            if self.topology == "one-peer-exponential":
                raise ConfigError(
                    "run-config key 'topology': 'one-peer-exponential' changes peers every round, "
                    "but CHOCO's public estimates assume a static graph; use gossip-algorithm="
                    "'dpsgd' with it, or a static topology such as 'exponential'")

    def _check_async(self) -> None:
        _in_range("async-alpha", self.async_alpha, 0.0, 1.0, lo_open=True)
        _int_at_least("buffer-size", self.buffer_size, 1)
        _choice("staleness", self.staleness, STALENESS)
        if self.staleness_a < 0 or self.staleness_b < 0:
            raise ConfigError(f"run-config keys 'staleness-a' and 'staleness-b' must be >= 0, got "
                              f"{self.staleness_a} and {self.staleness_b}")
        _int_at_least("ssp-bound", self.ssp_bound, 0)
        _int_at_least("async-concurrency", self.async_concurrency, 0)
        _choice("async-order", self.async_order, ASYNC_ORDER)
        e = self.backup_workers
        if isinstance(e, bool) or not isinstance(e, (int, float)) or e < 0 or (isinstance(e, float) and e >= 1):
            raise ConfigError(
                "run-config key 'backup-workers' must be an int >= 0 (a count) or a float in "
                f"[0, 1) (a fraction of the sampled clients), got {e!r}")
        _in_range("dropout", self.dropout, 0.0, 1.0, hi_open=True)
        if self.sim_step_s < 0:
            raise ConfigError(f"run-config key 'sim-step-s' must be >= 0 (0: measured compute), got {self.sim_step_s}")
        if self.strategy in ("fedasync", "fedbuff", "ssp", "backup") and (
                self.compressor != "none" or self.downlink_compressor != "none"):
            raise ConfigError(
                f"run-config keys 'compressor' / 'downlink-compressor' are not supported with "
                f"strategy={self.strategy!r} yet (its replies are used one by one, against the "
                "model version each client trained on); set them to 'none'")

    # ------------------------------------------------------------------ mapping I/O
    @classmethod
    def keys(cls) -> tuple[str, ...]:
        """All run-config keys (kebab-case), in declaration order."""
        return tuple(_kebab(f.name) for f in dataclasses.fields(cls))

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, Any]) -> "RunConfig":
        """Parse Flower's ``context.run_config`` (or any mapping of kebab-case keys).

        Keys not given keep their defaults. Raises :class:`ConfigError` for an unknown
        key (with the closest valid key), a value of the wrong type, or a value out of
        range.
        """
        fields = {f.name: f for f in dataclasses.fields(cls)}
        known = cls.keys()
        kwargs: dict[str, Any] = {}
        for key, value in mapping.items():
            name = key.replace("-", "_")
            if name not in fields or "_" in key:
                close = difflib.get_close_matches(key.replace("_", "-"), known, n=1)
                hint = f"; did you mean '{close[0]}'?" if close else ""
                raise ConfigError(
                    f"unknown run-config key '{key}'{hint} Valid keys: {', '.join(known)}"
                )
            kwargs[name] = _coerce(key, value, fields[name].default)
        return cls(**kwargs)

    def to_mapping(self) -> dict[str, Any]:
        """The config as kebab-case keys, the form Flower and ``config.json`` use."""
        return {_kebab(k): v for k, v in dataclasses.asdict(self).items()}

    def update_config(self) -> "UpdateConfig":
        """The uplink compression knobs as :class:`fededge.compress.update.UpdateConfig`."""
        from fededge.compress.update import UpdateConfig

        return UpdateConfig(
            compressor=self.compressor, error_feedback=self.error_feedback, lossless=self.lossless,
            qsgd_levels=self.qsgd_levels, qsgd_bucket=self.qsgd_bucket, topk_ratio=self.topk_ratio, topk_values=self.topk_values,
            powersgd_rank=self.powersgd_rank,
            int8_block=self.int8_block, threshold_tau=self.threshold_tau, dgc_sparsity=self.dgc_sparsity,
            dgc_warmup_rounds=self.dgc_warmup_rounds, dgc_momentum=self.dgc_momentum,
            dgc_clip_norm=self.dgc_clip_norm, min_numel=self.compress_min_numel,
            small_codec=self.compress_small_codec, seed=self.seed,
        )

    def topology_params(self) -> dict[str, Any]:
        """The ``topology-*`` keys the named family takes, as
        :func:`fededge.topology.build_topology` keyword arguments."""
        if self.topology == "k-regular":
            return {"k": self.topology_degree}
        if self.topology == "erdos-renyi" and self.topology_p > 0:
            return {"p": self.topology_p}
        if self.topology == "file":
            return {"path": self.topology_file}
        return {}

    def replace(self, **changes: Any) -> "RunConfig":
        """A copy with some fields changed (snake_case names), validated again."""
        return dataclasses.replace(self, **changes)


def _kebab(name: str) -> str:
    return name.replace("_", "-")


def _coerce(key: str, value: Any, default: Any) -> Any:
    """Check ``value`` against the type of the field's default."""
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise ConfigError(f"run-config key '{key}' must be true or false, got {value!r}")
        return value
    if isinstance(value, bool):
        raise ConfigError(f"run-config key '{key}' must be a {type(default).__name__}, got {value!r}")
    if key in ("clients-per-round", "backup-workers"):
        return value  # int or float: __post_init__ says which is which
    if isinstance(default, float):
        if not isinstance(value, (int, float)):
            raise ConfigError(f"run-config key '{key}' must be a number, got {value!r}")
        return float(value)
    if isinstance(default, int):
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if not isinstance(value, int):
            raise ConfigError(f"run-config key '{key}' must be an integer, got {value!r}")
        return value
    if isinstance(default, str) and not isinstance(value, str):
        raise ConfigError(f"run-config key '{key}' must be a string, got {value!r}")
    return value


def _choice(key: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(
            f"run-config key '{key}' must be one of {', '.join(allowed)}; got {value!r}"
        )


def _int_at_least(key: str, value: int, low: int) -> None:
    if value < low:
        raise ConfigError(f"run-config key '{key}' must be >= {low}, got {value}")


def _positive(key: str, value: float) -> None:
    if not value > 0:
        raise ConfigError(f"run-config key '{key}' must be > 0, got {value}")


def _in_range(
    key: str, value: float, lo: float, hi: float, *, lo_open: bool = False, hi_open: bool = False
) -> None:
    ok_lo = value > lo if lo_open else value >= lo
    ok_hi = value < hi if hi_open else value <= hi
    if not (ok_lo and ok_hi):
        left = "(" if lo_open else "["
        right = ")" if hi_open else "]"
        raise ConfigError(f"run-config key '{key}' must be in {left}{lo}, {hi}{right}, got {value}")
