"""Pick the torch device a client (or the server's evaluation) runs on.

:func:`resolve_device` turns the run config's ``device`` into a device, ``auto`` taking
CUDA where it is. :func:`choose_by_measurement` is ``device=auto`` in fededge's
in-process runtime (issue 35): it times the run's own training step on the CPU and on
CUDA and keeps the faster, so a tiny model whose steps are all launch overhead on a GPU
stays on the CPU's cores. :func:`measure_cuda_footprint` and :func:`processes_that_fit`
size the worker processes that share one GPU by its free memory (issue 35, item 4).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

__all__ = ["CudaFootprint", "DeviceChoice", "choose_by_measurement", "measure_cuda_footprint", "processes_that_fit",
           "resolve_device", "set_cuda_determinism", "time_sgd_step"]

# cuBLAS picks reduction splits per call unless its workspace is fixed; torch refuses
# deterministic matmuls on CUDA >= 10.2 without one of these two settings.
_CUBLAS_WORKSPACE = ":4096:8"


def resolve_device(spec: str = "auto") -> torch.device:
    """Turn the run config's ``device`` into a :class:`torch.device`.

    ``auto`` takes CUDA when ``torch.cuda.is_available()``, else the CPU. ``cuda`` or
    ``cuda:N`` asked for on a machine without CUDA is an error, not a silent fallback:
    a GPU experiment that quietly ran on the CPU would report wrong timings.

    In Flower's simulation, give GPU clients a share of a GPU with
    ``--federation-config "client-resources-num-gpus=0.25"`` (four clients per GPU);
    Ray then sets ``CUDA_VISIBLE_DEVICES`` for each actor and ``auto`` finds it.
    """
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if spec == "cpu":
        return torch.device("cpu")
    if spec.startswith("cuda"):
        if not torch.cuda.is_available():
            raise RuntimeError(
                f"device={spec!r} was asked for but torch.cuda.is_available() is False "
                f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'no'}). "
                "Use device=auto or device=cpu, or install a CUDA build of torch."
            )
        dev = torch.device(spec)
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise RuntimeError(
                f"device={spec!r}: only {torch.cuda.device_count()} CUDA device(s) visible"
            )
        return dev
    raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {spec!r}")


def set_cuda_determinism(device: torch.device, deterministic: bool = True) -> None:
    """Make training on ``device`` repeatable (or fast), as run-config ``deterministic`` says.

    On the CPU this does nothing: torch's CPU kernels give the same bits for the same
    inputs and thread count. On CUDA, cuDNN's autotuner (``benchmark``) and its
    non-deterministic convolution algorithms, and kernels that accumulate with atomics
    (``index_add``, ``scatter_add``, some backward passes), make two runs of one config
    and seed differ in the last bits, and a few rounds of SGD grow that into different
    accuracies. ``deterministic=True`` (the default) turns cuDNN's deterministic
    algorithms on and its autotuner off, asks torch for deterministic kernels (an op
    without one warns rather than fails), and fixes cuBLAS's workspace. Repeatability
    holds on one GPU model and software stack, not across them.

    ``deterministic=False`` turns cuDNN's autotuner on instead: faster convolutions for
    fixed input shapes, and runs that differ in the last bits.
    """
    if device.type != "cuda":
        return
    torch.backends.cudnn.deterministic = deterministic
    torch.backends.cudnn.benchmark = not deterministic
    if deterministic:
        # Read by cuBLAS when its handle is created: set before the first matmul.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", _CUBLAS_WORKSPACE)
    _deterministic_kernels(deterministic, warn_only=True)


def _deterministic_kernels(mode: bool, *, warn_only: bool = False) -> None:
    """``torch.use_deterministic_algorithms(mode, warn_only=warn_only)`` without its
    import of ``torch._inductor`` (and ``torch._dynamo``: 2.3 s on this 2-core CPU, about
    8 s in a GPU machine's profile), which it makes only to set inductor's own
    ``deterministic`` flag, read by ``torch.compile``'d code alone. That flag is still
    set: on inductor's config where it is already imported, else through the
    environment variable inductor reads when it is (``TORCHINDUCTOR_DETERMINISTIC``).
    Torch's public call where the private one is gone."""
    import sys

    setter = getattr(torch._C, "_set_deterministic_algorithms", None)
    if setter is None:
        torch.use_deterministic_algorithms(mode, warn_only=warn_only)
        return
    inductor = sys.modules.get("torch._inductor.config")
    if inductor is not None:
        inductor.deterministic = mode
    else:  # what inductor's config reads when it is imported: the flag torch would have set
        os.environ["TORCHINDUCTOR_DETERMINISTIC"] = "1" if mode else "0"
    setter(mode, warn_only=warn_only)


def time_sgd_step(model_fn: Callable[[], nn.Module], input_shape: tuple[int, ...], num_classes: int, batch: int,
                  device: str, *, threads: int = 1, steps: int = 5, give_up_above_s: float | None = None) -> float:
    """The median seconds of one SGD step (forward, cross-entropy, backward, update) of
    ``model_fn()`` on ``device``, on random data of ``batch`` examples, with ``threads``
    torch threads on the CPU. One untimed step first (kernels, autograd, cuDNN's choice);
    CUDA is synchronised around each step. A step slower than ``give_up_above_s`` ends
    the timing there (the other device is already faster): its time is returned."""
    before = torch.get_num_threads()
    if device == "cpu":
        torch.set_num_threads(max(1, threads))
    try:
        model = model_fn().to(device)
        g = torch.Generator().manual_seed(0)
        x = torch.randn((batch, *input_shape), generator=g).to(device)
        y = torch.randint(0, num_classes, (batch,), generator=g).to(device)
        params = [p for p in model.parameters() if p.requires_grad]
        cuda = device.startswith("cuda")

        def step() -> float:
            if cuda:
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            loss = nn.functional.cross_entropy(model(x), y)
            grads = torch.autograd.grad(loss, params)
            with torch.no_grad():
                torch._foreach_add_(params, grads, alpha=-1e-3)
            if cuda:
                torch.cuda.synchronize(device)
            return time.perf_counter() - t0

        first = step()  # untimed: the first step pays for kernels and autograd
        if give_up_above_s is not None and first > 10 * give_up_above_s:
            return first
        times = []
        for _ in range(steps):
            times.append(step())
            if give_up_above_s is not None and times[-1] > give_up_above_s:
                return times[-1]
        return statistics.median(times)
    finally:
        torch.set_num_threads(before)


@dataclass(frozen=True)
class DeviceChoice:
    """What ``device=auto`` picked for the clients, and the timings it picked by."""

    device: str
    reason: str
    #: device -> seconds a client's step costs there, counting the processes that share the work
    per_client_step_s: dict[str, float] = field(default_factory=dict)


def choose_by_measurement(model_fn: Callable[[], nn.Module], input_shape: tuple[int, ...], num_classes: int,
                          batch: int, *, cpu_processes: int, cpu_threads: int = 1, cohort_clients: int = 1,
                          cuda: bool | None = None, timer: Callable[..., float] = time_sgd_step) -> DeviceChoice:
    """``device=auto`` by measurement: the clients train where a client's step costs least.

    On the CPU, ``cpu_processes`` processes train clients side by side with
    ``cpu_threads`` threads each, so a client's step costs the step's time over the
    processes; on CUDA the clients of this process take turns on one GPU. With a cohort
    (``cohort_clients`` > 1: one batched program of that many clients), CUDA is timed on
    the cohort's whole batch (``batch * cohort_clients`` examples: the arithmetic of the
    vmapped clients, whose cost a GPU does not scale linearly) and the time shared by its
    clients; the CPU, whose cost does scale with the examples, is timed on one client's
    batch (so a ResNet's timing stays one client's step). Without CUDA nothing is timed.
    The CPU is timed second and gives up as soon as one of its steps is plainly slower
    than CUDA's (so a ResNet costs a second or two, once).
    """
    if cuda is None:
        cuda = torch.cuda.is_available()
    if not cuda:
        return DeviceChoice("cpu", "no CUDA device")
    share = max(1, cohort_clients)
    gpu = timer(model_fn, input_shape, num_classes, batch * share, "cuda") / share
    cpu_step = timer(model_fn, input_shape, num_classes, batch, "cpu", threads=cpu_threads,
                     give_up_above_s=gpu * max(1, cpu_processes) * 2)
    cpu = cpu_step / max(1, cpu_processes)
    pick = "cpu" if cpu < gpu else "cuda"
    what = (f"a cohort of {cohort_clients} clients x {batch} examples" if cohort_clients > 1
            else f"one client's step of {batch} examples")
    reason = (f"timed {what}: {gpu * 1e3:.3g} ms a client on cuda, {cpu * 1e3:.3g} ms on cpu "
              f"({max(1, cpu_processes)} process{'es' if cpu_processes > 1 else ''} x {cpu_threads} "
              f"thread{'s' if cpu_threads > 1 else ''})")
    return DeviceChoice(pick, reason, {"cuda": gpu, "cpu": cpu})


#: What a CUDA context of another process is taken to cost where this process's own cannot
#: be read apart from other processes' memory: at least this (torch with lazy module
#: loading, cuBLAS and cuDNN's handles) ...
CONTEXT_MIN_BYTES = 256 * 2**20
#: ... and at most this: more used on the GPU than this process's allocator holds is
#: other processes' memory too (already missing from the free memory), which the bound
#: keeps from being charged again to every process in full.
CONTEXT_MAX_BYTES = 2 * 2**30
#: The share of the GPU's memory kept free when sizing the processes: the caching
#: allocator's fragmentation, cuDNN's workspaces, the evaluation's batches.
GPU_MARGIN = 0.10


@dataclass(frozen=True)
class CudaFootprint:
    """What one process training the run's clients on a GPU holds there, in bytes, and
    the GPU's memory when it was measured."""

    #: a CUDA context (this process's, as far as it can be told from other processes')
    context: int
    #: one training step: the model, its gradients and momentum, the activations at the
    #: run's batch size, as the caching allocator reserves them
    step: int
    #: the model's state dict (a received model and a reply are copies of it)
    model: int
    free: int
    total: int


def measure_cuda_footprint(model_fn: Callable[[], nn.Module], input_shape: tuple[int, ...], num_classes: int,
                           batch: int, device: str = "cuda") -> CudaFootprint:
    """Measure :class:`CudaFootprint` on ``device``: one SGD step with momentum of
    ``model_fn()`` on ``batch`` random examples, between ``torch.cuda``'s peak-memory
    counters (the allocator's reserved bytes, which a process keeps), then the device's
    free memory with that step's memory given back."""
    dev = torch.device(device)
    torch.cuda.synchronize(dev)
    torch.cuda.empty_cache()
    base = torch.cuda.memory_reserved(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    model = model_fn().to(dev)
    model_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    g = torch.Generator().manual_seed(0)
    x = torch.randn((batch, *input_shape), generator=g).to(dev)
    y = torch.randint(0, num_classes, (batch,), generator=g).to(dev)
    params = [p for p in model.parameters() if p.requires_grad]
    momentum = [torch.zeros_like(p) for p in params]
    loss = nn.functional.cross_entropy(model(x), y)
    grads = torch.autograd.grad(loss, params)
    with torch.no_grad():
        torch._foreach_mul_(momentum, 0.9)
        torch._foreach_add_(momentum, grads)
        torch._foreach_add_(params, momentum, alpha=-1e-3)
    torch.cuda.synchronize(dev)
    step = max(0, torch.cuda.max_memory_reserved(dev) - base)
    del model, x, y, params, momentum, loss, grads
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(dev)
    own = (total - free) - torch.cuda.memory_reserved(dev)
    context = min(CONTEXT_MAX_BYTES, max(CONTEXT_MIN_BYTES, own))
    return CudaFootprint(context=context, step=step, model=model_bytes, free=free, total=total)


def processes_that_fit(asked: int, fp: CudaFootprint, *, data_bytes: int = 0, server_on_gpu: bool = False,
                       margin: float = GPU_MARGIN, sharing: int = 1) -> tuple[int, str]:
    """How many of ``asked`` processes (this one included) can train clients on one GPU
    at once, by its free memory, and why, in a few words.

    This process already has its context (the free memory is measured after it). Each
    process holds a training step's memory (``fp.step``), the clients' data it caches
    (``data_bytes``) and a received model and a reply (2 x ``fp.model``); each other
    process also its own CUDA context. The server's model, its average's accumulator and
    scratch buffer (3 x ``fp.model``) are here where ``server_on_gpu``. ``margin`` of the
    GPU's memory stays free. Where ``sharing`` runs share the machine (a sweep's,
    :func:`~fededge.machine.runs_sharing`), this run takes at most its share of the rest,
    whatever is free when it starts (the others may not have started yet). At least one:
    this process trains its clients in any case.

    Examples
    --------
    >>> fp = CudaFootprint(context=500, step=1000, model=100, free=10_000, total=10_000)
    >>> processes_that_fit(8, fp, margin=0.1)  # (9000 - 1200) // (500 + 1200) = 4 more
    (5, '5 of 8 fit in the GPU (10000 B free, 1700 B a process)')
    >>> processes_that_fit(3, fp, margin=0.1)
    (3, '3 fit in the GPU (10000 B free, 1700 B a process)')
    >>> processes_that_fit(8, fp, margin=0.1, sharing=2)  # (4500 - 1200) // 1700 = 1 more
    (2, '2 of 8 fit in the GPU (10000 B free, its share 4500 B of 2 runs, 1700 B a process)')
    """
    if asked < 1:
        raise ValueError(f"asked must be >= 1, got {asked}")
    if sharing < 1:
        raise ValueError(f"sharing must be >= 1, got {sharing}")
    own = fp.step + data_bytes + 2 * fp.model
    here = own + (3 * fp.model if server_on_gpu else 0)
    other = fp.context + own
    usable, share = fp.free - margin * fp.total, ""
    if sharing > 1 and (1 - margin) * fp.total / sharing < usable:
        usable = (1 - margin) * fp.total / sharing
        share = f", its share {_size(int(usable))} of {sharing} runs"
    room = usable - here
    n = max(1, min(asked, 1 + int(room // other) if room > 0 else 1))
    fits = f"{n} fit" if n == asked else f"{n} of {asked} fit"
    return n, f"{fits} in the GPU ({_size(fp.free)} free{share}, {_size(other)} a process)"


def _size(n: float) -> str:
    """Bytes in GiB (one decimal), MiB (whole) or bytes: ``_size(1000 * 2**20)`` is '1000 MiB'."""
    if n >= 2**30:
        return f"{n / 2**30:.1f} GiB"
    return f"{n / 2**20:.0f} MiB" if n >= 2**20 else f"{int(n)} B"
