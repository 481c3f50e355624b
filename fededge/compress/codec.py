"""The codec interface: a tensor in, a payload (bytes) out, and back.

A :class:`Codec` is stateless and configured by a frozen, validated config. ``encode``
uses only the ``torch.Generator`` it is given (seeded, local), never the global RNG.
``decode`` needs nothing but the payload: a server decodes any client's update without
keeping per-client state.

Stateful compression keeps its state outside the codec, in an object with
``state_dict()`` / ``load_state_dict()`` that fits in Flower's ``context.state``:
:class:`~fededge.compress.feedback.ErrorFeedback` (the residual of a biased codec), and
the PowerSGD and DGC encoders (their Q matrices, velocities and accumulators). Each is keyed by tensor
name, because one client compresses a whole model.

Pure: no Flower.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from fededge.compress.wire import Header, MalformedPayloadError, unpack

__all__ = ["Codec", "CodecConfig", "ConfiguredCodec", "all_finite", "decode_any", "register", "REGISTRY"]

REGISTRY: dict[str, type["Codec"]] = {}


def register(cls: type["Codec"]) -> type["Codec"]:
    """Class decorator: make ``cls`` decodable by :func:`decode_any` under ``cls.name``."""
    REGISTRY[cls.name] = cls
    return cls


class Codec(ABC):
    """Encode a float tensor into a wire payload; decode it back to float32.

    Subclasses set ``name`` (a key of ``fededge.compress.wire.CODEC_IDS``), ``biased``
    (True when E[decode(encode(x))] != x, so error feedback is advised), and implement
    :meth:`encode` and :meth:`decode_body`.
    """

    name: ClassVar[str]
    biased: ClassVar[bool]
    #: True when decode_body itself guarantees a finite result (it validated whatever it
    #: was built from), so the generic pass over the decoded tensor is skipped.
    output_finite_by_construction: ClassVar[bool] = False

    @abstractmethod
    def encode(self, x: torch.Tensor, *, generator: torch.Generator | None = None) -> bytes:
        """The payload of ``x`` (any float dtype, any device)."""

    @classmethod
    @abstractmethod
    def decode_body(cls, header: Header, body: bytes) -> torch.Tensor:
        """The float32 CPU tensor of ``header.shape`` that ``body`` encodes.

        Raise :class:`MalformedPayloadError` for a body or parameters that do not fit.
        """

    @classmethod
    def decode(cls, payload: bytes) -> torch.Tensor:
        header, body = unpack(payload)
        if header.codec != cls.name:
            raise MalformedPayloadError(f"payload is codec {header.codec!r}, not {cls.name!r}")
        return _checked(cls.decode_body(header, body), header, cls)


@dataclass(frozen=True, kw_only=True)
class CodecConfig:
    """Knobs every codec has.

    Parameters
    ----------
    lossless : bool
        Follow the codec with the zlib lossless stage (``Header.zlib``). Pays off for
        bodies with redundancy (sparse bitmaps, low-entropy levels), rarely for floats.
    """

    lossless: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.lossless, bool):
            raise ValueError(f"lossless must be True or False, got {self.lossless!r}")


class ConfiguredCodec(Codec):
    """A codec configured by ``Config``: built from a config object or from keyword arguments
    (which :func:`fededge.compress.build_codec` passes)."""

    Config: ClassVar[type[CodecConfig]] = CodecConfig

    def __init__(self, config: CodecConfig | None = None, /, **kwargs: Any) -> None:
        if config is None:
            config = self.Config(**kwargs)
        elif kwargs:
            raise ValueError("pass either a config object or keyword arguments, not both")
        elif not isinstance(config, self.Config):
            raise ValueError(f"{type(self).__name__} needs a {self.Config.__name__}, got {type(config).__name__}")
        self.config = config

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config!r})"


def decode_any(payload: bytes) -> torch.Tensor:
    """Decode a payload of any registered codec (the server's side)."""
    header, body = unpack(payload)
    cls = REGISTRY.get(header.codec)
    if cls is None:
        raise MalformedPayloadError(f"codec {header.codec!r} has no decoder in this build")
    return _checked(cls.decode_body(header, body), header, cls)


def _checked(t: torch.Tensor, header: Header, cls: type[Codec]) -> torch.Tensor:
    if tuple(t.shape) != header.shape:
        raise MalformedPayloadError(f"decoded shape {tuple(t.shape)} != header shape {header.shape}")
    if not cls.output_finite_by_construction and not all_finite(t):
        raise MalformedPayloadError(f"decoded {header.codec} tensor holds NaN or Inf")
    return t


def all_finite(t: torch.Tensor) -> bool:
    """True when no element is NaN or Inf, in one pass and without a boolean temporary.

    A float64 sum of float32 values cannot overflow (2**31 * 3.4e38 << 1.8e308), so it is
    finite exactly when every element is; NaN and Inf propagate into it.
    """
    return bool(torch.isfinite(t.sum(dtype=torch.float64)))
