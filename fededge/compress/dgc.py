"""Deep Gradient Compression for a client's per-round update.

Lin, Han, Mao, Wang and Dally, 2018, "Deep Gradient Compression: Reducing the
Communication Bandwidth for Distributed Training". Top-k sparsification plus

- momentum correction: accumulate the *velocity*, not the gradient, so that the sparse
  updates follow momentum SGD's trajectory: u = m u + delta; v = v + u;
- momentum factor masking: the velocity and accumulation of the sent coordinates are
  zeroed, so stale momentum does not push them again;
- local clipping: the update's L2 norm is clipped to ``clip_norm`` before it is
  accumulated (per tensor; the paper clips the gradient to N^(-1/2) times the global
  threshold for N workers, so pass that product as ``clip_norm``);
- sparsity warm-up: the density 1 - sparsity decays exponentially from
  1 - initial_sparsity to 1 - final_sparsity over ``warmup_rounds`` rounds.

In federated learning the unit is a round, and "delta" is the client's model update of
that round (the difference from the weights it received), not one minibatch gradient.
The payload is the top-k wire format, so any server decodes it with ``decode_any``.

Pure: no Flower.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fededge.compress._bits import flat32
from fededge.compress.codecs import keep_count, topk_payload

__all__ = ["DGCConfig", "DGCEncoder"]


@dataclass(frozen=True, kw_only=True)
class DGCConfig:
    """DGC knobs.

    Parameters
    ----------
    final_sparsity : float
        Fraction of elements *not* sent once warmed up, in [0, 1). 0.999 sends 0.1 %,
        the paper's, for per-step gradients; fededge's run default for model deltas over
        tens of rounds is 0.99 (``dgc-sparsity``, docs/compression.md).
    initial_sparsity : float, optional
        Sparsity of round 0, in [0, final_sparsity]. The paper uses 0.75, the default;
        for a ``final_sparsity`` below it, that (no warm-up to do).
    warmup_rounds : int
        Rounds over which the density decays exponentially to its final value; 0 starts
        at ``final_sparsity``. The paper warms up over the first epochs (a few rounds).
    momentum : float
        Momentum m in [0, 1) of the correction; use the optimizer's momentum (0.9) where
        each update is one step's gradient, as in the paper. On model deltas after local
        SGD with momentum (a federated round) use 0, fededge's run default
        (``dgc-momentum``): the deltas carry the momentum already, and a correction on top
        is momentum across rounds (3-42 points lost at 30 rounds, docs/compression.md).
        0 reduces DGC to top-k with error feedback, with DGC's warm-up and clipping.
    clip_norm : float or None
        Clip each tensor's update to this L2 norm before accumulating; None disables.
    lossless : bool
        Follow the payload with the zlib stage.
    """

    final_sparsity: float = 0.999
    initial_sparsity: float | None = None
    warmup_rounds: int = 4
    momentum: float = 0.9
    clip_norm: float | None = None
    lossless: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.final_sparsity < 1:
            raise ValueError(f"final_sparsity must be in [0, 1), got {self.final_sparsity!r}")
        if self.initial_sparsity is None:  # the paper's 0.75 (dgc-sparsity=0.5 was refused by it)
            object.__setattr__(self, "initial_sparsity", min(0.75, self.final_sparsity))
        if not 0 <= self.initial_sparsity <= self.final_sparsity:
            raise ValueError(f"initial_sparsity must be in [0, final_sparsity={self.final_sparsity}], "
                             f"got {self.initial_sparsity!r}")
        if not isinstance(self.warmup_rounds, int) or isinstance(self.warmup_rounds, bool) or self.warmup_rounds < 0:
            raise ValueError(f"warmup_rounds must be an integer >= 0, got {self.warmup_rounds!r}")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"momentum must be in [0, 1), got {self.momentum!r}")
        if self.clip_norm is not None and not (math.isfinite(self.clip_norm) and self.clip_norm > 0):
            raise ValueError(f"clip_norm must be a positive number or None, got {self.clip_norm!r}")
        if not isinstance(self.lossless, bool):
            raise ValueError(f"lossless must be True or False, got {self.lossless!r}")

    def sparsity_at(self, round: int) -> float:
        """Sparsity of round ``round`` (0-based): 1 - d0 (d_final / d0) ** min(round / W, 1)."""
        if round < 0:
            raise ValueError(f"round must be >= 0, got {round}")
        d0, d1 = 1 - self.initial_sparsity, 1 - self.final_sparsity
        t = 1.0 if self.warmup_rounds == 0 else min(round / self.warmup_rounds, 1.0)
        return 1 - d0 * (d1 / d0) ** t


class DGCEncoder:
    """Client-side DGC state (velocity u and accumulation v per tensor name) and encoder.

    Per call: delta <- clip(delta); u = m u + delta; v = v + u; send the top-k of v with
    k = max(1, ceil((1 - sparsity_at(round)) d)) (see ``keep_count``); u[sent] = 0; v[sent] = 0.

    Examples
    --------
    >>> enc = DGCEncoder(DGCConfig(final_sparsity=0.99, warmup_rounds=0))
    >>> payload = enc.encode("fc.weight", torch.randn(100, 100), round=0)
    >>> from fededge.compress import decode_any
    >>> int((decode_any(payload) != 0).sum())
    100
    """

    def __init__(self, config: DGCConfig | None = None) -> None:
        self.config = config if config is not None else DGCConfig()
        if not isinstance(self.config, DGCConfig):
            raise ValueError(f"DGCEncoder needs a DGCConfig, got {type(self.config).__name__}")
        self.u: dict[str, torch.Tensor] = {}
        self.v: dict[str, torch.Tensor] = {}

    def sparsity_at(self, round: int) -> float:
        return self.config.sparsity_at(round)

    def encode(self, name: str, delta: torch.Tensor, *, round: int) -> bytes:
        """The top-k payload of tensor ``name``'s accumulated velocity at ``round`` (0-based)."""
        cfg = self.config
        f = flat32(delta)
        if cfg.clip_norm is not None:
            norm = float(torch.linalg.vector_norm(f.double()))
            if norm > cfg.clip_norm:
                f = f * (cfg.clip_norm / norm)
        u = self.u.get(name)
        v = self.v.get(name)
        if u is None or v is None:
            u, v = torch.zeros_like(f), torch.zeros_like(f)
        elif u.shape != f.shape:
            raise ValueError(f"tensor {name!r} changed size from {u.numel()} to {f.numel()}; reset() first")
        u = cfg.momentum * u + f
        v = v + u
        d = f.numel()
        density = 1 - self.sparsity_at(round)
        k = keep_count(density, d)
        if not bool(torch.isfinite(v).all()):  # (state unchanged: u and v are new tensors)
            raise ValueError(f"cannot encode tensor {name!r}: its accumulated update overflows (NaN or Inf); "
                             "its payload would be refused at the server")
        idx = torch.topk(v.abs(), k, sorted=False).indices.sort().values
        payload = topk_payload(delta, v, idx, v[idx], float(density), cfg.lossless)
        u[idx] = 0
        v[idx] = 0
        self.u[name], self.v[name] = u, v
        return payload

    def reset(self) -> None:
        self.u.clear()
        self.v.clear()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Flat float32 CPU tensors: ``"u:NAME"`` (velocity) and ``"v:NAME"`` (accumulation)."""
        out = {f"u:{k}": t.clone() for k, t in self.u.items()}
        out.update({f"v:{k}": t.clone() for k, t in self.v.items()})
        return out

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        u, v = {}, {}
        for key, t in state.items():
            kind, _, name = key.partition(":")
            if kind not in ("u", "v"):
                raise ValueError(f"unknown DGC state key {key!r}; expected 'u:NAME' or 'v:NAME'")
            (u if kind == "u" else v)[name] = torch.as_tensor(t, dtype=torch.float32).cpu().reshape(-1).clone()
        self.u, self.v = u, v
