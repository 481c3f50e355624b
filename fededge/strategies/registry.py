"""Build the server strategy a run config names, from its :mod:`fededge.catalog` record.

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
from fededge.catalog import strategy_record
from fededge.config import RunConfig
from fededge.algorithms.dga import DGAConfig
from fededge.algorithms.asyncfl import StalenessFunction
from fededge.strategies.backup import BackupWorkers
from fededge.strategies.compressed import Compressed
from fededge.strategies.normstats import NormCalibrated
from fededge.strategies.dga import DGA
from fededge.strategies.fedasync import FedAsync
from fededge.strategies.fedbuff import FedBuff
from fededge.strategies.gossip import Gossip
from fededge.strategies.outer import FedAvgOuter
from fededge.strategies.plainbuffers import PlainBuffers
from fededge.strategies.ssp import SSP

__all__ = ["build_strategy", "sampling_kwargs"]  # and the built-in records' build_* functions

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


def build_strategy(cfg: RunConfig) -> Strategy:
    """The strategy named by ``cfg.strategy`` (its :mod:`fededge.catalog` record's
    ``build``), configured from ``cfg``; wrapped in
    :class:`~fededge.strategies.compressed.Compressed` when the run compresses updates
    (``compressor`` or ``downlink-compressor``) and the record says the strategy does not
    decode them itself (``compression="wrapped"``).

    ``clients-per-round`` as a count samples exactly that many nodes; as a fraction it
    samples ``int(n * fraction)`` (at least one) of the ``n`` nodes connected at the
    time. ``run_experiment`` waits for enough nodes first, with a deadline.
    """
    record = strategy_record(cfg.strategy)
    strategy = record.builder()(cfg, sampling_kwargs(cfg))
    if not isinstance(strategy, Strategy):
        raise TypeError(f"strategy {record.name!r}: its record's build returned a {type(strategy).__name__}, "
                        "not a flwr.serverapp.strategy.Strategy")
    compresses = cfg.compressor != "none" or cfg.downlink_compressor != "none"
    if compresses and record.compression == "wrapped":
        # The codec the clients were told to use: a reply in another one is rejected by name.
        expect = cfg.update_config() if cfg.compressor != "none" else None
        strategy = Compressed(strategy, downlink=cfg.downlink_compressor, update=expect)
    if cfg.norm_stats == "global":
        # Outermost: it recalibrates the model the (decoded, aggregated) inner returns.
        strategy = NormCalibrated(strategy, batches=cfg.norm_stats_batches, timeout=cfg.round_timeout)
    return strategy


# The built-in strategies' builders (their records in fededge.catalog name them):
# ``build(cfg, kw)``, ``kw`` being :func:`sampling_kwargs`.
def _server_lr(cfg: RunConfig) -> dict[str, Any]:
    return {"eta": cfg.server_lr} if cfg.server_lr > 0 else {}


def build_fedavg(cfg: RunConfig, kw: dict[str, Any]) -> Strategy:
    return fs.FedAvg(**kw)


def build_fedavgm(cfg: RunConfig, kw: dict[str, Any]) -> Strategy:
    return PlainBuffers(fs.FedAvgM(**kw, server_learning_rate=cfg.server_lr or 1.0, server_momentum=cfg.server_momentum))  # its step on the parameters only


def build_fedprox(cfg: RunConfig, kw: dict[str, Any]) -> Strategy:
    return fs.FedProx(**kw, proximal_mu=cfg.proximal_mu)


def build_fedadam(cfg: RunConfig, kw: dict[str, Any]) -> Strategy:
    return PlainBuffers(fs.FedAdam(**kw, eta_l=cfg.local_lr, **_server_lr(cfg)))  # its step on the parameters only


def build_fedadagrad(cfg: RunConfig, kw: dict[str, Any]) -> Strategy:
    return PlainBuffers(fs.FedAdagrad(**kw, eta_l=cfg.local_lr, **_server_lr(cfg)))  # its step on the parameters only


def build_fedyogi(cfg: RunConfig, kw: dict[str, Any]) -> Strategy:
    return PlainBuffers(fs.FedYogi(**kw, eta_l=cfg.local_lr, **_server_lr(cfg)))  # its step on the parameters only


def build_fedmedian(cfg: RunConfig, kw: dict[str, Any]) -> Strategy:
    return fs.FedMedian(**kw)


def build_fedtrimmedavg(cfg: RunConfig, kw: dict[str, Any]) -> Strategy:
    return fs.FedTrimmedAvg(**kw, beta=cfg.trimmed_beta)


def build_krum(cfg: RunConfig, kw: dict[str, Any]) -> Strategy:
    return fs.Krum(**kw, num_malicious_nodes=cfg.krum_byzantine)


def build_dga(cfg: RunConfig, kw: dict[str, Any]) -> Strategy:
    # The codec the clients were told to use: a reply in another one is rejected by name.
    return DGA(**kw, config=cfg.owned(DGAConfig), downlink=cfg.downlink_compressor,
               update=cfg.update_config() if cfg.compressor != "none" else None)


def build_diloco(cfg: RunConfig, kw: dict[str, Any]) -> Strategy:
    return FedAvgOuter(**kw, **({"lr": cfg.server_lr} if cfg.server_lr > 0 else {}),
                       momentum=cfg.server_momentum, nesterov=cfg.server_momentum > 0)


def build_gossip(cfg: RunConfig, kw: dict[str, Any]) -> Strategy:
    return Gossip(**kw, topology=cfg.topology, topology_params=cfg.topology_params(),
                  mixing=cfg.mixing, algorithm=cfg.gossip_algorithm, gamma=cfg.gossip_gamma, seed=cfg.seed)


def _loop(cfg: RunConfig) -> dict[str, Any]:
    return {"order": cfg.async_order, "step_s": cfg.async_step_s, "concurrency": cfg.async_concurrency,
            "seed": cfg.seed}


def build_fedasync(cfg: RunConfig, kw: dict[str, Any]) -> Strategy:
    return FedAsync(**kw, **_loop(cfg), alpha=cfg.async_alpha, staleness=cfg.owned(StalenessFunction))


def build_fedbuff(cfg: RunConfig, kw: dict[str, Any]) -> Strategy:
    return FedBuff(**kw, **_loop(cfg), buffer_size=cfg.buffer_size, staleness=cfg.owned(StalenessFunction),
                   **({"server_lr": cfg.server_lr} if cfg.server_lr > 0 else {}))


def build_ssp(cfg: RunConfig, kw: dict[str, Any]) -> Strategy:
    return SSP(**kw, **_loop(cfg), bound=cfg.ssp_bound)


def build_backup(cfg: RunConfig, kw: dict[str, Any]) -> Strategy:
    return BackupWorkers(**kw, backup=cfg.backup_workers, order=cfg.async_order, step_s=cfg.async_step_s)

