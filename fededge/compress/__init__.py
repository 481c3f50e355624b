"""fededge.compress: update codecs, error feedback, PowerSGD and DGC, and the wire format.

Pure torch: never imports Flower (see docs/architecture.md). docs/wire-format.md specifies
the payloads byte by byte.

Examples
--------
>>> import torch
>>> from fededge.compress import build_codec, decode_any, ErrorFeedback
>>> ef = ErrorFeedback(build_codec("topk", ratio=0.01))
>>> x = decode_any(ef.encode("fc.weight", torch.randn(64, 64)))
"""

from __future__ import annotations

import dataclasses
from typing import Any

from fededge.compress.codec import REGISTRY, Codec, CodecConfig, decode_any, register
from fededge.compress.codecs import (
    BF16, FP16, QSGD, Int8, Int8Config, OneBit, QSGDConfig, RandK, Raw, SignSGD,
    SparsifyConfig, TernGrad, Threshold, ThresholdConfig, TopK, decode_index_set, encode_index_set,
)
from fededge.compress.dgc import DGCConfig, DGCEncoder
from fededge.compress.feedback import ErrorFeedback
from fededge.compress.powersgd import PowerSGD, PowerSGDConfig, PowerSGDEncoder
from fededge.compress.wire import (
    CODEC_IDS, DTYPES, MAX_ELEMENTS, Header, MalformedPayloadError, decode_limit, pack, pack_bits,
    unpack, unpack_bits,
)

__all__ = [
    "CODECS", "build_codec",
    "Codec", "REGISTRY", "decode_any", "register",
    "CodecConfig", "Int8Config", "QSGDConfig", "ThresholdConfig", "SparsifyConfig", "PowerSGDConfig",
    "Raw", "FP16", "BF16", "Int8", "QSGD", "TernGrad", "OneBit", "SignSGD", "Threshold", "TopK",
    "RandK", "PowerSGD", "encode_index_set", "decode_index_set",
    "ErrorFeedback", "PowerSGDEncoder", "DGCConfig", "DGCEncoder",
    "CODEC_IDS", "DTYPES", "MAX_ELEMENTS", "Header", "MalformedPayloadError", "decode_limit",
    "pack", "unpack", "pack_bits", "unpack_bits",
]

#: Every codec name :func:`build_codec` and :func:`decode_any` know, in wire-id order.
CODECS: tuple[str, ...] = tuple(sorted(REGISTRY, key=CODEC_IDS.__getitem__))


def build_codec(name: str, **params: Any) -> Codec:
    """A codec by name, configured by keyword parameters of its config.

    Parameters
    ----------
    name : str
        One of :data:`CODECS`.
    **params
        Fields of the codec's config (for example ``levels`` for qsgd, ``ratio`` for
        topk and randk, ``block`` and ``stochastic`` for int8, ``tau`` for threshold,
        ``rank`` for powersgd) and ``lossless``.

    Examples
    --------
    >>> build_codec("qsgd", levels=16)
    QSGD(QSGDConfig(lossless=False, levels=16, bucket=512))
    """
    cls = REGISTRY.get(name)
    if cls is None:
        raise ValueError(f"unknown codec {name!r}; choose one of {', '.join(CODECS)}")
    fields = {f.name for f in dataclasses.fields(cls.Config)}
    unknown = sorted(set(params) - fields)
    if unknown:
        raise ValueError(f"unknown parameter(s) {unknown} for codec {name!r}; accepted: {sorted(fields)}")
    return cls(**params)
