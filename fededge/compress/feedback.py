"""Error feedback: the residual memory that makes biased codecs converge.

Seide et al., 2014 ("quantization error feedback" in 1-bit SGD); Strom, 2015; Stich,
Cordonnier and Jaggi, 2018, "Sparsified SGD with Memory"; Karimireddy et al., 2019,
"Error Feedback Fixes SignSGD and other Gradient Compression Schemes".

Pure: no Flower.
"""

from __future__ import annotations

import torch

from fededge.compress.codec import Codec
from fededge.compress.wire import unpack

__all__ = ["ErrorFeedback"]


class ErrorFeedback:
    """Wrap any codec with a per-tensor residual: what was not sent is sent later.

    For tensor ``name``: corrected = x + e; payload = codec.encode(corrected);
    e = corrected - decode(payload). Nothing is lost: x + e_old == decode(payload) + e_new
    up to float32 rounding, so the sum of everything decoded over T rounds equals the sum
    of the inputs minus the final residual. The residual lives here (not in ``.grad``),
    as float32 CPU tensors, and round-trips through ``state_dict()`` so a Flower client
    can keep it in ``context.state``.

    Parameters
    ----------
    codec : Codec
        Any codec; error feedback matters for the biased ones (``codec.biased``): topk,
        onebit, signsgd, threshold, int8, fp16. Unbiased ones gain little.

    Examples
    --------
    >>> from fededge.compress import TopK
    >>> ef = ErrorFeedback(TopK(ratio=0.01))
    >>> payload = ef.encode("fc.weight", torch.randn(100, 10))
    >>> float(ef.residual["fc.weight"].abs().max()) > 0
    True
    """

    def __init__(self, codec: Codec) -> None:
        if not isinstance(codec, Codec):
            raise ValueError(f"ErrorFeedback wraps a Codec, got {type(codec).__name__}")
        self.codec = codec
        self.residual: dict[str, torch.Tensor] = {}

    def encode(self, name: str, x: torch.Tensor, *, generator: torch.Generator | None = None) -> bytes:
        """The payload of ``x + residual[name]``; updates the residual."""
        corrected = x.detach().to("cpu", torch.float32)
        e = self.residual.get(name)
        if e is not None:
            if e.shape != corrected.shape:
                raise ValueError(f"tensor {name!r} changed shape from {tuple(e.shape)} to "
                                 f"{tuple(corrected.shape)}; reset() the error feedback first")
            corrected = corrected + e
        # Encode the float32 sum but keep the caller's dtype in the header.
        payload = self.codec.encode(corrected.to(x.dtype) if x.dtype != torch.float32 else corrected,
                                    generator=generator)
        header, body = unpack(payload)
        decoded = type(self.codec).decode_body(header, body)
        self.residual[name] = corrected - decoded
        return payload

    def reset(self) -> None:
        self.residual.clear()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The residuals, by tensor name (float32, CPU)."""
        return {k: v.clone() for k, v in self.residual.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.residual = {k: torch.as_tensor(v, dtype=torch.float32).cpu().clone() for k, v in state.items()}
