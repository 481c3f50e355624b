"""One run's simulated clock: the clients' links, and how a reply becomes time on them.

:class:`~fededge.netem.clock.SimClock` times transfers and computation for clients it
knows by index. A run needs three more rules, kept here so that the experiment's
synchronous timing and every strategy that times its own rounds (DGA, gossip, the
asynchronous ones) apply the same ones:

- **which clients**: the links of ``netem`` / ``netem-file`` / ``compute-speed`` are
  assigned once, seeded, for the run's number of clients (:meth:`RunClock.build`), and
  written to ``netem.json`` when the run has a directory;
- **which link a node is on** (:meth:`RunClock.place`): the ``partition-id`` its replies
  report (fededge's ClientApp does); for a ClientApp that reports none, the index of
  its node id among the run's node ids in increasing order (:meth:`RunClock.know_nodes`);
- **how long its work took** (:meth:`RunClock.compute_s`): ``sim_step_s`` per reported
  local step when set; else the ``compute-s`` the reply reports; else the fixed
  ``compute_s`` given here; else what the server measured (from the push of the message
  to the pull of its reply, which includes waiting and, on a runtime that runs clients
  one after another, the others' work).

Pure: no Flower.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from fededge.settings import whole_or_keywords
from fededge.netem.assign import assign_links, check_netem_spec, check_speed_spec
from fededge.netem.clock import ClientLink, SimClock, clock_compute_s

__all__ = ["ClockConfig", "RunClock"]


@dataclass(frozen=True, kw_only=True)
class ClockConfig:
    """The simulated clock's knobs. Run-config keys in brackets; declared here once for
    :class:`RunClock`, :class:`~fededge.server.experiment.Experiment` and fededge's app.

    Parameters
    ----------
    netem : str
        [netem] The emulated network on the simulated clock (``sim_s``): ``""`` (ideal:
        compute only), a profile name for every client (``"4g"``; ``fededge netem
        profiles`` lists them), a seeded mix (``"wifi:0.5,4g:0.5"``) or ``"file"`` (the
        ``[assign]`` table of ``netem_file``). See :mod:`fededge.netem.assign`.
    netem_file : str
        [netem-file] A TOML file with extra profiles and optional ``[assign]`` /
        ``[speed]`` tables; needed when ``netem`` or ``compute_speed`` is ``"file"``.
    compute_speed : str
        [compute-speed] Device speed factors: ``"1.0"``, ``"lognormal:0.5"``
        (heterogeneous, seeded) or ``"file"``. A factor of 2 computes twice as fast as
        the machine that measured.
    sim_step_s : float
        [sim-step-s] Seconds per local step (divided by the client's speed) for replies
        that report ``local-steps-done``; 0 uses the compute time the reply reports. Set
        it (or ``compute_s``) for a ``sim_s``, and an order of asynchronous arrivals,
        that is exactly reproducible for a seed.
    compute_s : float, optional
        Seconds of local work (at speed 1) charged for a reply that reports neither
        ``compute-s`` nor, with ``sim_step_s``, its steps: a ClientApp that is not
        fededge's. None charges what the server measured for it instead (see the module
        docstring), which depends on the machine's load.
    message_overhead_s : float
        [message-overhead-s] Every device's fixed seconds per message beyond its compute
        (a real SuperNode starts a process per message; ``benchmarks/
        bench_deploy_overhead.py`` measures it, cold or warm). 0 simulates the algorithm
        alone.
    nodes_pull : bool
        [nodes-pull] The devices pull their messages, as Flower's SuperNodes do: a node
        asks for its next message only once it has sent its reply, so a pipelined
        protocol's next download cannot overlap the node's compute and upload (DGA's
        timeline). False: the server pushes each message as soon as it exists (the
        protocol's own overlap).
    """

    netem: str = ""
    netem_file: str = ""
    compute_speed: str = "1.0"
    sim_step_s: float = 0.0
    compute_s: float | None = None
    message_overhead_s: float = 0.0
    nodes_pull: bool = False

    def __post_init__(self) -> None:
        check_netem_spec(self.netem)
        check_speed_spec(self.compute_speed)
        if "file" in (self.netem, self.compute_speed) and not self.netem_file:
            raise ValueError("netem_file must name a TOML file: a profile or a speed of 'file' is read from its "
                             "[assign] / [speed] table")
        if not (self.sim_step_s >= 0 and math.isfinite(self.sim_step_s)):
            raise ValueError(f"sim_step_s must be a number of seconds >= 0 (0: measured compute), "
                             f"got {self.sim_step_s!r}")
        if self.compute_s is not None and not (self.compute_s >= 0 and math.isfinite(self.compute_s)):
            raise ValueError(f"compute_s must be None or a number of seconds >= 0, got {self.compute_s!r}")
        if not (self.message_overhead_s >= 0 and math.isfinite(self.message_overhead_s)):
            raise ValueError(f"message_overhead_s must be a number of seconds >= 0, got {self.message_overhead_s!r}")
        if not isinstance(self.nodes_pull, bool):
            raise ValueError(f"nodes_pull must be true or false, got {self.nodes_pull!r}")


class RunClock:
    """The simulated clock of one run, built once its number of clients is known.

    Parameters
    ----------
    netem, netem_file, compute_speed, sim_step_s, compute_s, message_overhead_s, nodes_pull
        :class:`ClockConfig`'s knobs (their defaults, checks and meaning are declared
        there, once).
    seed : int
        Seeds the assignment of links and speeds and every link's random stream.
    run_dir : path, optional
        Where to write ``netem.json`` (each client's profile and speed) once built.

    Examples
    --------
    >>> rc = RunClock(netem="4g", compute_speed="lognormal:0.5", seed=1, compute_s=2.0)
    >>> clock = rc.build(10)
    >>> rc.compute_s(reported_s=None, steps=None, measured_s=0.3)
    2.0
    """

    def __init__(self, *, netem: str = ClockConfig.netem, netem_file: str = ClockConfig.netem_file,
                 compute_speed: str = ClockConfig.compute_speed, seed: int = 0,
                 sim_step_s: float = ClockConfig.sim_step_s, compute_s: float | None = ClockConfig.compute_s,
                 message_overhead_s: float = ClockConfig.message_overhead_s,
                 nodes_pull: bool = ClockConfig.nodes_pull,
                 run_dir: str | Path | None = None, config: ClockConfig | None = None) -> None:
        knobs = whole_or_keywords(ClockConfig, config, owner="RunClock", netem=netem, netem_file=netem_file,
                                  compute_speed=compute_speed, sim_step_s=sim_step_s, compute_s=compute_s,
                                  message_overhead_s=message_overhead_s, nodes_pull=nodes_pull)
        self.config = knobs
        netem, netem_file, compute_speed = knobs.netem, knobs.netem_file, knobs.compute_speed
        sim_step_s, compute_s, message_overhead_s = knobs.sim_step_s, knobs.compute_s, knobs.message_overhead_s
        nodes_pull = knobs.nodes_pull
        self.nodes_pull = nodes_pull
        self.netem = netem
        self.netem_file = netem_file
        self.compute_speed = compute_speed
        self.seed = seed
        self.sim_step_s = sim_step_s
        self.default_compute_s = compute_s
        self.message_overhead_s = message_overhead_s
        self.run_dir = None if run_dir is None else Path(run_dir)
        self.clock: SimClock | None = None
        self.nodes: list[int] = []

    def check(self, num_clients: int) -> None:
        """Resolve the assignment for ``num_clients`` now, so that an unknown profile or a
        bad ``netem_file`` stops a run before any training (raises ``ProfileError``)."""
        self._links(max(num_clients, 1))

    def build(self, num_clients: int) -> SimClock:
        """The run's clock for ``num_clients`` clients (built at the first call; later
        calls return it, whatever they ask)."""
        if self.clock is None:
            links = self._links(num_clients)
            if self.run_dir is not None:
                (self.run_dir / "netem.json").write_text(json.dumps({
                    "netem": self.netem, "netem-file": self.netem_file, "compute-speed": self.compute_speed,
                    "clients": [{"partition-id": i, "profile": link.profile.name if link.profile else None,
                                 "speed": link.speed} for i, link in enumerate(links)],
                }, indent=2) + "\n")
            self.clock = SimClock(links, seed=self.seed)
        return self.clock

    def state_dict(self) -> dict:
        """The run's clock so far, for a checkpoint (plain values): the known nodes and,
        once built, the clock's own state (:meth:`SimClock.state_dict`)."""
        return {"nodes": list(self.nodes),
                "clock": None if self.clock is None else self.clock.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Continue from :meth:`state_dict` (same knobs and seed; ``netem.json`` is not
        written again)."""
        self.nodes = [int(n) for n in state["nodes"]]
        if state["clock"] is not None:
            if self.clock is None:
                self.clock = SimClock(self._links(int(state["clock"]["num_clients"])), seed=self.seed)
            self.clock.load_state_dict(state["clock"])

    def _links(self, num_clients: int) -> list[ClientLink]:
        return assign_links(self.netem, num_clients, seed=self.seed, netem_file=self.netem_file,
                            speed=self.compute_speed, message_overhead_s=self.message_overhead_s,
                            pulls=self.nodes_pull)

    def know_nodes(self, node_ids: Iterable[int]) -> None:
        """The run's node ids: a node whose replies report no partition id is placed by
        its index among them, in increasing order."""
        self.nodes = sorted(int(n) for n in node_ids)

    def place(self, node_id: int, reported: int | None) -> int | None:
        """The client index (link) of ``node_id``: the partition id it ``reported``, else
        its index among the known nodes, else None (not on the clock)."""
        if reported is not None:
            return int(reported)
        try:
            return self.nodes.index(node_id)
        except ValueError:
            return None

    def num_clients(self, reported: int | None) -> int:
        """How many clients to build the clock for: the ``num-partitions`` the replies
        reported, else the number of known nodes."""
        return int(reported) if reported is not None else len(self.nodes)

    def measured_s(self, reported_s: float | None, measured_s: float | None = None) -> float:
        """The compute seconds a reply stands for, before ``sim_step_s``: reported, else the
        fixed ``compute_s``, else what the server measured (0 if nothing)."""
        if reported_s is not None:
            return float(reported_s)
        if self.default_compute_s is not None:
            return self.default_compute_s
        return 0.0 if measured_s is None else float(measured_s)

    def compute_s(self, reported_s: float | None, steps: int | None, measured_s: float | None = None) -> float:
        """Seconds of compute on the clock (at speed 1) for one reply (module docstring)."""
        base = self.measured_s(reported_s, measured_s)
        return base if steps is None else clock_compute_s(base, int(steps), self.sim_step_s)
