"""Pick the torch device a client (or the server's evaluation) runs on."""

from __future__ import annotations

import torch

__all__ = ["resolve_device"]


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
