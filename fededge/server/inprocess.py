"""``run_inprocess``: fededge's own ServerApp and ClientApp on the in-process runtime.

:class:`~fededge.server.grid.InProcessGrid` delivers each message by calling the
ClientApp in this process (no SuperLink, no Ray); :func:`run_inprocess` parses the run
config, checks the clients' data split and runs fededge's apps (or the given ones) on it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from flwr.clientapp import ClientApp
from flwr.serverapp import ServerApp

from fededge import keys
from fededge.clients import device as _device  # its time_sgd_step looked up at call time (tests replace it)
from fededge.clients.device import DeviceChoice, choose_by_measurement, set_cuda_determinism
from fededge.config import RunConfig, check_clients_available
from fededge.keys import SERVER_RESULT_KEY
from fededge.machine import runs_sharing, usable_cores
from fededge.server.app import app as default_server
from fededge.server.grid import InProcessGrid, run_server
from fededge.server.nodestates import ROUND_SHARE_MAX
from fededge.workload import CLIENT_TENSORS_CACHED, check_partition, partition_indices

__all__ = ["DEFAULT_CLIENT_APP", "auto_workers", "client_device_choice", "gpu_workers", "run_inprocess",
           "usable_cores"]

#: fededge's ClientApp, as workers import it.
DEFAULT_CLIENT_APP = "fededge.clients.app:app"


def auto_workers(cfg: RunConfig, num_clients: int, *, by_reference: bool = True,
                 cores: int | None = None, cuda: bool | None = None) -> tuple[int, str]:
    """``workers="auto"``: how many processes run the clients, and why, in a few words.

    Every usable core runs clients (one torch thread each), but never more processes
    than a round has clients. One process when the clients cannot be spread: a ClientApp
    given as an object (the workers import it by reference), ``cohort=true`` (a round's
    clients train together in this process), or clients on CUDA (``device`` cuda, or
    auto on a machine with CUDA: they share this process's GPU context).

    Examples
    --------
    >>> auto_workers(RunConfig(clients_per_round=100), 10_000, cores=16, cuda=False)
    (16, '16 usable cores, 100 clients a round')
    >>> auto_workers(RunConfig(clients_per_round=3), 10, cores=16, cuda=False)
    (3, '16 usable cores, 3 clients a round')
    """
    if not by_reference:
        return 1, "a ClientApp given as an object runs in this process (give it as 'module:attribute' for workers)"
    if cfg.cohort:
        return 1, "cohort=true trains a round's clients together in this process"
    if cuda is None:
        cuda = torch_cuda_available()
    if cfg.device.startswith("cuda") or (cfg.device == "auto" and cuda):
        return 1, "the clients train on CUDA, in this process"
    sharing = runs_sharing() if cores is None else 1
    cores = usable_cores() if cores is None else cores
    per_round = _per_round(cfg, num_clients)
    n = max(1, min(cores, per_round))
    share = f" (this run's share: {sharing} runs share the machine)" if sharing > 1 else ""
    return n, (f"{cores} usable core{'s' if cores != 1 else ''}{share}, "
               f"{per_round} client{'s' if per_round != 1 else ''} a round")


def torch_cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def _per_round(cfg: RunConfig, num_clients: int) -> int:
    cpr = cfg.clients_per_round
    # Flower samples int(n * fraction) nodes, at least min_train_nodes (1): the same count here.
    return min(num_clients, cpr if isinstance(cpr, int) else max(1, int(cpr * num_clients)))


def client_device_choice(cfg: RunConfig, num_clients: int, workers: int | str = "auto", *,
                         cuda: bool | None = None, timer: Any = None) -> DeviceChoice:
    """Where fededge's clients train in this runtime, and why.

    ``device=auto`` decides by measurement where CUDA is
    (:func:`~fededge.clients.device.choose_by_measurement`): the run's model takes
    training steps at the run's batch size on CUDA and on the CPU, the CPU counted with
    the processes it would use (``workers``, or :func:`auto_workers`' count on the CPU)
    and a cohort timed as its whole batch, and the faster per client wins. Without CUDA
    it is the CPU, untimed. Any other ``device`` is taken as asked. The choice is made
    once, here, for every client of the run (the grid gives it to them in their node
    config), so that all train on one device whatever their process.
    """
    if cfg.device != "auto":
        return DeviceChoice(cfg.device, "as asked")
    if cuda is None:
        cuda = torch_cuda_available()
    if not cuda:
        return DeviceChoice("cpu", "auto: no CUDA device")
    import torch

    from fededge.models.zoo import build_model
    from fededge.workload import dataset_for

    # Before the first CUDA matmul: cuBLAS reads its workspace setting when it starts.
    set_cuda_determinism(torch.device("cuda"), cfg.deterministic)
    ds = dataset_for(cfg)
    per_round = _per_round(cfg, num_clients)
    if cfg.cohort:
        processes, threads = 1, usable_cores()
    else:
        processes = auto_workers(cfg, num_clients, cuda=False)[0] if workers == "auto" else int(workers)
        # Several processes run their clients on one thread each (the grid's worker_threads).
        threads = 1 if processes > 1 else cfg.client_threads or usable_cores()
    choice = choose_by_measurement(
        lambda: build_model(cfg.model, input_shape=ds.input_shape, num_classes=ds.num_classes, seed=0),
        tuple(ds.input_shape), ds.num_classes, cfg.batch_size, cpu_processes=processes, cpu_threads=threads,
        cohort_clients=per_round if cfg.cohort else 1, cuda=True, timer=timer or _device.time_sgd_step)
    return DeviceChoice(choice.device, f"auto: {choice.reason}", choice.per_client_step_s)


def _round_share_mb(grid: InProcessGrid, cfg: RunConfig) -> float:
    """The most MiB of one round's states that ``client-states=auto`` keeps in memory
    (:attr:`~fededge.server.nodestates.AutoStates.round_cap`)."""
    cap = getattr(getattr(grid, "states", None), "round_cap", None)  # AutoStates'
    return ROUND_SHARE_MAX * cfg.client_states_memory_mb if cap is None else round(cap / 2**20, 1)


def gpu_workers(cfg: RunConfig, asked: int, device: str,
                nodes: Iterable[tuple[int, int, str | None]]) -> tuple[int, str]:
    """How many of ``asked`` processes can train fededge's clients on the GPU ``device``
    at once (issue 35, item 4: several clients in flight on one GPU, sized by its free
    memory), and why, in a few words.

    The run's model takes one training step on the GPU at the run's batch size
    (:func:`~fededge.clients.device.measure_cuda_footprint`, after the run's cuBLAS
    determinism setting: it is read at the first CUDA matmul); a process also caches the
    data of up to :data:`~fededge.workload.CLIENT_TENSORS_CACHED` clients on the device
    (any process may run any client), counted as the largest that many of the nodes'
    partitions (``nodes``: each node's ``(partition-id, num-partitions, data-dir)``); the
    server's model and average are on the GPU too unless ``server-device=cpu``; where a
    sweep runs several runs at once, this one takes its share of the GPU
    (:func:`~fededge.machine.runs_sharing`, :func:`~fededge.clients.device.processes_that_fit`)."""
    import heapq

    from fededge.models.zoo import build_model
    from fededge.workload import dataset_for

    # A device this machine lacks is refused here, by name, before anything starts.
    set_cuda_determinism(_device.resolve_device(device), cfg.deterministic)
    examples: dict[str | None, int] = {}  # data dir -> bytes of one training example
    sizes = []
    for pid, num_partitions, data_dir in nodes:
        if data_dir not in examples:
            split_ds = dataset_for(cfg, data_dir)
            examples[data_dir] = (split_ds.x_train[0].numel() * split_ds.x_train.element_size()
                                  + split_ds.y_train.element_size())
        sizes.append(examples[data_dir] * len(partition_indices(cfg, num_partitions, data_dir)[pid]))
    data = sum(heapq.nlargest(CLIENT_TENSORS_CACHED, sizes))
    ds = dataset_for(cfg, next(iter(examples), None))  # a node's own data dir where it has one
    fp = _device.measure_cuda_footprint(
        lambda: build_model(cfg.model, input_shape=ds.input_shape, num_classes=ds.num_classes, seed=0),
        tuple(ds.input_shape), ds.num_classes, cfg.batch_size, device)
    return _device.processes_that_fit(asked, fp, data_bytes=data, server_on_gpu=cfg.server_device != "cpu",
                                      sharing=runs_sharing())


def run_inprocess(
    overrides: Mapping[str, Any] | None = None,
    *,
    num_clients: int = 10,
    server_app: ServerApp | None = None,
    client_app: ClientApp | str | None = None,
    node_configs: Sequence[Mapping[str, Any]] | None = None,
    run_id: int = 1,
    keep_client_states: bool = True,
    workers: int | Literal["auto"] = 1,
    client_states: str | None = None,
    states_dir: str | None = None,
    client_device: str | None = None,
    direct: bool | None = None,
) -> Path | None:
    """Run fededge's ServerApp and ClientApp (or the given ones) in this process.

    ``overrides`` are run-config keys, as ``flwr run --run-config`` takes them; the rest
    are the defaults (the same as pyproject.toml's). Returns the run directory when the
    ServerApp is fededge's. ``keep_client_states=False`` leaves the nodes' states out of
    the checkpoints, as under Ray or on a SuperLink: the nodes then keep them on disk
    (:mod:`fededge.clients.statestore`).

    ``workers`` runs the clients on that many processes (this one included; results do
    not change with it); ``"auto"`` (``fededge run``'s default) picks by
    :func:`auto_workers`: every usable core, up to a round's clients. ``client_states``
    (default: the run config's ``client-states``, ``"auto"``: memory up to
    ``client-states-memory-mb``, then disk) set to ``"disk"`` keeps idle clients' states
    on disk (in ``states_dir``, default ``$TMPDIR``), so that memory follows the clients
    per round: :class:`~fededge.server.grid.InProcessGrid` says how. With ``workers > 1``
    a ``client_app`` other than fededge's is given as ``"module:attribute"``. The run's
    first line says which were used and why (``InProcessGrid.runtime_note``), and
    config.json keeps it (``inprocess_runtime``, ``inprocess_workers``,
    ``inprocess_client_device``). ``client_device`` gives fededge's clients the device
    ``device=auto`` chose before (``fededge resume`` passes the run's own), untimed.

    ``direct`` (default: fededge's own ClientApp in one process) hands messages and
    replies over as copies instead of serialising and rebuilding them, their bytes on
    the wire computed from Flower's format: the same bytes counted and the same results
    (``InProcessGrid``'s ``direct``). ``direct=False`` serialises every message, as
    before; a ClientApp of one's own is always serialised (what Flower cannot serialise
    then fails here, not first on a SuperLink).

    Examples
    --------
    >>> run_dir = run_inprocess({"num-rounds": 5, "alpha": 0.1}, num_clients=10)
    """
    # fededge's ClientApp, imported here: the server side imports no client code at module level.
    from fededge.clients.app import app as default_client

    cfg = RunConfig.from_mapping(dict(overrides or {}))  # fail early, naming the key
    runs_sharing()  # and a bad FEDEDGE_RUNS_SHARING, naming it
    check_clients_available(cfg, num_clients)
    # fededge's own clients train where device=auto measured them fastest (a ClientApp of
    # one's own picks its own device).
    if client_app is not None:
        choice = None
    elif client_device is not None and cfg.device == "auto":
        choice = DeviceChoice(client_device, "auto: the run's own choice")
    else:
        choice = client_device_choice(cfg, num_clients, workers)
    if workers == "auto":
        workers, why = auto_workers(cfg, num_clients, by_reference=client_app is None or isinstance(client_app, str),
                                    cuda=None if choice is None else choice.device.startswith("cuda"))
        why = f"auto: {why}"
    elif isinstance(workers, bool) or not isinstance(workers, int):
        raise ValueError(f"workers must be an int >= 1 or 'auto', got {workers!r}")
    else:
        why = "as given"
    if direct and client_app is not None:
        raise ValueError("direct delivery is for fededge's own ClientApp: a ClientApp of one's own is serialised, "
                         "so that what Flower cannot send fails here too")
    run_config = cfg.to_mapping()
    states = client_states or cfg.client_states
    per_round = _per_round(cfg, num_clients)

    def make_grid(workers: int) -> InProcessGrid:
        return InProcessGrid(
            client_app or default_client, num_nodes=num_clients, run_config=run_config,
            run_id=run_id, node_configs=node_configs, seed=cfg.seed, keep_client_states=keep_client_states,
            client_states=states, states_dir=states_dir, states_budget_mb=cfg.client_states_memory_mb,
            states_round_clients=per_round,
            workers=workers, client_app_ref=None if client_app is not None else DEFAULT_CLIENT_APP,
            cohort=cfg.cohort and client_app is None,  # a ClientApp of one's own keeps its own path
            client_device=choice.device if choice is not None and cfg.device == "auto" else None,
            direct=(workers == 1 and client_app is None) if direct is None else direct,
        )

    grid = make_grid(workers)
    if choice is not None and choice.device.startswith("cuda") and workers > 1:
        # Several processes on one GPU: as many as its free memory holds (issue 35, item 4).
        nodes = ((int(c[keys.PARTITION_ID]), int(c[keys.NUM_PARTITIONS]), str(c.get(keys.DATA_DIR, "")) or None)
                 for c in map(grid.node_config, grid.get_node_ids()))
        try:
            fit, note = gpu_workers(cfg, workers, choice.device, nodes)
        except BaseException:
            with contextlib.suppress(Exception):  # the sizing's error is the one to see
                grid.close()
            raise
        why = f"{why}; {note}"
        if fit < workers:
            grid.close()
            workers = fit
            grid = make_grid(workers)
    direct = grid.direct
    grid.runtime_note = (
        (f"clients on {choice.device} ({choice.reason}); " if choice is not None else "")
        + f"{workers} process{'es' if workers > 1 else ''} ({why}); client states "
        + (f"in memory up to {cfg.client_states_memory_mb:g} MiB or {per_round} client"
           f"{'s' if per_round != 1 else ''}' states (a round's, at most {_round_share_mb(grid, cfg):g} MiB), "
           "then on disk" if states == "auto" else
           "on disk" if states == "disk" else "in memory")
        + ("; messages handed over directly, their bytes counted from the format" if direct else ""))
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
