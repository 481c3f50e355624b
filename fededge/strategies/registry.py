"""Build the server strategy a run config names.

fededge works with Flower rather than replacing it: every name but the fededge-specific
ones (``dga``: delayed gradient averaging; ``diloco``: FedAvg with an outer Nesterov
step; ``gossip``: D-PSGD / CHOCO-SGD with the server as a relay; ``fedasync``, ``fedbuff``,
``ssp``: asynchronous aggregation; ``backup``: synchronous rounds with backup
workers) maps to a class of ``flwr.serverapp.strategy``, configured from the run config.
"""

from __future__ import annotations

from typing import Any

from flwr.serverapp import strategy as fs
from flwr.serverapp.strategy import Strategy

from fededge import keys
from fededge.config import STRATEGIES, RunConfig
from fededge.algorithms.asyncfl import StalenessFunction
from fededge.strategies.backup import BackupWorkers
from fededge.strategies.compressed import Compressed
from fededge.strategies.dga import DGA
from fededge.strategies.fedasync import FedAsync
from fededge.strategies.fedbuff import FedBuff
from fededge.strategies.gossip import Gossip
from fededge.strategies.outer import FedAvgOuter
from fededge.strategies.ssp import SSP

__all__ = ["build_strategy", "sampling_kwargs"]

# A fraction this small makes Flower's sample size max(int(n * f), min_train_nodes)
# equal to min_train_nodes exactly, for any realistic n: count-based selection.
_COUNT_MODE_FRACTION = 1e-9


def sampling_kwargs(cfg: RunConfig) -> dict[str, Any]:
    """Flower's sampling knobs for ``clients-per-round`` (a count or a fraction)."""
    cpr = cfg.clients_per_round
    if isinstance(cpr, int):
        train = {"fraction_train": _COUNT_MODE_FRACTION, "min_train_nodes": cpr,
                 "min_available_nodes": max(cpr, cfg.min_available_nodes)}
    else:
        train = {"fraction_train": float(cpr), "min_train_nodes": 1,
                 "min_available_nodes": max(1, cfg.min_available_nodes)}
    return {
        **train,
        "fraction_evaluate": cfg.fraction_evaluate,
        "min_evaluate_nodes": 1 if cfg.fraction_evaluate > 0 else 0,
        "weighted_by_key": keys.NUM_EXAMPLES,
        "arrayrecord_key": keys.ARRAYS,
        "configrecord_key": keys.CONFIG,
    }


#: Strategies that decode compressed messages themselves (gossip's CHOCO messages are
#: not uplink updates of a global model; DGA rebuilds its replies' deltas on G(g)), so
#: they are not wrapped in :class:`~fededge.strategies.compressed.Compressed`.
_OWN_COMPRESSION = ("dga", "gossip")


def build_strategy(cfg: RunConfig) -> Strategy:
    """The strategy named by ``cfg.strategy``, configured from ``cfg``; wrapped in
    :class:`~fededge.strategies.compressed.Compressed` when the run compresses updates
    (``compressor`` or ``downlink-compressor``) and the strategy does not decode them
    itself.

    ``clients-per-round`` as a count samples exactly that many nodes; as a fraction it
    samples ``int(n * fraction)`` (at least one) of the ``n`` nodes connected at the
    time. ``run_experiment`` waits for enough nodes first, with a deadline.
    """
    strategy = _build(cfg)
    compresses = cfg.compressor != "none" or cfg.downlink_compressor != "none"
    if compresses and cfg.strategy not in _OWN_COMPRESSION:
        # The codec the clients were told to use: a reply in another one is rejected by name.
        expect = cfg.update_config() if cfg.compressor != "none" else None
        return Compressed(strategy, downlink=cfg.downlink_compressor, update=expect)
    return strategy


def _build(cfg: RunConfig) -> Strategy:
    kw = sampling_kwargs(cfg)
    lr = {"eta": cfg.server_lr} if cfg.server_lr > 0 else {}
    name = cfg.strategy
    if name == "fedavg":
        return fs.FedAvg(**kw)
    if name == "fedavgm":
        return fs.FedAvgM(**kw, server_learning_rate=cfg.server_lr or 1.0,
                          server_momentum=cfg.server_momentum)
    if name == "fedprox":
        return fs.FedProx(**kw, proximal_mu=cfg.proximal_mu)
    if name == "fedadam":
        return fs.FedAdam(**kw, eta_l=cfg.local_lr, **lr)
    if name == "fedadagrad":
        return fs.FedAdagrad(**kw, eta_l=cfg.local_lr, **lr)
    if name == "fedyogi":
        return fs.FedYogi(**kw, eta_l=cfg.local_lr, **lr)
    if name == "fedmedian":
        return fs.FedMedian(**kw)
    if name == "fedtrimmedavg":
        return fs.FedTrimmedAvg(**kw, beta=cfg.trimmed_beta)
    if name == "krum":
        return fs.Krum(**kw, num_malicious_nodes=cfg.krum_byzantine)
    if name == "dga":
        # The codec the clients were told to use: a reply in another one is rejected by name.
        return DGA(**kw, delay=cfg.dga_delay, correction=cfg.dga_correction,
                   warmup_rounds=cfg.dga_warmup_rounds, pipeline=cfg.dga_pipeline,
                   compute_ahead=cfg.dga_compute_ahead,
                   downlink=cfg.downlink_compressor,
                   update=cfg.update_config() if cfg.compressor != "none" else None)
    if name == "diloco":
        return FedAvgOuter(**kw, **({"lr": cfg.server_lr} if cfg.server_lr > 0 else {}),
                           momentum=cfg.server_momentum, nesterov=cfg.server_momentum > 0)
    if name == "gossip":
        return Gossip(**kw, topology=cfg.topology, topology_params=cfg.topology_params(),
                      mixing=cfg.mixing, algorithm=cfg.gossip_algorithm, gamma=cfg.gossip_gamma,
                      seed=cfg.seed)
    loop = {"order": cfg.async_order, "step_s": cfg.async_step_s, "concurrency": cfg.async_concurrency,
            "seed": cfg.seed}
    staleness = cfg.owned(StalenessFunction)
    if name == "fedasync":
        return FedAsync(**kw, **loop, alpha=cfg.async_alpha, staleness=staleness)
    if name == "fedbuff":
        return FedBuff(**kw, **loop, buffer_size=cfg.buffer_size, staleness=staleness,
                       **({"server_lr": cfg.server_lr} if cfg.server_lr > 0 else {}))
    if name == "ssp":
        return SSP(**kw, **loop, bound=cfg.ssp_bound)
    if name == "backup":
        return BackupWorkers(**kw, backup=cfg.backup_workers, order=cfg.async_order, step_s=cfg.async_step_s)
    raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}, got {name!r}")
