"""The run config: read once, into one typed and validated dataclass.

Flower hands a ServerApp and a ClientApp the run config as a flat mapping of kebab-case
keys (``[tool.flwr.app.config]`` in pyproject.toml, overridden with ``flwr run . \
--run-config "local-steps=10 alpha=0.1"``). :meth:`RunConfig.from_mapping` is the one
place that mapping is read. An unknown key or a bad value raises :class:`ConfigError`,
naming the key and what is allowed, before any training starts.

The knobs of fededge's library pieces (compression, DGA, gossip, the asynchronous
strategies, the simulated clock) are declared once, by the config objects those pieces
take: their default, their check and their meaning live there, and :data:`OWNED` says
which run-config key is which object's knob. ``RunConfig`` takes those defaults from the
owners and checks a value by building the owner, so a knob set through the run config and
the same knob given to the library object cannot disagree (tests/test_knobs.py holds every
key of :data:`OWNED` to that). The keys that only fededge's own app has (the data set, the
model, sampling, results) are declared here.

This module is pure: no Flower (torch comes with the owners' modules).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar, Union

from fededge.algorithms.asyncfl import AsyncConfig, LoopConfig, StalenessFunction
from fededge.algorithms.dga import DGAConfig
from fededge.algorithms.schedules import LR_SCHEDULES
from fededge.algorithms.gossip import GOSSIP_ALGORITHMS, ChocoConfig, GossipConfig, check_choco_codec
from fededge.compress.update import DownlinkConfig, UpdateConfig
from fededge.data.datasets import DATASETS
from fededge.catalog import BUILTIN_NAMES, strategy_names, strategy_record
from fededge.errors import ConfigError  # raised here for the run config; defined apart for the library
from fededge.data.partition import PARTITIONS
from fededge.models.zoo import MODELS, is_model_name, resnet_width
from fededge.netem.runclock import ClockConfig
from fededge.results_config import ResultsConfig

__all__ = ["CLIENT_STATES", "ConfigError", "OWNED", "RunConfig", "STRATEGIES", "DEVICES", "GOSSIP_ALGORITHMS"]

#: The built-in strategies (``strategy=...``): each is one record of :mod:`fededge.catalog`,
#: which also holds those a user registers (:func:`fededge.catalog.register_strategy`).
STRATEGIES: tuple[str, ...] = BUILTIN_NAMES
DEVICES: tuple[str, ...] = ("auto", "cpu", "cuda")
#: Where nodes keep their ``context.state`` between messages (``client-states``).
CLIENT_STATES: tuple[str, ...] = ("memory", "disk", "auto")

T = TypeVar("T")

_DEVICE_RE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


#: Run-config keys whose knob a library object declares: key -> (owner, the owner's
#: parameter). The owner holds the default (a class attribute), the check (building it
#: raises ValueError) and the docstring; RunConfig only names the key.
OWNED: dict[str, tuple[type, str]] = {
    "netem": (ClockConfig, "netem"),
    "netem-file": (ClockConfig, "netem_file"),
    "compute-speed": (ClockConfig, "compute_speed"),
    "sim-step-s": (ClockConfig, "sim_step_s"),
    "message-overhead-s": (ClockConfig, "message_overhead_s"),
    "nodes-pull": (ClockConfig, "nodes_pull"),
    **{key: (UpdateConfig, param) for key, param in (
        ("compressor", "compressor"), ("error-feedback", "error_feedback"), ("lossless", "lossless"),
        ("qsgd-levels", "qsgd_levels"), ("qsgd-bucket", "qsgd_bucket"), ("topk-ratio", "topk_ratio"),
        ("topk-values", "topk_values"), ("powersgd-rank", "powersgd_rank"),
        ("powersgd-iters", "powersgd_iters"), ("int8-block", "int8_block"),
        ("threshold-tau", "threshold_tau"), ("dgc-sparsity", "dgc_sparsity"),
        ("dgc-warmup-rounds", "dgc_warmup_rounds"), ("dgc-warmup-epochs", "dgc_warmup_epochs"),
        ("dgc-momentum", "dgc_momentum"),
        ("dgc-clip-norm", "dgc_clip_norm"), ("compress-min-numel", "min_numel"),
        ("compress-1d", "compress_1d"), ("compress-small-codec", "small_codec"), ("norm-stats", "norm_stats"),
        ("compress-warmup-rounds", "warmup_rounds"))},
    "downlink-compressor": (DownlinkConfig, "downlink"),
    "dga-delay": (DGAConfig, "delay"),
    "dga-correction": (DGAConfig, "correction"),
    "dga-warmup-rounds": (DGAConfig, "warmup_rounds"),
    "dga-pipeline": (DGAConfig, "pipeline"),
    "dga-compute-ahead": (DGAConfig, "compute_ahead"),
    "topology": (GossipConfig, "topology"),
    "topology-file": (GossipConfig, "topology_file"),
    "topology-degree": (GossipConfig, "topology_degree"),
    "topology-p": (GossipConfig, "topology_p"),
    "mixing": (GossipConfig, "mixing"),
    "gossip-algorithm": (GossipConfig, "algorithm"),
    "gossip-gamma": (ChocoConfig, "gamma"),
    "choco-scale": (ChocoConfig, "scale"),
    "async-alpha": (AsyncConfig, "alpha"),
    "buffer-size": (AsyncConfig, "buffer_size"),
    "ssp-bound": (AsyncConfig, "ssp_bound"),
    "async-concurrency": (AsyncConfig, "concurrency"),
    "staleness": (StalenessFunction, "kind"),
    "staleness-a": (StalenessFunction, "a"),
    "staleness-b": (StalenessFunction, "b"),
    "async-order": (LoopConfig, "order"),
    "async-step-s": (LoopConfig, "step_s"),
    "backup-workers": (LoopConfig, "backup"),
    "results-dir": (ResultsConfig, "results_dir"),
    "run-name": (ResultsConfig, "run_name"),
    "target-accuracy": (ResultsConfig, "target_accuracy"),
    "progress": (ResultsConfig, "progress"),
    "save-model": (ResultsConfig, "save_model"),
    "checkpoint-every": (ResultsConfig, "checkpoint_every"),
    "evaluate-every": (ResultsConfig, "evaluate_every"),
    "log-to": (ResultsConfig, "log_to"),
    "mlflow-uri": (ResultsConfig, "mlflow_uri"),
    "resume-from": (ResultsConfig, "resume_from"),
}



#: The run-config keys that take ``inf`` (meaning none: no timeout); NaN none takes.
INFINITE_OK = frozenset({"round-timeout"})

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
        The client's SGD optimiser. Momentum buffers restart every round unless
        ``keep-momentum``.
    keep_momentum : bool
        Each client keeps its momentum buffers across rounds (in its ``context.state``,
        one model's size per client) instead of restarting them every round. The
        momentum then runs across the averaging points, as in the optimiser of DGA's
        paper (Zhu et al., 2021): with K = 1, FedAvg is synchronous momentum SGD and DGA
        the paper's per-iteration rule with momentum (docs/algorithms.md). A client
        that skips rounds resumes with the buffers of its last round.
    lr_schedule : str
        How the clients' ``local-lr`` changes over the rounds: ``constant`` (default),
        ``cosine`` (down to nearly 0 at the last round) or ``step`` (x0.1 after half the
        rounds, x0.01 after three quarters). The rate is constant within a round, so with
        K = 1 the schedule is per iteration
        (:func:`fededge.clients.train.scheduled_lr`). The server sends the schedule with
        every train message and each client computes its round's rate.
    lr_warmup_rounds : int
        W: rounds 1..W ramp the rate linearly from ``local-lr / W`` up to ``local-lr``,
        before the schedule. 0 (default): no warm-up. Must be below ``num-rounds``.
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
        ``mlp``, ``cnn``, ``cnn-bn`` (the CNN with BatchNorm), ``cnn-fedavg`` (McMahan et
        al.'s CNN, 1.66M parameters on MNIST) or ``resnet18`` (CIFAR variant).
    seed : int
        Seeds the model initialisation, the partition, client sampling and batches.
    device : str
        Where clients train: ``auto``, ``cpu``, ``cuda`` or ``cuda:N``. ``auto`` is the
        CPU where there is no CUDA. With CUDA, fededge's in-process runtime
        (``fededge run``) times the run's training step on both and trains every client
        where a client's step costs least, the CPU counted with all the processes it
        would use (:func:`fededge.server.inprocess.client_device_choice`; the run's first
        line gives the timings); under Flower's simulation and on a SuperNode it is CUDA.
        Name the device for runs repeatable across machines.
    server_device : str
        Where the server evaluates the global model; same values. Separate from
        ``device`` so that GPU clients can report to a CPU-only SuperLink host.
    deterministic : bool
        On CUDA, repeatable training: cuDNN's deterministic algorithms with its
        autotuner off, torch's deterministic kernels, a fixed cuBLAS workspace
        (:func:`fededge.clients.device.set_cuda_determinism`). ``false`` trades that
        for speed (cuDNN's autotuner on). No effect on the CPU, which repeats anyway.
    norm_stats_batches : int
        Mini-batches (of ``batch-size``) fededge's ClientApp runs forward, without
        gradients, to recompute its normalisation statistics for the model the server
        will hold when the uplink is compressed (``norm-stats = "decoded"``). 8 by
        default: the statistics of 256 examples, for 8 forward passes against the 20
        forward and backward passes of a round's training.
    cohort : bool
        In the in-process runtime (``fededge run``), train each round's clients that
        share their local-SGD settings as one batched program
        (:mod:`fededge.clients.cohort`): the same per-client models to float rounding,
        each client's mods, state and bytes as before (BatchNorm statistics per client
        too). Models with dropout train per client. No effect under Flower's simulation or on a SuperLink, where each node
        runs its own messages.
    client_threads : int
        torch intra-op threads for local training (``torch.set_num_threads``); 0 keeps
        torch's default (one per core). The default 1 suits simulation, where many
        clients share the machine, and small models, whose per-step threading
        overhead exceeds the work (8x slower with 2 threads on the digits CNN here).
        A real device training a large model may want all its cores.
    server_lr : float
        Server learning rate of ``fedavgm`` / ``fedadam`` / ``fedadagrad`` / ``fedyogi``
        (Reddi et al., 2021, as Flower implements them: docs/algorithms.md) / ``diloco``. 0
        keeps the strategy's own default (Flower's: 1.0 for FedAvgM, 0.1 for FedAdam and
        FedAdagrad, 0.01 for FedYogi; 0.7 for ``diloco``, as in Douillard et al., 2023).
        Ignored by ``fedavg``.
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
    client_states : str
        Where a node's ``context.state`` (error-feedback residuals, PowerSGD's Q, DGA's
        and gossip's client state, the batch sampler's position) lives between its
        messages: ``memory`` (Flower's way: every node that has trained keeps its state
        in memory for the rest of the run) or ``disk`` (on the node's disk while it is
        idle, so that memory follows the clients per round, not the clients; one file
        write and read per message: :class:`fededge.clients.statestore.StateSpillMod`
        under Ray and on a SuperLink, the runtime's own store in-process) or ``auto``
        (the default: in fededge's in-process runtime, memory until the states total
        the larger of ``client-states-memory-mb`` and one round's clients' states, then
        disk for the rest of the run, said once in the log; under Ray and on a
        SuperLink, ``memory``). Results are the same either way.
    client_states_memory_mb : float
        ``client-states=auto``'s budget: the MiB of states kept in memory before they
        all move to disk, or more where one round's clients' states are more (the
        clients a round samples times the largest state; at most four times the budget
        and a quarter of the memory the process may use, its cgroup's limit included:
        ten ResNet-18 clients a round with 45 MB of error feedback each stay in memory);
        0: disk from the first state.
    dropout : float
        Fraction of the clients (partition ids, seeded) that never answer, in [0, 1):
        they reply at once that they dropped out and the simulated clock charges the
        server ``round-timeout`` for them, as a real silent node would cost. For testing
        what stragglers and dropouts do to a strategy.

    The library pieces' knobs are declared by the config objects those pieces take
    (their defaults, checks and meanings are there; :data:`OWNED` maps each key to its
    owner, ``RunConfig.owned(owner)`` builds one):

    - compression: ``compressor``, ``error-feedback``, ``lossless``, ``qsgd-*``,
      ``topk-*``, ``powersgd-rank``, ``powersgd-iters``, ``int8-block``, ``threshold-tau``, ``dgc-*``,
      ``compress-min-numel``, ``compress-1d``, ``compress-small-codec``, ``norm-stats``,
      ``compress-warmup-rounds``: :class:`fededge.compress.update.UpdateConfig` (docs/compression.md); e.g.
      ``compressor="qsgd" qsgd-levels=16``; ``downlink-compressor``:
      :class:`fededge.compress.update.DownlinkConfig`;
    - ``dga-delay``, ``dga-correction``, ``dga-warmup-rounds``, ``dga-pipeline``,
      ``dga-compute-ahead``
      (``strategy="dga"``): :class:`fededge.algorithms.dga.DGAConfig`;
    - ``topology``, ``topology-file``, ``topology-degree``, ``topology-p``, ``mixing``,
      ``gossip-algorithm`` (``strategy="gossip"``, docs/topology.md):
      :class:`fededge.algorithms.gossip.GossipConfig`; ``gossip-gamma``, ``choco-scale``:
      :class:`fededge.algorithms.gossip.ChocoConfig`;
    - ``async-alpha``, ``buffer-size``, ``ssp-bound``, ``async-concurrency``:
      :class:`fededge.algorithms.asyncfl.AsyncConfig`; ``staleness``, ``staleness-a``,
      ``staleness-b``: :class:`fededge.algorithms.asyncfl.StalenessFunction`;
      ``async-order``, ``async-step-s``, ``backup-workers``: :class:`fededge.algorithms.asyncfl.LoopConfig`;
    - ``netem``, ``netem-file``, ``compute-speed``, ``sim-step-s``,
      ``message-overhead-s``, ``nodes-pull``: the simulated clock,
      :class:`fededge.netem.runclock.ClockConfig`;
    - ``results-dir``, ``run-name``, ``target-accuracy``, ``progress``, ``save-model``,
      ``checkpoint-every``, ``evaluate-every``, ``log-to``, ``mlflow-uri``, ``resume-from``:
      :class:`fededge.results_config.ResultsConfig`.

    ``server-lr`` and ``server-momentum`` are shared by several strategies; 0 for
    ``server-lr`` keeps each strategy's own default.
    """

    strategy: str = "fedavg"
    num_rounds: int = 20
    clients_per_round: Union[int, float] = 1.0
    min_available_nodes: int = 0
    local_steps: int = 20
    local_lr: float = 0.05
    momentum: float = 0.9
    keep_momentum: bool = False
    lr_schedule: str = "constant"
    lr_warmup_rounds: int = 0
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
    deterministic: bool = True
    norm_stats_batches: int = 8
    cohort: bool = False
    client_threads: int = 1
    target_accuracy: float = ResultsConfig.target_accuracy
    results_dir: str = ResultsConfig.results_dir
    run_name: str = ResultsConfig.run_name
    save_model: bool = ResultsConfig.save_model
    checkpoint_every: int = ResultsConfig.checkpoint_every
    evaluate_every: int = ResultsConfig.evaluate_every
    log_to: str = ResultsConfig.log_to
    mlflow_uri: str = ResultsConfig.mlflow_uri
    resume_from: str = ResultsConfig.resume_from
    client_states: str = "auto"
    client_states_memory_mb: float = 256.0
    server_lr: float = 0.0
    server_momentum: float = 0.9
    proximal_mu: float = 0.01
    trimmed_beta: float = 0.2
    krum_byzantine: int = 0
    fraction_evaluate: float = 0.0
    round_timeout: float = 3600.0
    netem: str = ClockConfig.netem
    netem_file: str = ClockConfig.netem_file
    compute_speed: str = ClockConfig.compute_speed
    compressor: str = UpdateConfig.compressor
    error_feedback: bool = UpdateConfig.error_feedback
    lossless: bool = UpdateConfig.lossless
    qsgd_levels: int = UpdateConfig.qsgd_levels
    qsgd_bucket: int = UpdateConfig.qsgd_bucket
    topk_ratio: float = UpdateConfig.topk_ratio
    topk_values: str = UpdateConfig.topk_values
    powersgd_rank: int = UpdateConfig.powersgd_rank
    powersgd_iters: int = UpdateConfig.powersgd_iters
    int8_block: int = UpdateConfig.int8_block
    threshold_tau: float = UpdateConfig.threshold_tau
    dgc_sparsity: float = UpdateConfig.dgc_sparsity
    dgc_warmup_rounds: int = UpdateConfig.dgc_warmup_rounds
    dgc_warmup_epochs: float = UpdateConfig.dgc_warmup_epochs
    dgc_momentum: float = UpdateConfig.dgc_momentum
    dgc_clip_norm: float = UpdateConfig.dgc_clip_norm
    compress_min_numel: int = UpdateConfig.min_numel
    compress_1d: bool = UpdateConfig.compress_1d
    norm_stats: str = UpdateConfig.norm_stats
    compress_small_codec: str = UpdateConfig.small_codec
    compress_warmup_rounds: int = UpdateConfig.warmup_rounds
    downlink_compressor: str = DownlinkConfig.downlink
    dga_delay: int = DGAConfig.delay
    dga_correction: bool = DGAConfig.correction
    dga_warmup_rounds: int = DGAConfig.warmup_rounds
    dga_pipeline: str = DGAConfig.pipeline
    dga_compute_ahead: bool = DGAConfig.compute_ahead
    topology: str = GossipConfig.topology
    topology_file: str = GossipConfig.topology_file
    topology_degree: int = GossipConfig.topology_degree
    topology_p: float = GossipConfig.topology_p
    mixing: str = GossipConfig.mixing
    gossip_algorithm: str = GossipConfig.algorithm
    gossip_gamma: float = ChocoConfig.gamma
    choco_scale: float = ChocoConfig.scale
    async_alpha: float = AsyncConfig.alpha
    buffer_size: int = AsyncConfig.buffer_size
    staleness: str = StalenessFunction.kind
    staleness_a: float = StalenessFunction.a
    staleness_b: float = StalenessFunction.b
    ssp_bound: int = AsyncConfig.ssp_bound
    async_concurrency: int = AsyncConfig.concurrency
    async_order: str = LoopConfig.order
    async_step_s: float = LoopConfig.step_s
    backup_workers: Union[int, float] = LoopConfig.backup
    dropout: float = 0.0
    sim_step_s: float = ClockConfig.sim_step_s
    message_overhead_s: float = ClockConfig.message_overhead_s
    nodes_pull: bool = ClockConfig.nodes_pull
    progress: str = ResultsConfig.progress

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            # NaN passes every `x < 0` and `x > 0` check below (weight-decay=nan trained to
            # NaN with no error); infinity only where it means "none" (no round timeout)
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value) and not (
                    value == math.inf and _kebab(f.name) in INFINITE_OK):
                raise ConfigError(f"run-config key '{_kebab(f.name)}' must be a finite number, got {value}"
                                  + (" (inf is allowed for: " + ", ".join(sorted(INFINITE_OK)) + ")"
                                     if value == math.inf else ""))
        _choice("strategy", self.strategy, strategy_names())
        _choice("dataset", self.dataset, DATASETS)
        _choice("partition", self.partition, PARTITIONS)
        if not is_model_name(self.model):
            raise ConfigError(f"run-config key 'model' must be one of {', '.join(MODELS)} or resnet18-wN "
                              f"(N in 1..512); got {self.model!r}")
        _choice("client-states", self.client_states, CLIENT_STATES)
        if isinstance(self.client_states_memory_mb, bool) or not 0 <= self.client_states_memory_mb < float("inf"):
            raise ConfigError(f"run-config key 'client-states-memory-mb' must be a finite number >= 0 (MiB), "
                              f"got {self.client_states_memory_mb!r}")
        _choice("lr-schedule", self.lr_schedule, LR_SCHEDULES)
        why = self.trains_on_two_examples()
        if why is not None and min(self.batch_size, self.min_partition_size) < 2:
            raise ConfigError(
                f"model {self.model!r} needs batches of at least 2 examples ({why}), got "
                f"batch-size={self.batch_size}, min-partition-size={self.min_partition_size}; set both >= 2")
        for key, value in (("device", self.device), ("server-device", self.server_device)):
            if not _DEVICE_RE.match(value):
                raise ConfigError(
                    f"run-config key '{key}' must be one of auto, cpu, cuda or cuda:N, "
                    f"got {value!r}"
                )
        if not 0 <= self.seed < 2**32:
            raise ConfigError(f"run-config key 'seed' must be in [0, 2**32), got {self.seed}")
        _int_at_least("num-rounds", self.num_rounds, 1)
        _int_at_least("lr-warmup-rounds", self.lr_warmup_rounds, 0)
        if self.lr_warmup_rounds >= self.num_rounds:
            raise ConfigError(
                f"run-config key 'lr-warmup-rounds' ({self.lr_warmup_rounds}) must be below 'num-rounds' "
                f"({self.num_rounds}): the warm-up would never reach local-lr; lower it or raise num-rounds"
            )
        _int_at_least("local-steps", self.local_steps, 1)
        _int_at_least("batch-size", self.batch_size, 1)
        # the synthetic data sets' 10 classes, split 80/20 stratified: at least one of each
        # class on each side (fededge.data.datasets.min_split_samples(10, 0.2) = 46)
        _int_at_least("synthetic-samples", self.synthetic_samples, 46)
        _positive("synthetic-amplitude", self.synthetic_amplitude)
        _int_at_least("shards-per-client", self.shards_per_client, 1)
        _int_at_least("min-partition-size", self.min_partition_size, 1)
        _int_at_least("krum-byzantine", self.krum_byzantine, 0)
        _int_at_least("client-threads", self.client_threads, 0)
        _int_at_least("norm-stats-batches", self.norm_stats_batches, 1)
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
        if self.alpha > 1e100:  # numpy's Dirichlet sampler overflows near float64's max
            raise ConfigError(f"run-config key 'alpha' must be <= 1e100, got {self.alpha}; alpha = 1e6 already "
                              "splits every class evenly (or use partition='iid')")
        _positive("round-timeout", self.round_timeout)
        _in_range("momentum", self.momentum, 0.0, 1.0, hi_open=True)
        _in_range("server-momentum", self.server_momentum, 0.0, 1.0, hi_open=True)
        _in_range("fraction-evaluate", self.fraction_evaluate, 0.0, 1.0)
        _in_range("trimmed-beta", self.trimmed_beta, 0.0, 0.5, hi_open=True)
        _in_range("dropout", self.dropout, 0.0, 1.0, hi_open=True)
        if self.server_lr < 0:
            raise ConfigError(f"run-config key 'server-lr' must be >= 0 (0 = strategy default), got {self.server_lr}")
        if self.weight_decay < 0:
            raise ConfigError(f"run-config key 'weight-decay' must be >= 0, got {self.weight_decay}")
        if self.proximal_mu < 0:
            raise ConfigError(f"run-config key 'proximal-mu' must be >= 0, got {self.proximal_mu}")
        for owner in dict.fromkeys(owner for owner, _ in OWNED.values()):
            self.owned(owner)  # each owned knob's check is its owner's
        record = strategy_record(self.strategy)
        if record.compression == "none" and (self.compressor != "none" or self.downlink_compressor != "none"):
            raise ConfigError(
                f"run-config keys 'compressor' / 'downlink-compressor' are not supported with "
                f"strategy={self.strategy!r} yet (its replies are used one by one, against the "
                "model version each client trained on); set them to 'none'")
        if self.norm_stats == "global" and record.compression != "wrapped":
            raise ConfigError(
                f"run-config key 'norm-stats' = 'global' is for strategies on Flower's round loop; "
                f"strategy={self.strategy!r} runs its own (DGA continues the statistics by its own rule, gossip "
                "sends them raw); set norm-stats to 'decoded'")
        record.check_config(self)

    def owned(self, owner: type[T]) -> T:
        """The library config object ``owner`` (a class of :data:`OWNED`) built from this
        run config's keys; raises :class:`ConfigError` naming the key a bad value is in.

        Examples
        --------
        >>> RunConfig(strategy="dga", dga_delay=2).owned(DGAConfig).delay
        2
        """
        params = {key: param for key, (cls, param) in OWNED.items() if cls is owner}
        if not params:
            raise ValueError(f"{owner.__name__} owns no run-config key; the owners: "
                             f"{', '.join(sorted({cls.__name__ for cls, _ in OWNED.values()}))}")
        kwargs = {param: getattr(self, key.replace("-", "_")) for key, param in params.items()}
        if owner is UpdateConfig:
            kwargs["seed"] = self.seed  # seeds the stochastic codecs; not a compression knob
        try:
            return owner(**kwargs)
        except ValueError as err:
            raise ConfigError(_owned_error(owner, params, kwargs, err)) from None

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

    def trains_on_two_examples(self) -> str | None:
        """Why this run's model cannot train on a batch of one example (BatchNorm sees one
        value per channel), or None where it can: cnn-bn's BatchNorm1d, and a ResNet-18's
        last stage on digits (three stride-2 stages shrink 8x8 to 1x1)."""
        if self.model == "cnn-bn":
            return "its BatchNorm1d cannot train on one"
        if resnet_width(self.model) is not None and self.dataset == "digits":
            return "on 8x8 digits its last stage is 1x1, where BatchNorm cannot train on one"
        return None

    def to_mapping(self) -> dict[str, Any]:
        """The config as kebab-case keys, the form Flower and ``config.json`` use."""
        return {_kebab(k): v for k, v in dataclasses.asdict(self).items()}

    def update_config(self) -> UpdateConfig:
        """The uplink compression knobs as :class:`fededge.compress.update.UpdateConfig`."""
        return self.owned(UpdateConfig)

    def topology_params(self) -> dict[str, Any]:
        """The ``topology-*`` keys the named family takes, as
        :func:`fededge.topology.build_topology` keyword arguments."""
        return self.owned(GossipConfig).topology_params()

    def replace(self, **changes: Any) -> "RunConfig":
        """A copy with some fields changed (snake_case names), validated again."""
        return dataclasses.replace(self, **changes)


#: Run-config keys added after runs were saved, whose absence had another effect than
#: today's default: a saved run's config.json without the key ran as with this value,
#: so resuming it fills the key in so (:func:`saved_run_config`).
EARLIER_EFFECT: dict[str, Any] = {
    "dgc-warmup-epochs": 0.0,  # before it, DGC's sparsity warm-up was dgc-warmup-rounds alone
}


def saved_run_config(saved: Mapping[str, Any]) -> dict[str, Any]:
    """A saved run's config (its config.json's ``config``) as that run computed: each key
    it lacks (one added to fededge since) at the value that had its effect then,
    :data:`EARLIER_EFFECT`'s, else today's default.

    >>> saved_run_config({"compressor": "dgc"})["dgc-warmup-epochs"]
    0.0
    """
    defaults = RunConfig.from_mapping({}).to_mapping()
    return {**{k: EARLIER_EFFECT.get(k, v) for k, v in defaults.items() if k not in saved}, **saved}


def check_dga_keys(cfg: RunConfig) -> None:
    """What DGA asks of the keys of other domains (its own knobs: DGAConfig); the
    ``check`` of its :mod:`fededge.catalog` record."""
    if cfg.downlink_compressor != "none" and cfg.compress_warmup_rounds > 0 and cfg.compressor != "none":
        raise ConfigError(
            "run-config key 'compress-warmup-rounds' with strategy='dga' and a 'downlink-compressor': the "
            "warm-up rounds' replies would be full weights trained from the rounded G(g), which carries the "
            "rounding into the global model; set compress-warmup-rounds=0 (DGA's own dga-warmup-rounds runs "
            "synchronous rounds first) or downlink-compressor=\"none\"")
    if cfg.downlink_compressor != "none" and cfg.compressor == "none":
        raise ConfigError(
            "run-config key 'downlink-compressor' with strategy='dga' needs a 'compressor' too: "
            "the clients start from the rounded G(g) and the server keeps the exact one, so "
            "replies must be deltas (compressed uplinks, rebuilt on the exact G(g)); a full-"
            "weight reply would carry the rounding into every later global model. Set "
            "compressor (e.g. \"raw\", lossless) or downlink-compressor=\"none\""
        )


def check_krum_keys(cfg: RunConfig) -> None:
    """Krum tolerates ``f`` Byzantine clients of ``n`` a round only where ``n > 2f + 2``
    (Blanchard et al. 2017); with fewer, Flower's Krum scores each reply by its
    ``max(1, n - f - 2)`` nearest, and what it picks has no guarantee."""
    f, cpr = cfg.krum_byzantine, cfg.clients_per_round
    if f > 0 and isinstance(cpr, int) and not cpr > 2 * f + 2:
        raise ConfigError(f"run-config key 'krum-byzantine' is {f} but clients-per-round is {cpr}: Krum tolerates "
                          f"f Byzantine clients of n only where n > 2f + 2 (here {2 * f + 3} or more); raise "
                          "clients-per-round or lower krum-byzantine")


def check_gossip_keys(cfg: RunConfig) -> None:
    """What gossip asks of the keys of other domains (its own knobs: GossipConfig); the
    ``check`` of its :mod:`fededge.catalog` record."""
    if cfg.clients_per_round != 1.0 or isinstance(cfg.clients_per_round, int):
        raise ConfigError(
            "run-config key 'clients-per-round' must be 1.0 with strategy='gossip': every "
            f"connected node is a node of the graph and trains every round (got "
            f"{cfg.clients_per_round!r}); use min-available-nodes to wait for N nodes")
    if cfg.fraction_evaluate > 0:
        raise ConfigError(
            "run-config key 'fraction-evaluate' must be 0 with strategy='gossip': there is no "
            "global model to send; the server evaluates every node's model and their average "
            "on the test set each round")
    if cfg.downlink_compressor != "none":
        raise ConfigError(
            "run-config key 'downlink-compressor' must be 'none' with strategy='gossip': the "
            "relay forwards the nodes' own messages; compress them with gossip-algorithm="
            "'choco' and 'compressor'")
    if cfg.compress_warmup_rounds > 0:
        raise ConfigError(
            "run-config key 'compress-warmup-rounds' is for uplinks to a server; with strategy='gossip' "
            "CHOCO's public estimates are kept from the first round on; set compress-warmup-rounds=0")
    if cfg.gossip_algorithm == "dpsgd" and cfg.compressor != "none":
        raise ConfigError(
            f"run-config key 'compressor' is {cfg.compressor!r} but gossip-algorithm='dpsgd' "
            "sends whole models (compressing them without CHOCO's estimates drifts); use "
            "gossip-algorithm='choco' for compressed gossip, or compressor='none'")
    if cfg.gossip_algorithm == "choco":
        try:
            check_choco_codec(cfg.compressor, cfg.error_feedback)
        except ValueError as err:
            key = "error-feedback" if cfg.error_feedback and "error_feedback" in str(err) else "compressor"
            raise ConfigError(f"run-config key '{key}' with gossip-algorithm='choco': {err}") from None
        if cfg.topology == "one-peer-exponential":
            raise ConfigError(
                "run-config key 'topology': 'one-peer-exponential' changes peers every round, "
                "but CHOCO's public estimates assume a static graph; use gossip-algorithm="
                "'dpsgd' with it, or a static topology such as 'exponential'")  # (GossipConfig says it too)


def _owned_error(owner: type, params: Mapping[str, str], kwargs: Mapping[str, Any], err: ValueError) -> str:
    """A ConfigError's message for an owner that refused its knobs: the key, or keys,
    whose value is refused, and the owner's reason."""
    msg = str(err)
    if msg.startswith("'"):  # the owner named the key already ('error-feedback': ...)
        return f"run-config key {msg}"
    alone = []
    for key, param in params.items():
        try:
            owner(**{param: kwargs[param]})
        except ValueError:
            alone.append(key)
        except TypeError:
            pass
    # A knob the message asks for that is not set (netem_file, topology_file) is named too.
    mentioned = [key for key, param in params.items()
                 if re.search(rf"\b{param}\b", msg) and not kwargs[param] and key not in alone]
    keys = (alone + mentioned) or [key for key, param in params.items()
                                   if getattr(owner, param, None) != kwargs[param]] or list(params)
    named = " and ".join(f"'{k}'" for k in keys)
    return f"run-config key{'s' if len(keys) > 1 else ''} {named}: {msg}"


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


def check_clients_available(cfg: RunConfig, num_clients: int, *, where: str = "the in-process run",
                            flag: str = "num_clients (--num-clients)") -> None:
    """:class:`ConfigError` where ``cfg`` asks each round for more clients than the run
    has (``clients-per-round``, ``min-available-nodes``): its server would wait for them
    until ``round-timeout`` (an hour by default)."""
    cpr = cfg.clients_per_round
    for key, want in (("clients-per-round", cpr if isinstance(cpr, int) else 0),
                      ("min-available-nodes", cfg.min_available_nodes)):
        if want > num_clients:
            raise ConfigError(f"run-config key '{key}' is {want} but {where} has only {num_clients} clients; "
                              f"lower it or raise {flag}")
    f = cfg.krum_byzantine
    if cfg.strategy == "krum" and f > 0 and not isinstance(cpr, int):
        # A fraction: Flower samples int(n * fraction) (at least one); check_krum_keys
        # checks a count, this the count the fraction gives here.
        n = max(1, int(cpr * num_clients))
        if not n > 2 * f + 2:
            raise ConfigError(f"run-config key 'krum-byzantine' is {f} but clients-per-round={cpr} of "
                              f"{num_clients} clients is {n} a round: Krum tolerates f Byzantine clients of n "
                              f"only where n > 2f + 2 (here {2 * f + 3} or more); raise clients-per-round or "
                              "the clients, or lower krum-byzantine")
