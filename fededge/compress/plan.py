"""Which codec each tensor of a model update goes with: the per-tensor plan.

A model's state dict holds more than trained weights. What the compression papers and
torch's PowerSGD hook do, and what fededge does by default:

- **Normalisation statistics** (BatchNorm's and InstanceNorm's ``running_mean`` and
  ``running_var``) are not gradients: they are averages of activations, and a lossy codec
  has no notion of what they are (a sign or a rank-2 factor of a variance is meaningless).
  They always go ``raw`` (float32, lossless), never through the compressor or the
  small-tensor cast. Their integer counter ``num_batches_tracked`` goes as it is.
  Under ``norm-stats = global`` neither is sent (codec ``server``): the server
  recalibrates its model's statistics itself
  (:class:`fededge.strategies.normstats.NormCalibrated`) and keeps its own counters
  (torch reads a counter only in a BatchNorm without momentum, to average its running
  statistics, which the server replaces). Each counter cost a Flower array of its own,
  about 124 bytes for 8 (2.5 kB a reply on a ResNet-18).
- **1-D tensors** (biases, normalisation scales and shifts) go with the small-tensor
  codec by default, as in torch's PowerSGD hook: they are a small share of the bytes and
  a large share of what a biased codec gets wrong. ``compress-1d = true`` sends them
  through the compressor (PowerSGD cannot: it needs two dimensions).
- **Tensors under** ``compress-min-numel`` elements go with the small-tensor codec.
- **Everything else** goes with the compressor (DGC sends ``topk`` payloads).

Roles, in the order they are decided:

========== ==================================================== =========================
role       which tensors                                        codec
========== ==================================================== =========================
integer    not floating point, or ``num_batches_tracked``       none: sent as it is (a
                                                                counter: ``server`` under
                                                                ``global``)
statistic  last name component ``running_mean``/``running_var``  ``raw`` (``server``: none)
small      fewer than ``min_numel`` elements                     ``small_codec``
vector     one dimension, ``compress_1d`` off (or PowerSGD)      ``small_codec``
matrix     the rest                                              the compressor's
========== ==================================================== =========================

The rule reads only a tensor's name, shape and dtype, so a client (from its reply) and
the server (from the model it sent) derive the same plan from the same config; the
server refuses a payload whose codec is not its plan's for that tensor, naming both
(:meth:`UpdatePlan.check`). The plan adds nothing to the wire: every payload already
names its codec in its header, and those headers are counted in the bytes.

Pure: no Flower.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from fededge.compress.roles import (
    COUNTERS, ROLES, SERVER, STATISTICS, PlanMismatchError, is_counter, is_statistic, role_codec, tensor_role,
)
from fededge.compress.update import UpdateConfig, UpdateEncoder

__all__ = ["COUNTERS", "ROLES", "STATISTICS", "PlanEntry", "PlanMismatchError", "UpdatePlan", "is_counter", "is_statistic",
           "tensor_role"]

@dataclass(frozen=True)
class PlanEntry:
    """One tensor of the plan: its name, shape, role, wire codec (None: sent as it is)
    and payload bytes per round (header included, without the lossless stage; DGC at its
    final sparsity). The bytes are exact for every fixed-size codec; for the sparse ones
    (topk, randk, dgc: entropy-coded index sets) and threshold (a data-dependent count)
    they are those of a random update of that shape, an estimate."""

    name: str
    shape: tuple[int, ...]
    role: str
    codec: str | None
    bytes: int

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "shape": list(self.shape), "role": self.role,
                "codec": self.codec or "as-is", "bytes": self.bytes}


def _shape_dtype(value: Any) -> tuple[tuple[int, ...], bool, int]:
    if isinstance(value, torch.Tensor):
        return tuple(int(s) for s in value.shape), value.is_floating_point(), value.element_size()
    arr = np.asarray(value)
    return tuple(int(s) for s in arr.shape), np.issubdtype(arr.dtype, np.floating), arr.dtype.itemsize


@dataclass(frozen=True)
class UpdatePlan:
    """The per-tensor plan of a model update under one :class:`UpdateConfig`.

    Build it with :meth:`build` from anything that maps names to tensors or arrays (a
    state dict, the model a server sends). ``compressor="none"`` gives an empty plan.

    Examples
    --------
    >>> from fededge.compress.update import UpdateConfig
    >>> sd = {"conv.weight": torch.zeros(16, 3, 3, 3), "bn.weight": torch.zeros(16),
    ...       "bn.running_var": torch.zeros(16), "bn.num_batches_tracked": torch.zeros((), dtype=torch.long),
    ...       "fc.weight": torch.zeros(10, 400)}
    >>> plan = UpdatePlan.build(UpdateConfig(compressor="powersgd", min_numel=0), sd)
    >>> [(e.name, e.role, e.codec) for e in plan.entries]  # doctest: +NORMALIZE_WHITESPACE
    [('conv.weight', 'matrix', 'powersgd'), ('bn.weight', 'vector', 'raw'),
     ('bn.running_var', 'statistic', 'raw'), ('bn.num_batches_tracked', 'integer', None),
     ('fc.weight', 'matrix', 'powersgd')]
    """

    compressor: str
    entries: tuple[PlanEntry, ...]
    #: server rounds 1 to this go uncompressed (``compress-warmup-rounds``)
    warmup_rounds: int = 0

    @classmethod
    def build(cls, config: UpdateConfig, tensors: Mapping[str, Any], *, with_bytes: bool = True) -> UpdatePlan:
        """The plan of ``tensors`` (names -> tensors or arrays; only shapes and dtypes are
        read). ``with_bytes`` encodes one random tensor of each shape with a fresh encoder
        to count its payload (see :class:`PlanEntry` for when that is exact)."""
        if config.compressor == "none":
            return cls("none", ())
        entries = []
        for name, value in tensors.items():
            shape, floating, itemsize = _shape_dtype(value)
            role = tensor_role(name, shape, floating, config)
            codec = role_codec(role, config, name)
            nbytes = int(np.prod(shape)) * itemsize if role == "integer" and codec is None else 0
            entries.append(PlanEntry(name, shape, role, codec, nbytes))
        plan = cls(config.compressor, tuple(entries), config.warmup_rounds)
        return plan._with_bytes(config) if with_bytes else plan

    def _with_bytes(self, config: UpdateConfig) -> UpdatePlan:
        import dataclasses

        encoder = UpdateEncoder(dataclasses.replace(config, lossless=False), stream=0)
        g = torch.Generator().manual_seed(0)
        floats = {e.name: torch.randn(e.shape, generator=g) for e in self.entries if e.role != "integer"}
        # DGC's warm-up lowers its sparsity in the first rounds: count the steady state.
        steady = config.dgc_warmup_rounds + 1 if config.compressor == "dgc" else 0
        payloads = encoder.encode(floats, round=steady)
        return UpdatePlan(self.compressor, tuple(
            e if e.role == "integer" or e.codec == SERVER
            else PlanEntry(e.name, e.shape, e.role, e.codec, len(payloads[e.name]))
            for e in self.entries), self.warmup_rounds)

    # ------------------------------------------------------------------ reading

    def codec_of(self, name: str) -> str | None:
        for e in self.entries:
            if e.name == name:
                return e.codec
        raise KeyError(f"tensor {name!r} is not in the update plan")

    @property
    def payload_bytes(self) -> int:
        """Bytes per round of one client's update, payloads and as-is tensors."""
        return sum(e.bytes for e in self.entries)

    @property
    def dense_bytes(self) -> int:
        """The same update in float32 (integers as they are; a counter the server keeps,
        not sent under ``norm-stats=global``, as torch's int64)."""
        # a counter the server sets (norm-stats=global) counts as torch's int64
        return sum((e.bytes if e.codec is None else 8 * int(np.prod(e.shape))) if e.role == "integer"
                   else 4 * int(np.prod(e.shape)) for e in self.entries)

    def as_json(self) -> list[dict[str, Any]]:
        """One dict per tensor, for ``config.json``."""
        return [e.as_dict() for e in self.entries]

    def check(self, codecs: Mapping[str, str]) -> None:
        """Refuse payloads (tensor name -> codec named in its header) that do not follow
        the plan: a tensor in another codec, one the plan sends as it is, or one it lacks.

        Raises
        ------
        PlanMismatchError
            Naming the tensor, the codec received and the codec the plan gives it.
        """
        planned = {e.name: e for e in self.entries}
        for name, codec in codecs.items():
            entry = planned.get(name)
            if entry is None:
                raise PlanMismatchError(f"tensor {name!r} is not in this server's update plan "
                                        f"(model tensors: {len(planned)})")
            if entry.codec != codec:
                if entry.codec == SERVER:
                    want = ("no payload (norm-stats=global: the server keeps its own)" if entry.role == "integer"
                            else "no payload (norm-stats=global: the server recalibrates it)")
                elif entry.codec:
                    want = f"codec {entry.codec!r}"
                else:
                    want = "no codec (sent as it is)"
                raise PlanMismatchError(
                    f"tensor {name!r} ({entry.role}, shape {list(entry.shape)}) came in codec {codec!r}; this "
                    f"server's plan gives it {want}")

    def summary(self) -> list[str]:
        """Lines for the log: one per (role, codec) with tensors, elements and bytes, then
        the total against float32."""
        groups: Counter[tuple[str, str]] = Counter()
        elems: Counter[tuple[str, str]] = Counter()
        nbytes: Counter[tuple[str, str]] = Counter()
        for e in self.entries:
            key = (e.role, e.codec or "as-is")
            groups[key] += 1
            elems[key] += int(np.prod(e.shape))
            nbytes[key] += e.bytes
        lines = [f"update plan ({self.compressor}): role, codec, tensors, elements, bytes per round"]
        for role in ROLES:
            for key in sorted(k for k in groups if k[0] == role):
                lines.append(f"  {role:<9} {key[1]:<9} {groups[key]:>4} {elems[key]:>11,} {nbytes[key]:>11,}")
        ratio = self.dense_bytes / self.payload_bytes if self.payload_bytes else float("nan")
        lines.append(f"  total {self.payload_bytes:,} bytes per update against {self.dense_bytes:,} in float32 "
                     f"({ratio:.1f}x)")
        if self.warmup_rounds:
            lines.append(f"  rounds 1 to {self.warmup_rounds} uncompressed (compress-warmup-rounds), the plan from "
                         f"round {self.warmup_rounds + 1}")
        return lines

    def log(self, logger: logging.Logger, level: int = logging.INFO) -> None:
        for line in self.summary():
            logger.log(level, "%s", line)
