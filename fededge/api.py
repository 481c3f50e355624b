"""fededge as a library: the pieces any Flower app (Message API) can add.

A user's app keeps its own model, data, train function and run-config keys; fededge's
pieces take their settings as constructor arguments and never read the run config.
On the client, mods (order: see :mod:`fededge.clients.mods`); on the server, a wrapper or
a strategy that pairs with them; the config objects both take.

========================  =====================================  ================================
client mod                server side                            what
========================  =====================================  ================================
``CompressionMod``        ``Compressed(strategy, update=...)``   compressed updates, any strategy
``norm_stats_content``    ``NormCalibrated(strategy)``           BatchNorm statistics of the
(in ``@app.query``)                                              server's own model
``DGAMod``                ``DGA``                                Delayed Gradient Averaging
``PreviewMod``            ``DGA(compute_ahead=True)``            next round's content sent early
``GossipMod``             ``Gossip``                             D-PSGD / CHOCO-SGD, server relays
(none)                    ``FedAvgOuter``                        FedAvg + outer Nesterov step
(none)                    ``PlainBuffers(strategy)``             a server optimiser's step on
                                                                 parameters only (BatchNorm)
(none)                    ``FedAsync``, ``FedBuff``, ``SSP``     asynchronous aggregation
(none)                    ``BackupWorkers``                      first m of m + e replies
``config_error_mod``      (fededge's runner stops the run)       a named configuration error
``StateStoreMod``         ``Experiment(checkpoint_every=...)``   node state kept for a resume
``StateSpillMod``         (none)                                 idle nodes' state on disk
(none)                    ``Experiment`` (wraps any strategy)    bytes, simulated clock, results
(none)                    ``OwnLoop`` (a base class)             a strategy with its own loop
========================  =====================================  ================================

Importing this module imports neither fededge's own ClientApp nor its run-config
parsing (:mod:`fededge.config`).

Examples
--------
>>> from flwr.clientapp import ClientApp
>>> from flwr.serverapp.strategy import FedAdam
>>> from fededge.api import CompressionMod, Compressed, UpdateConfig
>>> update = UpdateConfig(compressor="topk", topk_ratio=0.1, error_feedback=True)
>>> client = ClientApp(mods=[CompressionMod(update)])   # then @client.train() as usual
>>> strategy = Compressed(FedAdam(), update=update)     # then strategy.start(grid=..., ...)
"""

from fededge.algorithms.asyncfl import AsyncConfig, LoopConfig, StalenessFunction
from fededge.algorithms.dga import DGAConfig
from fededge.algorithms.gossip import ChocoConfig, GossipConfig
from fededge.clients.mods import CompressionMod, DGAMod, GossipMod, ModOrderError, config_error_mod
from fededge.clients.preview import PreviewMod
from fededge.clients.statestore import StateSpillMod, StateStoreMod
from fededge.compress.update import DownlinkConfig, UpdateConfig
from fededge.errors import ConfigError
from fededge.netem.runclock import ClockConfig
from fededge.server.experiment import Experiment, ExperimentResult, NotEnoughNodesError, ResumeError, RoundFailedError
from fededge.server.results import ResultsConfig
from fededge.strategies.asyncloop import AsyncFL
from fededge.strategies.backup import BackupWorkers
from fededge.strategies.compressed import CodecMismatchError, Compressed
from fededge.strategies.normstats import NormCalibrated, NormStatsQueryError
from fededge.protocol import norm_stats_content
from fededge.strategies.dga import DGA
from fededge.strategies.fedasync import FedAsync
from fededge.strategies.fedbuff import FedBuff
from fededge.strategies.gossip import Gossip
from fededge.strategies.outer import FedAvgOuter
from fededge.strategies.ownloop import OwnLoop
from fededge.strategies.plainbuffers import PlainBuffers
from fededge.strategies.ssp import SSP
from fededge.tracking import MetricSink, MissingExtraError
from fededge.tracking.mlflow_sink import MLflowSink
from fededge.tracking.tensorboard_sink import TensorBoardSink
from fededge.tracking.wandb_sink import WandbSink

__all__ = [
    # client mods
    "CompressionMod", "DGAMod", "GossipMod", "PreviewMod", "StateSpillMod", "StateStoreMod", "config_error_mod",
    "norm_stats_content",
    # server strategies, wrappers and the measurement
    "AsyncFL", "BackupWorkers", "Compressed", "DGA", "FedAsync", "FedAvgOuter", "FedBuff", "Gossip", "SSP",
    "NormCalibrated", "PlainBuffers", "Experiment", "ExperimentResult", "OwnLoop",
    # metric sinks (Experiment(sinks=[...]) or log_to=...)
    "MetricSink", "MLflowSink", "TensorBoardSink", "WandbSink",
    # config objects
    "AsyncConfig", "ChocoConfig", "ClockConfig", "DGAConfig", "DownlinkConfig", "GossipConfig", "LoopConfig",
    "ResultsConfig", "StalenessFunction", "UpdateConfig",
    # errors
    "CodecMismatchError", "ConfigError", "MissingExtraError", "ModOrderError", "NotEnoughNodesError",
    "NormStatsQueryError", "ResumeError", "RoundFailedError",
]
