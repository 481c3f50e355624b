"""``run_inprocess``: fededge's own ServerApp and ClientApp on the in-process runtime.

:class:`~fededge.server.grid.InProcessGrid` delivers each message by calling the
ClientApp in this process (no SuperLink, no Ray); :func:`run_inprocess` parses the run
config, checks the clients' data split and runs fededge's apps (or the given ones) on it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from flwr.clientapp import ClientApp
from flwr.serverapp import ServerApp

from fededge.config import ConfigError, RunConfig
from fededge.keys import SERVER_RESULT_KEY
from fededge.server.app import app as default_server
from fededge.server.grid import InProcessGrid, run_server
from fededge.workload import check_partition

__all__ = ["DEFAULT_CLIENT_APP", "run_inprocess"]

#: fededge's ClientApp, as workers import it.
DEFAULT_CLIENT_APP = "fededge.clients.app:app"


def run_inprocess(
    overrides: Mapping[str, Any] | None = None,
    *,
    num_clients: int = 10,
    server_app: ServerApp | None = None,
    client_app: ClientApp | str | None = None,
    node_configs: Sequence[Mapping[str, Any]] | None = None,
    run_id: int = 1,
    keep_client_states: bool = True,
    workers: int = 1,
    client_states: str | None = None,
    states_dir: str | None = None,
) -> Path | None:
    """Run fededge's ServerApp and ClientApp (or the given ones) in this process.

    ``overrides`` are run-config keys, as ``flwr run --run-config`` takes them; the rest
    are the defaults (the same as pyproject.toml's). Returns the run directory when the
    ServerApp is fededge's. ``keep_client_states=False`` leaves the nodes' states out of
    the checkpoints, as under Ray or on a SuperLink: the nodes then keep them on disk
    (:mod:`fededge.clients.statestore`).

    ``workers`` runs the clients on that many processes (this one included; results do
    not change with it), and ``client_states`` (default: the run config's
    ``client-states``, ``"memory"``) set to ``"disk"`` keeps idle clients' states on disk
    (in ``states_dir``, default ``$TMPDIR``), so that memory follows the clients per
    round: :class:`~fededge.server.grid.InProcessGrid` says how. With ``workers > 1`` a
    ``client_app`` other than fededge's is given as ``"module:attribute"``.

    Examples
    --------
    >>> run_dir = run_inprocess({"num-rounds": 5, "alpha": 0.1}, num_clients=10)
    """
    # fededge's ClientApp, imported here: the server side imports no client code at module level.
    from fededge.clients.app import app as default_client

    cfg = RunConfig.from_mapping(dict(overrides or {}))  # fail early, naming the key
    cpr = cfg.clients_per_round
    for key, want in (("clients-per-round", cpr if isinstance(cpr, int) else 0),
                      ("min-available-nodes", cfg.min_available_nodes)):
        if want > num_clients:
            raise ConfigError(
                f"run-config key '{key}' is {want} but the in-process run has only "
                f"{num_clients} clients; lower it or raise num_clients (--num-clients)"
            )
    run_config = cfg.to_mapping()
    grid = InProcessGrid(
        client_app or default_client, num_nodes=num_clients, run_config=run_config,
        run_id=run_id, node_configs=node_configs, seed=cfg.seed, keep_client_states=keep_client_states,
        client_states=client_states or cfg.client_states, states_dir=states_dir, workers=workers,
        client_app_ref=None if client_app is not None else DEFAULT_CLIENT_APP,
        cohort=cfg.cohort and client_app is None,  # a ClientApp of one's own keeps its own path
    )
    try:
        # A data split the clients cannot make stops the run here, before anything starts,
        # with one ConfigError. The split is cached: the clients reuse it.
        for num_partitions, data_dir in grid.data_splits():
            check_partition(cfg, num_partitions, data_dir)
        if workers > 1:
            grid.start_workers()  # a worker that cannot start stops the run here, with its error
        server_ctx = run_server(server_app or default_server, grid)
    finally:
        grid.close()
    if SERVER_RESULT_KEY in server_ctx.state:
        return Path(str(server_ctx.state[SERVER_RESULT_KEY]["run-dir"]))
    return None
