"""Compress a whole model update: one payload per tensor, with the encoders' state.

A client's update is the delta between the weights it trained and the weights it
received. :class:`UpdateEncoder` encodes each floating-point tensor of that delta with the
configured compressor, following the per-tensor plan of :mod:`fededge.compress.plan`:
normalisation statistics go ``raw``, tensors smaller than ``min_numel`` and 1-D tensors
(biases, norm scales; unless ``compress_1d``) go with a small-tensor codec (``raw`` or a
cast), as torch's PowerSGD hook and the compression papers do. All encoder state (error-feedback residuals, PowerSGD's Q, DGC's
velocity and accumulation) is in one ``state_dict()`` of tensors that fits in Flower's
``context.state``. :func:`decode_update` is the server's side: stateless.

Pure: no Flower.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from fededge.compress import (
    CODECS, DGCConfig, DGCEncoder, ErrorFeedback, PowerSGDConfig, PowerSGDEncoder, build_codec,
    decode_any, decode_limit,
)
from fededge.compress.codec import Codec
from fededge.compress.codecs import SPARSE_VALUES
from fededge.compress.roles import server_sets_statistics, tensor_role

__all__ = ["COMPRESSORS", "DOWNLINK", "UNBIASED", "DownlinkConfig", "UpdateConfig", "UpdateEncoder", "decode_update"]

#: ``none``, every codec name, and ``dgc`` (top-k with momentum correction and warm-up).
COMPRESSORS: tuple[str, ...] = ("none", *CODECS, "dgc")
#: Unbiased codecs: error feedback assumes a biased, contractive compressor and diverges
#: with these (random-k's d/k rescaling makes the residual grow without bound).
UNBIASED: tuple[str, ...] = ("qsgd", "terngrad", "randk")
_SMALL = ("raw", "fp16", "bf16")
#: What a client's normalisation statistics describe ([norm-stats]; :class:`UpdateConfig`).
NORM_STATS: tuple[str, ...] = ("decoded", "trained", "global")
#: What the server may cast the model it broadcasts to ([downlink-compressor];
#: :class:`~fededge.strategies.compressed.Compressed`'s and DGA's ``downlink``).
DOWNLINK: tuple[str, ...] = ("none", "fp16", "bf16")


@dataclass(frozen=True, kw_only=True)
class DownlinkConfig:
    """What the server does to the model it broadcasts. Declared here once for
    :class:`~fededge.strategies.compressed.Compressed`, :class:`~fededge.strategies.dga.DGA`
    and fededge's app.

    Parameters
    ----------
    downlink : str
        [downlink-compressor] ``none``, ``fp16`` or ``bf16``: a stateless cast of the
        broadcast model (delta-coded downlinks would need per-client state kept in step
        for clients that sat rounds out; not built). DGA with a cast needs compressed
        uplinks (its replies must be deltas, rebuilt on the exact global model).
    """

    downlink: str = "none"

    def __post_init__(self) -> None:
        if self.downlink not in DOWNLINK:
            raise ValueError(f"downlink must be one of {', '.join(DOWNLINK)}, got {self.downlink!r}")


@dataclass(frozen=True, kw_only=True)
class UpdateConfig:
    """How a client compresses its update. Run-config keys in brackets.

    Parameters
    ----------
    compressor : str
        [compressor] ``none``, a codec (``fp16``, ``bf16``, ``int8``, ``qsgd``,
        ``terngrad``, ``onebit``, ``signsgd``, ``threshold``, ``topk``, ``randk``,
        ``powersgd``, ``raw``) or ``dgc``.
    error_feedback : bool
        [error-feedback] Keep what a biased codec dropped and add it to the next
        update (Seide et al. 2014; Karimireddy et al. 2019). PowerSGD and DGC always
        accumulate their own error and ignore this knob.
    lossless : bool
        [lossless] zlib the body of every payload.
    qsgd_levels, qsgd_bucket, topk_ratio, topk_values, powersgd_rank, powersgd_iters, int8_block, threshold_tau : codec knobs
        [qsgd-levels, qsgd-bucket (elements per norm; 0 = one per tensor), topk-ratio and
        topk-values (top-k and random-k: the kept fraction, and the values' precision on the
        wire, fp32, fp16 or bf16), powersgd-rank, powersgd-iters (power iterations per
        round, at the same bytes; 2 by default, which halved the accuracy swings of the
        BatchNorm CNN against the paper's 1, BENCHMARKS.md issue 36), int8-block,
        threshold-tau].
    dgc_sparsity, dgc_warmup_rounds, dgc_warmup_epochs, dgc_momentum, dgc_clip_norm : DGC knobs
        [dgc-sparsity (final), dgc-warmup-rounds, dgc-warmup-epochs, dgc-momentum,
        dgc-clip-norm (0: none)]. The sparsity warm-up lasts the larger of
        ``dgc_warmup_rounds`` rounds and ``dgc_warmup_epochs`` epochs of the client's
        data (the paper's 4), where :class:`~fededge.clients.mods.CompressionMod` can tell
        a round's epochs (:meth:`dgc_warmup_for`): on a task whose round is a fraction of
        an epoch 4 rounds are too short (DGC 1.2 points under instead of 2.6 above on the
        30,000-image reduced ResNet), and where a round is several epochs one round is
        (the digits CNN swung 2.6x as far as uncompressed). 0 epochs: rounds only.
        dgc-momentum is 0 and dgc-sparsity 0.99 by default, not the paper's 0.9 and
        0.999: the updates are model deltas after local SGD, whose momentum is already in
        them (the correction on top is momentum across rounds), over tens of rounds, not
        thousands of steps. The paper's values cost 3-42 points at 30 rounds, these 0.2
        (mlp, cnn, cnn-bn on digits, three seeds: docs/compression.md). Use the paper's
        where each update is one step's gradient (one local step, local momentum 0).
    min_numel : int
        [compress-min-numel] Tensors with fewer elements go with ``small_codec``.
    compress_1d : bool
        [compress-1d] Send 1-D tensors of ``min_numel`` elements or more (biases,
        normalisation scales) through the compressor too. Off by default: they go with
        ``small_codec``, as in torch's PowerSGD hook. PowerSGD sends them with
        ``small_codec`` either way. Normalisation statistics (``running_mean``,
        ``running_var``) always go ``raw`` (:mod:`fededge.compress.plan`).
    small_codec : str
        [compress-small-codec] ``raw``, ``fp16`` or ``bf16``.
    warmup_rounds : int
        [compress-warmup-rounds] The first rounds (server rounds 1 to ``warmup_rounds``)
        go uncompressed: the clients reply with their weights as they are, and the
        encoder's state (error-feedback residuals, PowerSGD's Q, DGC's buffers) starts
        at the first compressed round, as torch's PowerSGD hook does before
        ``start_powerSGD_iter``. DGC's sparsity warm-up (``dgc_warmup_rounds``) counts
        from that round. 0 (default): every round compressed. The bytes of the
        uncompressed rounds are counted as they are.
    norm_stats : str
        [norm-stats] Which normalisation statistics a client sends (always ``raw``):
        ``decoded`` (default), those of the model the server will hold from it, the
        received model plus the update as it decodes, recomputed on a few local batches
        by the train function (:func:`fededge.clients.mods.offer_norm_statistics`;
        fededge's ClientApp does); ``trained``, those it trained with, which describe its
        local model and, under a lossy codec, a model the server never holds;
        ``global``, as trained, and the server replaces them after each round by the
        statistics of its own aggregated model, pooled from the round's clients (one more
        exchange per round: :class:`fededge.strategies.normstats.NormCalibrated`).
    seed : int
        Seeds stochastic codecs and PowerSGD's initial Q (with the client's stream).
    """

    compressor: str = "none"
    error_feedback: bool = False
    lossless: bool = False
    qsgd_levels: int = 16
    qsgd_bucket: int = 512
    topk_ratio: float = 0.01
    topk_values: str = "fp32"
    powersgd_rank: int = 2
    powersgd_iters: int = 2
    int8_block: int = 0
    threshold_tau: float = 1e-3
    dgc_sparsity: float = 0.99
    dgc_warmup_rounds: int = 4
    dgc_warmup_epochs: float = 4.0
    dgc_momentum: float = 0.0
    dgc_clip_norm: float = 0.0
    min_numel: int = 256
    compress_1d: bool = False
    small_codec: str = "raw"
    norm_stats: str = "decoded"
    warmup_rounds: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.compressor not in COMPRESSORS:
            raise ValueError(f"compressor must be one of {', '.join(COMPRESSORS)}; got {self.compressor!r}")
        if self.small_codec not in _SMALL:
            raise ValueError(f"small codec must be one of {', '.join(_SMALL)}; got {self.small_codec!r}")
        if self.min_numel < 0:
            raise ValueError(f"min_numel must be >= 0, got {self.min_numel}")
        if not isinstance(self.warmup_rounds, int) or isinstance(self.warmup_rounds, bool) or self.warmup_rounds < 0:
            raise ValueError(f"'compress-warmup-rounds': must be an integer >= 0, got {self.warmup_rounds!r}")
        if self.norm_stats not in NORM_STATS:
            raise ValueError(f"'norm-stats': must be one of {', '.join(NORM_STATS)}, got {self.norm_stats!r}")
        if self.error_feedback and self.compressor in UNBIASED:
            raise ValueError(
                f"'error-feedback': error feedback is for biased codecs (onebit, signsgd, "
                f"threshold, topk, int8, fp16, bf16); {self.compressor} is unbiased and needs none "
                "(with it the residual grows without bound); set error-feedback=false"
            )
        if self.topk_values not in SPARSE_VALUES:
            raise ValueError(f"'topk-values': must be one of {', '.join(SPARSE_VALUES)}, got {self.topk_values!r}")
        if self.dgc_clip_norm < 0:
            raise ValueError(f"dgc clip norm must be >= 0 (0 = no clipping), got {self.dgc_clip_norm}")
        if (not isinstance(self.dgc_warmup_epochs, (int, float)) or isinstance(self.dgc_warmup_epochs, bool)
                or not math.isfinite(self.dgc_warmup_epochs) or self.dgc_warmup_epochs < 0):
            raise ValueError(f"'dgc-warmup-epochs': must be a finite number >= 0 (0: dgc-warmup-rounds alone), "
                             f"got {self.dgc_warmup_epochs!r}")
        self.build_codec()  # validates the codec's own knobs now, not at the first round

    def compresses(self, server_round: int) -> bool:
        """Whether updates of ``server_round`` (1-based) are compressed: a compressor is
        set and the round is past the warm-up.

        >>> c = UpdateConfig(compressor="powersgd", warmup_rounds=2)
        >>> [c.compresses(r) for r in (1, 2, 3)]
        [False, False, True]
        """
        return self.compressor != "none" and server_round > self.warmup_rounds

    def dgc_warmup_for(self, examples: int | None, examples_per_round: int | None) -> int:
        """DGC's sparsity warm-up in rounds for a client with ``examples`` training
        examples that trains on ``examples_per_round`` a round: the larger of
        ``dgc_warmup_rounds`` and ``dgc_warmup_epochs`` epochs, rounded up; the rounds
        alone where either count is unknown (None or 0).

        >>> c = UpdateConfig(compressor="dgc")
        >>> c.dgc_warmup_for(2400, 320), c.dgc_warmup_for(144, 640), c.dgc_warmup_for(None, 320)
        (30, 4, 4)
        """
        rounds = self.dgc_warmup_rounds
        if self.dgc_warmup_epochs > 0 and examples and examples_per_round and examples_per_round > 0:
            rounds = max(rounds, math.ceil(self.dgc_warmup_epochs * examples / examples_per_round - 1e-9))
        return rounds

    def encoder_round(self, server_round: int) -> int:
        """The encoder's 0-based round for ``server_round``: rounds counted from the first
        compressed one (DGC's sparsity warm-up, the stochastic codecs' seeds)."""
        return server_round - 1 - self.warmup_rounds

    def wire_codecs(self) -> tuple[str, ...]:
        """The codecs this config's payloads name in their headers, the main one first:
        the compressor's (``dgc`` sends top-k payloads), then ``small_codec`` (small and
        1-D tensors), then ``raw`` (normalisation statistics). Empty for ``none``: the
        update is not encoded. Which tensor goes with which is the plan's
        (:class:`fededge.compress.plan.UpdatePlan`).

        Examples
        --------
        >>> UpdateConfig(compressor="dgc").wire_codecs()
        ('topk', 'raw')
        """
        if self.compressor == "none":
            return ()
        main = "topk" if self.compressor == "dgc" else self.compressor
        return tuple(dict.fromkeys((main, self.small_codec, "raw")))

    def variance_factor(self, numel: int, *, name: str = "", shape: tuple[int, ...] | None = None) -> float:
        """omega of the codec a tensor of ``numel`` elements (of ``shape``, named ``name``:
        its role in the plan, :mod:`fededge.compress.plan`) goes with:
        ``E||Q(x) - x||^2 <= omega ||x||^2`` for the unbiased codecs, 0 for the others
        (biased codecs are contractions instead; the small-tensor codecs are exact or
        casts).

        - qsgd, s levels, buckets of d elements: ``min(d / s^2, sqrt(d) / s)`` (Alistarh
          et al., 2017, Lemma 3.1);
        - randk, k of d kept and scaled by d / k: ``d / k - 1``;
        - terngrad, one scale per tensor: ``sqrt(d) - 1`` (the variance is
          ``sum |x_i| (max|x| - |x_i|) <= ||x||_1 ||x||_inf <= sqrt(d) ||x||^2``).

        CHOCO-SGD needs a contraction; ``Q / (1 + omega)`` is one (Koloskova et al., 2019).
        """
        if numel < 1 or numel < self.min_numel:
            return 0.0
        if shape is not None and tensor_role(name, tuple(shape), True, self) != "matrix":
            return 0.0  # a statistic, or a 1-D tensor: raw or the small cast
        c = self.compressor
        if c == "qsgd":
            d = min(self.qsgd_bucket or numel, numel)
            s = self.qsgd_levels
            return min(d / s**2, math.sqrt(d) / s)
        if c == "randk":
            from fededge.compress.codecs import keep_count

            return numel / keep_count(self.topk_ratio, numel) - 1.0
        if c == "terngrad":
            return math.sqrt(numel) - 1.0
        return 0.0

    def build_codec(self) -> Codec | None:
        """The stateless codec of ``compressor`` (None for none / dgc / powersgd)."""
        c, kw = self.compressor, {"lossless": self.lossless}
        if c in ("none", "dgc", "powersgd"):
            if c == "dgc":  # validate DGC's knobs too
                _named("dgc-sparsity / dgc-warmup-rounds / dgc-momentum", lambda: DGCConfig(
                    final_sparsity=self.dgc_sparsity, warmup_rounds=self.dgc_warmup_rounds,
                    momentum=self.dgc_momentum, clip_norm=self.dgc_clip_norm or None))
            if c == "powersgd":
                _named("powersgd-rank / powersgd-iters",
                       lambda: PowerSGDConfig(rank=self.powersgd_rank, iters=self.powersgd_iters))
            return None
        key = {"qsgd": "qsgd-levels / qsgd-bucket", "topk": "topk-ratio", "randk": "topk-ratio", "int8": "int8-block",
               "threshold": "threshold-tau"}.get(c, "compressor")
        if c == "qsgd":
            kw["levels"] = self.qsgd_levels
            kw["bucket"] = self.qsgd_bucket
        elif c in ("topk", "randk"):
            kw["ratio"] = self.topk_ratio
            kw["values"] = self.topk_values
        elif c == "int8":
            kw["block"] = self.int8_block
        elif c == "threshold":
            kw["tau"] = self.threshold_tau
        return _named(key, lambda: build_codec(c, **kw))


def _named(key: str, make):  # noqa: ANN001, ANN202
    try:
        return make()
    except ValueError as err:
        raise ValueError(f"'{key}': {err}") from None


class UpdateEncoder:
    """Encodes a client's model delta tensor by tensor; its state goes in context.state.

    Parameters
    ----------
    config : UpdateConfig
    stream : int
        Separates this client's random streams from other clients' (its partition id).
    """

    def __init__(self, config: UpdateConfig, *, stream: int = 0) -> None:
        if config.compressor == "none":
            raise ValueError("compressor 'none' sends the model as it is; no encoder is needed")
        self.config = config
        self.stream = stream
        self.codec = config.build_codec()
        self.small = build_codec(config.small_codec, lossless=config.lossless)
        self.raw = build_codec("raw", lossless=config.lossless)
        self.feedback = ErrorFeedback(self.codec) if (self.codec is not None and config.error_feedback) else None
        self.powersgd = (PowerSGDEncoder(PowerSGDConfig(rank=config.powersgd_rank, iters=config.powersgd_iters,
                                                        seed=config.seed * 1_000_003 + stream,
                                                        fallback=config.small_codec, lossless=config.lossless))
                         if config.compressor == "powersgd" else None)
        self.dgc = (DGCEncoder(DGCConfig(final_sparsity=config.dgc_sparsity, warmup_rounds=config.dgc_warmup_rounds,
                                         momentum=config.dgc_momentum,
                                         clip_norm=config.dgc_clip_norm or None, lossless=config.lossless))
                    if config.compressor == "dgc" else None)

    def _generator(self, rnd: int, index: int) -> torch.Generator:
        seq = np.random.SeedSequence([self.config.seed, self.stream, rnd, index])
        g = torch.Generator()
        g.manual_seed(int(seq.generate_state(1, dtype=np.uint64)[0]) & 0x7FFF_FFFF_FFFF_FFFF)
        return g

    def encode(self, delta: dict[str, torch.Tensor], *, round: int) -> dict[str, bytes]:
        """Payloads of every floating-point tensor of ``delta`` (``round`` is 0-based),
        each with the codec its role in the plan gives it (:mod:`fededge.compress.plan`)."""
        out: dict[str, bytes] = {}
        for i, (name, x) in enumerate(delta.items()):
            payload = self.encode_tensor(i, name, x.detach().float().cpu(), round=round)
            if payload is not None:
                out[name] = payload
        return out

    def encode_tensor(self, index: int, name: str, x: torch.Tensor, *, round: int) -> bytes | None:
        """The payload of tensor ``name``, the ``index``-th of the delta (its random
        stream), as :meth:`encode` makes it from ``x`` (float32, CPU); None for a
        statistic the server recalibrates (not sent)."""
        role = tensor_role(name, tuple(x.shape), True, self.config)
        if role == "statistic":
            if server_sets_statistics(self.config):
                return None  # the server recalibrates them (the plan's codec "server")
            return self.raw.encode(x)
        if role != "matrix":
            return self.small.encode(x)
        if self.powersgd is not None:
            return self.powersgd.encode(name, x)
        if self.dgc is not None:
            return self.dgc.encode(name, x, round=round)
        if self.feedback is not None:
            return self.feedback.encode(name, x, generator=self._generator(round, index))
        assert self.codec is not None
        return self.codec.encode(x, generator=self._generator(round, index))

    def state_dict(self) -> dict[str, torch.Tensor]:
        for part, prefix in ((self.feedback, "ef/"), (self.powersgd, "psgd/"), (self.dgc, "dgc/")):
            if part is not None:
                return {prefix + k: v for k, v in part.state_dict().items()}
        return {}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for part, prefix in ((self.feedback, "ef/"), (self.powersgd, "psgd/"), (self.dgc, "dgc/")):
            if part is not None:
                part.load_state_dict({k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)})


def decode_update(payloads: dict[str, bytes], *, max_elements: int) -> dict[str, torch.Tensor]:
    """The server's side: every payload decoded; ``max_elements`` bounds any one tensor.

    Raises :class:`~fededge.compress.MalformedPayloadError` (with the tensor's name) for
    anything that does not decode.
    """
    from fededge.compress import MalformedPayloadError

    out = {}
    with decode_limit(max_elements):
        for name, payload in payloads.items():
            try:
                out[name] = decode_any(payload)
            except MalformedPayloadError as err:
                raise MalformedPayloadError(f"tensor {name!r}: {err}") from None
    return out
