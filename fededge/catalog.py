"""The strategies a run config can name (``strategy=...``): one record each.

A :class:`StrategyRecord` is everything fededge needs to know about a selectable
strategy, in one place:

- ``build``: how the server builds it from the run config (``cfg``) and Flower's
  sampling arguments (``kw``, :func:`fededge.strategies.registry.sampling_kwargs`);
- ``compression``: how a compressed uplink goes with it: ``"wrapped"`` (any Flower
  strategy: :class:`~fededge.strategies.compressed.Compressed` decodes the updates
  before it aggregates them), ``"own"`` (it decodes them itself: DGA, gossip's CHOCO; a
  strategy of one's own on Flower's round loop that does sets ``decodes_compressed = True``,
  or fededge's reply screen refuses its compressed replies) or
  ``"none"`` (``compressor`` and ``downlink-compressor`` are refused by name before
  round 1: the asynchronous family);
- ``client_side``: the client mods fededge's ClientApp adds for it (``""``: none,
  ``"dga"``: :class:`~fededge.clients.mods.DGAMod`, ``"gossip"``:
  :class:`~fededge.clients.mods.GossipMod` in place of the ``CompressionMod``);
- ``client_mods``: for a strategy of one's own whose clients do more than train, the
  Flower mods fededge's ClientApp adds for it (a callable of the run config, or its
  ``"module:function"`` path), innermost, after the compression mod;
- ``check``: what it asks of the other run-config keys, raised as a
  :class:`~fededge.errors.ConfigError` when the run config is read.

``build``, ``check`` and ``client_mods`` are callables, or ``"module:function"`` paths imported when first
used: this module is pure (no Flower, no torch), so :mod:`fededge.config` reads the names
here without importing any strategy. Adding a strategy is one file (the strategy) and
one record (:func:`register_strategy`); the run config, the server's registry and the
ClientApp read everything else from the record.

Examples
--------
>>> from flwr.serverapp.strategy import FedMedian
>>> register_strategy(StrategyRecord(
...     name="my-median", build=lambda cfg, kw: FedMedian(**kw),
...     summary="coordinate-wise median of the replies"))  # doctest: +SKIP
>>> # then: fededge run --run-config "strategy='my-median'"
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Union

from fededge.errors import ConfigError

__all__ = ["COMPRESSION_FORMS", "CLIENT_SIDES", "StrategyRecord", "register_strategy", "strategy_names",
           "strategy_record", "unregister_strategy"]

#: How a compressed uplink goes with a strategy (:attr:`StrategyRecord.compression`).
COMPRESSION_FORMS = ("wrapped", "own", "none")
#: The client mods fededge's ClientApp adds for a strategy (:attr:`StrategyRecord.client_side`).
CLIENT_SIDES = ("", "dga", "gossip")

Hook = Union[str, Callable[..., Any]]


def _resolve(hook: Hook, what: str) -> Callable[..., Any]:
    if callable(hook):
        return hook
    module, sep, attr = hook.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"{what} must be a callable or a 'module:function' path, got {hook!r}")
    obj: Any = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


@dataclass(frozen=True)
class StrategyRecord:
    """One selectable strategy (see the module docstring).

    Parameters
    ----------
    name : str
        The run-config value (``strategy=<name>``), kebab- or lower-case.
    build : callable or str
        ``build(cfg, kw) -> Strategy``: ``cfg`` the :class:`~fededge.config.RunConfig`,
        ``kw`` Flower's sampling and record-key arguments. A ``"module:function"`` path
        is imported when the strategy is built.
    summary : str
        One line: what it is (the paper), for listings and errors.
    compression : str
        ``wrapped`` (default), ``own`` or ``none``.
    client_side : str
        ``""`` (default: a plain Flower ClientApp is enough), ``dga`` or ``gossip``.
    check : callable or str, optional
        ``check(cfg) -> None``, raising :class:`~fededge.errors.ConfigError` for a run
        config the strategy cannot run with.
    client_mods : callable or str, optional
        ``client_mods(cfg) -> sequence of Flower mods`` (``mod(msg, context, call_next)``)
        that fededge's ClientApp runs for this strategy, innermost: after the state store
        and the compression mod, next to the training itself. For a strategy whose
        clients reply with more than a trained model. Registered in the clients'
        process too (a ServerApp's registration does not reach a SuperNode's ClientApp).
    """

    name: str
    build: Hook
    summary: str = ""
    compression: str = "wrapped"
    client_side: str = ""
    check: Hook | None = None
    client_mods: Hook | None = None

    def __post_init__(self) -> None:
        if not self.name or self.name != self.name.strip() or " " in self.name:
            raise ValueError(f"a strategy's name must be one word (the run-config value), got {self.name!r}")
        if self.compression not in COMPRESSION_FORMS:
            raise ValueError(f"compression must be one of {', '.join(COMPRESSION_FORMS)}, got {self.compression!r}")
        if self.client_side not in CLIENT_SIDES:
            raise ValueError(f"client_side must be one of {', '.join(map(repr, CLIENT_SIDES))}, "
                             f"got {self.client_side!r}")
        for field in ("build", "check", "client_mods"):
            hook = getattr(self, field)
            if not (callable(hook) or isinstance(hook, str) or (hook is None and field != "build")):
                raise ValueError(f"{field} must be a callable or a 'module:function' path, got {hook!r}")

    def builder(self) -> Callable[..., Any]:
        """``build`` as a callable (a path imported now)."""
        return _resolve(self.build, f"strategy {self.name!r}: build")

    def mods_for(self, cfg: Any) -> tuple[Any, ...]:
        """``client_mods(cfg)`` as a tuple (empty when there is none)."""
        if self.client_mods is None:
            return ()
        mods = tuple(_resolve(self.client_mods, f"strategy {self.name!r}: client_mods")(cfg))
        for mod in mods:
            if not callable(mod):
                raise TypeError(f"strategy {self.name!r}: client_mods gave {mod!r}, which is not a "
                                f"Flower mod (a callable mod(msg, context, call_next))")
        return mods

    def check_config(self, cfg: Any) -> None:
        """Run ``check`` on a run config (nothing when there is none)."""
        if self.check is not None:
            _resolve(self.check, f"strategy {self.name!r}: check")(cfg)


_FLOWER = "fededge.strategies.registry"
_BUILTIN = (
    StrategyRecord("fedavg", f"{_FLOWER}:build_fedavg", "FedAvg (McMahan et al. 2017), weighted by num-examples"),
    StrategyRecord("fedavgm", f"{_FLOWER}:build_fedavgm", "FedAvg with server momentum (Hsu et al. 2019)"),
    StrategyRecord("fedprox", f"{_FLOWER}:build_fedprox", "FedProx (Li et al. 2020): proximal-mu"),
    StrategyRecord("fedadam", f"{_FLOWER}:build_fedadam", "FedAdam (Reddi et al. 2021)"),
    StrategyRecord("fedadagrad", f"{_FLOWER}:build_fedadagrad", "FedAdagrad (Reddi et al. 2021)"),
    StrategyRecord("fedyogi", f"{_FLOWER}:build_fedyogi", "FedYogi (Reddi et al. 2021)"),
    StrategyRecord("fedmedian", f"{_FLOWER}:build_fedmedian", "coordinate-wise median (Yin et al. 2018)"),
    StrategyRecord("fedtrimmedavg", f"{_FLOWER}:build_fedtrimmedavg", "trimmed mean (Yin et al. 2018)"),
    StrategyRecord("krum", f"{_FLOWER}:build_krum", "Krum (Blanchard et al. 2017)",
                   check="fededge.config:check_krum_keys"),
    StrategyRecord("dga", f"{_FLOWER}:build_dga",
                   "Delayed Gradient Averaging (Zhu et al. 2021)", compression="own", client_side="dga",
                   check="fededge.config:check_dga_keys"),
    StrategyRecord("diloco", f"{_FLOWER}:build_diloco",
                   "FedAvg with an outer Nesterov step (DiLoCo, Douillard et al. 2023)"),
    StrategyRecord("gossip", f"{_FLOWER}:build_gossip",
                   "D-PSGD / CHOCO-SGD over a topology, the server as a relay", compression="own",
                   client_side="gossip", check="fededge.config:check_gossip_keys"),
    StrategyRecord("fedasync", f"{_FLOWER}:build_fedasync",
                   "FedAsync (Xie et al. 2019)", compression="none"),
    StrategyRecord("fedbuff", f"{_FLOWER}:build_fedbuff",
                   "FedBuff (Nguyen et al. 2022)", compression="none"),
    StrategyRecord("ssp", f"{_FLOWER}:build_ssp",
                   "bounded staleness, SSP (Ho et al. 2013)", compression="none"),
    StrategyRecord("backup", f"{_FLOWER}:build_backup",
                   "backup workers, the first m of m + e (Chen et al. 2016)", compression="none"),
)

#: The built-in strategies' names, in their order.
BUILTIN_NAMES: tuple[str, ...] = tuple(r.name for r in _BUILTIN)
_RECORDS: dict[str, StrategyRecord] = {r.name: r for r in _BUILTIN}


def register_strategy(record: StrategyRecord, *, replace: bool = False) -> StrategyRecord:
    """Make ``record.name`` selectable with ``strategy=<name>`` in this process (the
    server's and, for a strategy with a client side, the clients'). A name already taken
    is refused unless ``replace``."""
    if not isinstance(record, StrategyRecord):
        raise TypeError(f"register_strategy takes a StrategyRecord, got {type(record).__name__}")
    if record.name in _RECORDS and not replace:
        raise ValueError(f"strategy {record.name!r} is registered already; pass replace=True to replace it")
    _RECORDS[record.name] = record
    return record


def unregister_strategy(name: str) -> None:
    """Forget a registered strategy (a built-in one cannot be removed)."""
    if name in BUILTIN_NAMES:
        raise ValueError(f"{name!r} is a built-in strategy; it cannot be unregistered")
    _RECORDS.pop(name, None)


def strategy_names() -> tuple[str, ...]:
    """Every selectable name: the built-in ones, then those registered."""
    return tuple(_RECORDS)


def strategy_record(name: str) -> StrategyRecord:
    """The record of ``name`` (:class:`~fededge.errors.ConfigError` naming the choices)."""
    try:
        return _RECORDS[name]
    except KeyError:
        raise ConfigError(f"run-config key 'strategy' must be one of {', '.join(_RECORDS)}, got {name!r}; "
                          "a strategy of your own is added with fededge.catalog.register_strategy") from None
