"""How a strategy is checkpointed and resumed by the measurement layer: one small interface.

:class:`fededge.server.experiment.Experiment` writes a checkpoint every ``checkpoint-every``
rounds and resumes a run from one (``fededge resume``). What it needs from a strategy:

**Strategies that use Flower's own round loop** (``Strategy.start``: FedAvg, FedAdam,
FedProx, fededge's ``Compressed(...)`` and ``FedAvgOuter``): nothing. Between two rounds
Flower's loop holds no message in flight, so the experiment checkpoints after a round's
evaluation; their state is read by :func:`strategy_state` (a ``state_dict()`` where the
strategy has one, else every public data attribute, the way Flower's strategies keep
their state: FedOpt's moments, FedAvgM's momentum, the current model; a frozen
dataclass, a settings object fixed when the strategy was built, is not state and is
left out). On resume the
experiment runs Flower's loop again, shifted by the rounds already done
(:class:`FromRound`), so no round loop is written twice.

**Strategies with their own loop** (DGA, Gossip, the asynchronous ones) implement

``attach_checkpoint(hook: CheckpointHook) -> None``
    called before ``start``. After each round ``t`` (after its ``evaluate_fn`` call) the
    loop asks ``hook.due(t)``; when due, it first makes sure that **no message of a later
    round is outstanding** (a pipelined loop stops pushing ahead at ``t``; an
    asynchronous loop pulls every reply still out into its own queue), then calls
    ``hook.save(t)``, which reads its ``state_dict()``.
``state_dict() -> dict``
    everything the loop needs to continue with round ``t + 1``, as plain values
    (:data:`STATE_TYPES`; records through :func:`arrays_to_state` and
    :func:`message_to_state`); only called from ``hook.save``.
``load_state_dict(state) -> None``
    called before ``start``: ``start`` then continues with round ``t + 1`` (it does not
    evaluate round 0 again, nor pick its participants again), and ignores its
    ``initial_arrays``.

The random generators (Python's ``random``, which Flower samples nodes with; torch's and
numpy's global ones), the clock and the clients' ``context.state`` are the experiment's
and the runtime's to save: a strategy saves only what it keeps itself.

Node ids: fededge's in-process runtime gives the same node ids to a resumed run (they
are seeded). On another grid a strategy whose state names node ids raises
:class:`ResumeError` at ``start`` when the grid's nodes are not the ones it saved.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy

from fededge import _flwr_internals as fi

__all__ = [
    "CheckpointHook", "CheckpointedStrategy", "FromRound", "ResumeError", "STATE_TYPES", "arrays_from_state",
    "arrays_to_state", "attach_checkpoint", "check_nodes", "from_plain", "load_strategy_state", "message_from_state",
    "message_to_state", "strategy_state", "to_plain",
]

#: The value types a ``state_dict()`` may hold (nested in dicts, lists and tuples):
#: what ``torch.load(..., weights_only=True)`` reads back.
STATE_TYPES = (type(None), bool, int, float, str, bytes, torch.Tensor)

log = logging.getLogger("fededge")


class ResumeError(RuntimeError):
    """A checkpoint cannot be resumed on this grid or with this strategy."""


@runtime_checkable
class CheckpointHook(Protocol):
    """What the experiment hands a strategy with its own round loop."""

    def due(self, server_round: int) -> bool:
        """Whether a checkpoint is written after round ``server_round``."""

    def save(self, server_round: int) -> None:
        """Write it now (the loop has nothing of a later round outstanding)."""


@runtime_checkable
class CheckpointedStrategy(Protocol):
    """A strategy with its own round loop that can be checkpointed (module docstring)."""

    def attach_checkpoint(self, hook: CheckpointHook) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def attach_checkpoint(strategy: Strategy, hook: CheckpointHook) -> bool:
    """Hand ``hook`` to a strategy that runs its own loop; False for Flower's loop (the
    experiment then saves after each round's evaluation itself)."""
    attach = getattr(strategy, "attach_checkpoint", None)
    if attach is None:
        return False
    attach(hook)
    return True


# -- records as plain state ---------------------------------------------------------
def arrays_to_state(arrays: ArrayRecord | None) -> dict[str, torch.Tensor] | None:
    """An ArrayRecord as an ordered name -> tensor dict (copied, exact)."""
    if arrays is None:
        return None
    return {k: v.detach().clone() for k, v in arrays.to_torch_state_dict().items()}


def arrays_from_state(state: dict[str, torch.Tensor] | None) -> ArrayRecord | None:
    """The ArrayRecord :func:`arrays_to_state` saved, bit for bit."""
    return None if state is None else ArrayRecord({k: v for k, v in state.items()})


def message_to_state(msg: Message) -> dict[str, Any]:
    """A Message (a reply waiting to be used) as its serialised Flower objects."""
    root, objects = fi.serialise(msg)
    return {"root": root, "objects": objects, "message_id": msg.metadata.message_id}


def message_from_state(state: dict[str, Any]) -> Message:
    """The Message :func:`message_to_state` saved, with its metadata."""
    msg = fi.message_from_objects(state["root"], dict(state["objects"]))
    if state.get("message_id"):
        fi.set_message_id(msg, state["message_id"])
    return msg


def check_nodes(saved: Iterable[int], grid: Grid, what: str) -> None:
    """Raise :class:`ResumeError` unless every saved node id is one of the grid's."""
    missing = sorted(set(int(n) for n in saved) - set(int(n) for n in grid.get_node_ids()))
    if missing:
        raise ResumeError(
            f"{what}: the checkpoint names {len(missing)} node id(s) this grid does not have "
            f"(first: {missing[0]}); this strategy resumes only on the same nodes (fededge's "
            "in-process runtime gives a resumed run the same node ids). Start the run again "
            "instead, or use a strategy on Flower's round loop")


# -- strategies on Flower's own loop ----------------------------------------------------
#: What a strategy without ``state_dict()`` keeps between rounds is read from its public
#: attributes: every one that holds data (numbers, strings, arrays, ``ArrayRecord``,
#: and lists, tuples and dicts of them) is saved, and every one that holds a strategy
#: (a wrapper's ``inner``, Flower's DP wrappers' ``strategy``) is followed. This covers
#: each of Flower's strategies without naming their attributes: FedOpt's ``m_t``/``v_t``,
#: FedAvgM's ``momentum_vector``, the current model of FedOpt, FedAvgM and QFedAvg, the
#: adaptive DP wrappers' ``clipping_norm``, FedXgbCyclic's ``registered_nodes``. Their
#: settings are saved too (a resumed run is built with the same ones). Callables are
#: not state; an attribute of any other type is named in a warning, once per class.
_UNSAVED_WARNED: set[tuple[str, str]] = set()


class _Unsaved(Exception):
    pass


def to_plain(value: Any) -> Any:
    if isinstance(value, ArrayRecord):
        return {"__arrayrecord__": arrays_to_state(value)}
    if isinstance(value, dict):
        return {k: to_plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [to_plain(v) for v in value]
    if isinstance(value, tuple):
        return {"__tuple__": [to_plain(v) for v in value]}
    if isinstance(value, (set, frozenset)):
        try:
            items = sorted(value)  # a checkpoint's bytes do not depend on the set's order
        except TypeError:  # items of types that do not compare: named in a warning, as before
            raise _Unsaved(f"set of {', '.join(sorted({type(v).__name__ for v in value}))}") from None
        return {"__set__": [to_plain(v) for v in items]}
    if isinstance(value, np.generic) and value.dtype.kind in "biufc" and value.dtype != np.longdouble:
        # A numpy scalar (first: np.float64 is a float, and pickled as numpy's own it made the
        # checkpoint unreadable with weights_only): kept as a 0-d array, its dtype exact
        # (FedAdam's moments of a 0-d BatchNorm counter are np.float64 scalars).
        return {"__npscalar__": torch.from_numpy(np.asarray(value).copy())}
    if isinstance(value, np.generic):  # another numpy scalar (a string, a date): its Python value
        return value.item()
    if isinstance(value, (bool, int, float, str, bytes, type(None), torch.Tensor)):
        return value
    if isinstance(value, np.ndarray):
        return {"__ndarray__": torch.from_numpy(value.copy())}  # exact
    raise _Unsaved(type(value).__name__)


def from_plain(value: Any) -> Any:
    if isinstance(value, dict) and set(value) == {"__arrayrecord__"}:
        return arrays_from_state(value["__arrayrecord__"])
    if isinstance(value, dict) and set(value) == {"__ndarray__"}:
        return value["__ndarray__"].numpy()
    if isinstance(value, dict) and set(value) == {"__npscalar__"}:
        return value["__npscalar__"].numpy()[()]  # the numpy scalar, of its dtype
    if isinstance(value, dict) and set(value) == {"__tuple__"}:
        return tuple(from_plain(v) for v in value["__tuple__"])
    if isinstance(value, dict) and set(value) == {"__set__"}:
        return {from_plain(v) for v in value["__set__"]}
    if isinstance(value, dict):
        return {k: from_plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [from_plain(v) for v in value]
    return value


def strategy_state(strategy: Strategy) -> dict[str, Any]:
    """A strategy's state for a checkpoint: its ``state_dict()``, else its public data
    attributes (see above), followed into the strategies it wraps."""
    if hasattr(strategy, "state_dict"):
        return {"state_dict": strategy.state_dict()}
    attrs: dict[str, Any] = {}
    children: dict[str, Any] = {}
    for name, value in vars(strategy).items():
        if name.startswith("_") or callable(value) and not isinstance(value, Strategy):
            continue
        if isinstance(value, Strategy):
            children[name] = strategy_state(value)
            continue
        if dataclasses.is_dataclass(value) and not isinstance(value, type) and value.__dataclass_params__.frozen:
            continue  # a frozen settings object (Compressed.update): fixed when built, not kept between rounds
        try:
            attrs[name] = to_plain(value)
        except _Unsaved as err:
            key = (type(strategy).__qualname__, name)
            if key not in _UNSAVED_WARNED:
                _UNSAVED_WARNED.add(key)
                log.warning("checkpoint: %s.%s (a %s) is not saved: a strategy that keeps such state "
                            "between rounds needs state_dict()/load_state_dict()", key[0], name, err)
    return {"attrs": attrs, "strategies": children}


def load_strategy_state(strategy: Strategy, state: dict[str, Any]) -> None:
    """Put back what :func:`strategy_state` saved (checkpoints of older fededge too)."""
    if "state_dict" in state:
        if not hasattr(strategy, "load_state_dict"):
            raise ResumeError(f"the checkpoint holds a state_dict but {type(strategy).__name__} cannot load one")
        strategy.load_state_dict(state["state_dict"])
        return
    inner = vars(strategy).get("inner")
    for attr, value in state.get("attrs", {}).items():
        target = strategy
        if attr not in vars(strategy) and isinstance(inner, Strategy) and attr in vars(inner):
            # the state of a strategy a wrapper now holds (a checkpoint from before the wrapper
            # was added: PlainBuffers around fedavgm, fedadam, ...): its own, not the wrapper's
            target = inner
        setattr(target, attr, from_plain(value))
    children = dict(state.get("strategies", {}))
    if "inner" in state:  # older checkpoints: the wrapped strategy under "inner"
        children["inner"] = state["inner"]
    for name, sub in children.items():
        inner = getattr(strategy, name, None)
        if not isinstance(inner, Strategy):
            raise ResumeError(f"the checkpoint holds the state of {type(strategy).__name__}.{name}, a "
                              "strategy, but this one has none there: build the strategy as the run's was")
        load_strategy_state(inner, sub)


class FromRound(Strategy):
    """Flower's round loop resumed: ``strategy``'s rounds numbered from ``done + 1``.

    Flower's ``Strategy.start`` counts rounds from 1 and evaluates round 0 first. This
    wrapper runs that same loop for the rounds left, handing ``strategy`` round
    ``done + r`` for the loop's round ``r`` (and ``evaluate_fn`` likewise, so its call
    for the loop's round 0 re-evaluates the checkpoint's round ``done``, which the
    experiment does not record again).
    """

    def __init__(self, strategy: Strategy, done: int) -> None:
        self.inner = strategy
        self.done = done

    def __getattr__(self, name: str) -> Any:  # round_report, take_stats, ... of the inner strategy
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def summary(self) -> None:
        self.inner.summary()

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        return self.inner.configure_train(server_round + self.done, arrays, config, grid)

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        return self.inner.aggregate_train(server_round + self.done, replies)

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        return self.inner.configure_evaluate(server_round + self.done, arrays, config, grid)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        return self.inner.aggregate_evaluate(server_round + self.done, replies)

    def start(self, grid: Grid, initial_arrays: ArrayRecord, num_rounds: int = 3, timeout: float = 3600,
              train_config: ConfigRecord | None = None, evaluate_config: ConfigRecord | None = None,
              evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None) -> Result:
        shifted = None if evaluate_fn is None else (lambda rnd, arrays: evaluate_fn(rnd + self.done, arrays))
        return Strategy.start(self, grid, initial_arrays, max(num_rounds - self.done, 0), timeout,
                              train_config, evaluate_config, shifted)
