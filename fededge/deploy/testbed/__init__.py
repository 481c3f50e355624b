"""A testbed of hosts on one machine: SuperNodes in network namespaces (issue 7).

``fededge testbed up --clients N --profiles wifi:0.5,4g:0.5 [--shaping proxy|kernel|none]``
builds, on one Linux machine (root), what docker/compose.yaml builds with containers:

- a Linux bridge ``fdgTAGbr`` in the host's network namespace holding the gateway
  address (``10.213.0.1/24`` by default, ``--subnet``);
- per client ``i`` a network namespace ``fdgTAG-ni`` joined to the bridge by a veth pair:
  ``eth0`` inside the namespace (``10.213.0.(i+2)``), ``fdgTAGhi`` on the bridge;
- one ``flower-superlink --insecure`` in the host namespace;
- per client one ``flower-supernode`` run inside its namespace (``ip netns exec``) with
  ``--node-config 'partition-id=i num-partitions=N'``; each namespace has its own
  loopback, so every SuperNode's runtime API is ``127.0.0.1:9094``, as on a real host;
- the link profile of client ``i`` (:func:`fededge.netem.assign.assign_links` over the
  ``--profiles`` mix with ``--seed``: the same assignment the simulated clock makes for
  partition ``i`` with ``netem = MIX`` and ``seed = SEED``), applied by one of

  ``proxy`` (default): a ``fededge netem proxy`` process per client on the gateway
      address; the SuperNode dials its proxy, which forwards to the SuperLink. The
      SuperLink then listens on the host's 127.0.0.1 only, which no namespace can
      reach, so a node cannot bypass its proxy (compose's ``internal`` networks).
  ``kernel``: tc qdiscs (:mod:`fededge.netem.kernel`, through netlink): the uplink on
      ``eth0``'s egress inside the namespace, the downlink on the egress of the veth's
      host end (which carries SuperLink -> node; no IFB needed). The SuperLink listens
      on the gateway address. Delay, jitter and loss need the kernel's ``sch_netem``:
      where it is missing, ``up`` refuses with an error naming the module and the fix,
      unless ``--rate-only`` asks for the rates alone (tbf), in which case the state
      file and ``up``'s output list, per node, what is NOT emulated.
  ``none``: no shaping (also what an empty ``--profiles`` gives).

Build, then run: :func:`plan_testbed` turns a :class:`TestbedConfig` (and the ports and
kernel facts found by the caller) into a :class:`TestbedPlan` -- names, addresses, ``ip``
operations, qdisc operations and command lines, as data, unit tested without root.
:func:`up` checks the machine (root or CAP_NET_ADMIN + CAP_SYS_ADMIN, the ``ip`` tool,
a subnet no route uses, ``sch_netem`` when needed), writes the plan to the state file
``STATE_DIR/testbed.json`` BEFORE it creates anything, applies it, and records every
process it starts (pid, start time, command line) as it goes. If anything fails, it
tears down what it made and re-raises.

:func:`down` (``fededge testbed down``, any process) reads the state file and removes
exactly what it names: the processes (only when pid AND start time match, so a reused
pid is never killed), their descendants and anything else running in the testbed's
namespaces, then the namespaces (which takes the veth pairs and qdiscs with them), the
remaining host links and the bridge. It checks that none is left, then removes the state
file. Every name must carry the testbed's prefix ``fdg`` + the 6-hex tag of its state
directory, or ``down`` refuses to touch it. With no state file it does nothing and
succeeds, so it is idempotent. Logs (``STATE_DIR/logs``) and results stay.

:func:`run` (``fededge testbed run``) submits the app with ``flwr run APP fededge-testbed
--stream`` (FLWR_HOME = ``STATE_DIR/flwr-home``) and reads the run's real status with
``flwr ls`` (``flwr run`` exits 0 even when a run fails), exactly as
:meth:`fededge.deploy.local.LocalDeployment.run` does: both use
:func:`fededge.deploy.procs.submit_run`.

The modules, each one job:

- :mod:`~fededge.deploy.testbed.plan`: :class:`TestbedConfig`, the plan as data
  (:func:`plan_testbed`, :func:`plan_teardown`) and the testbed's errors; pure;
- :mod:`~fededge.deploy.testbed.host`: the machine: ``ip``, the preflight checks, the
  namespaces and links that exist, starting and stopping the testbed's processes;
- :mod:`~fededge.deploy.testbed.state`: the state file;
- :mod:`~fededge.deploy.testbed.lifecycle`: :func:`up`, :func:`down`, :func:`run`,
  :func:`status`;
- :mod:`~fededge.deploy.testbed.cli`: ``fededge testbed up | run | status | down``.

This package imports nothing of Flower (the command line starts without it).

Example
-------
>>> cfg = TestbedConfig(clients=2, profiles="wifi:0.5,4g:0.5", shaping="kernel",
...                     rate_only=True, state_dir="/tmp/tb")
>>> plan = plan_testbed(cfg, superlink_port=9092)
>>> print("\\n".join(plan.commands()))  # doctest: +SKIP
>>> up(cfg)                                                  # doctest: +SKIP
>>> run("/tmp/tb", {"num-rounds": 2}).ok                     # doctest: +SKIP
>>> down("/tmp/tb")                                          # doctest: +SKIP
"""

from fededge.deploy.testbed.cli import register_cli
from fededge.deploy.testbed.lifecycle import down, run, status, up
from fededge.deploy.testbed.plan import (
    CONNECTION, DEFAULT_SUBNET, SHAPINGS, STATE_FILE, AlreadyUp, IpOp, KernelStep, NetemUnavailable, NodePlan,
    NotPrivileged, PreflightError, ProcessSpec, SubnetInUse, TestbedConfig, TestbedError, TestbedPlan, ToolMissing,
    default_state_dir, plan_teardown, plan_testbed, testbed_tag,
)

__all__ = [
    "CONNECTION", "DEFAULT_SUBNET", "SHAPINGS", "STATE_FILE",
    "IpOp", "KernelStep", "NodePlan", "ProcessSpec", "TestbedConfig", "TestbedPlan",
    "TestbedError", "PreflightError", "AlreadyUp", "NotPrivileged", "ToolMissing", "NetemUnavailable",
    "SubnetInUse",
    "default_state_dir", "testbed_tag", "plan_testbed", "plan_teardown",
    "up", "down", "run", "status", "register_cli",
]
