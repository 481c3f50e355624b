"""Pick the torch device a client (or the server's evaluation) runs on."""

from __future__ import annotations

import os

import torch

__all__ = ["resolve_device", "set_cuda_determinism"]

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
    torch.use_deterministic_algorithms(deterministic, warn_only=True)
