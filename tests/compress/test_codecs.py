"""Properties of the stateless codecs: exactness, unbiasedness, sizes, bad input, vectors."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from fededge.compress import (
    CODECS, QSGD, BF16, FP16, Int8, MalformedPayloadError, OneBit, RandK, Raw, SignSGD, TernGrad,
    Threshold, TopK, build_codec, decode_any, decode_limit, pack, unpack,
)
from fededge.compress.wire import Header

VECTORS = Path(__file__).parent / "vectors"
PARAMS = {"threshold": {"tau": 0.5}, "topk": {"ratio": 0.1}, "randk": {"ratio": 0.1}, "powersgd": {"rank": 2}}


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def head(ndim: int, plen: int) -> int:
    """Header bytes of docs/wire-format.md: 7 fixed + 4 per dim + 2 + params + 4."""
    return 7 + 4 * ndim + 2 + plen + 4


def varint_len(v: int) -> int:
    n = 1
    while v >= 128:
        v >>= 7
        n += 1
    return n


# ------------------------------------------------------------------ exactness


def test_raw_is_bit_exact_including_special_values():
    x = torch.cat([torch.randn(1000, generator=gen()), torch.tensor([0.0, -0.0, 1e-45, -3.4e38, 3.4e38])])
    y = Raw().decode(Raw().encode(x))
    assert torch.equal(y.view(torch.int32), x.view(torch.int32))


def test_fp16_and_bf16_exact_for_representable_values():
    x16 = torch.randn(4096, generator=gen()).to(torch.float16)
    assert torch.equal(FP16().decode(FP16().encode(x16)), x16.float())
    xb = (torch.randn(4096, generator=gen(1)) * 1e30).to(torch.bfloat16)
    assert torch.equal(BF16().decode(BF16().encode(xb)), xb.float())
    # fp16 header records the caller's dtype
    assert unpack(FP16().encode(x16))[0].dtype == torch.float16


def test_fp16_refuses_overflow():
    with pytest.raises(ValueError, match="overflows float16"):
        FP16().encode(torch.tensor([1e6]))


@pytest.mark.parametrize("name", CODECS)
def test_lossless_stage_is_exact_and_changes_only_the_body(name):
    x = torch.randn(24, 20, generator=gen(3))
    plain = build_codec(name, **PARAMS.get(name, {})).encode(x, generator=gen(7))
    zl = build_codec(name, lossless=True, **PARAMS.get(name, {})).encode(x, generator=gen(7))
    h0, b0 = unpack(plain)
    h1, b1 = unpack(zl)
    assert h1.zlib and not h0.zlib and b0 == b1
    assert torch.equal(decode_any(plain), decode_any(zl))


@pytest.mark.parametrize("name", [c for c in CODECS if c != "powersgd"])
@pytest.mark.parametrize("shape", [(), (0,), (1,), (3, 0, 2), (5, 1, 3)])
def test_degenerate_shapes_round_trip(name, shape):
    x = torch.randn(shape, generator=gen(2))
    y = decode_any(build_codec(name, **PARAMS.get(name, {})).encode(x, generator=gen()))
    assert y.shape == x.shape and y.dtype == torch.float32


def test_every_codec_is_registered_and_named():
    assert set(CODECS) == {"raw", "fp16", "bf16", "int8", "qsgd", "terngrad", "onebit", "signsgd",
                           "threshold", "topk", "randk", "powersgd"}


# ------------------------------------------------------------------ what each codec computes


def test_int8_error_within_half_a_step_and_blocks_isolate_outliers():
    x = torch.randn(1024, generator=gen())
    x[5] = 1000.0
    for block in (0, 256):
        y = Int8(block=block).decode(Int8(block=block).encode(x))
        blocks = x.view(-1, block or 1024)
        step = (blocks.abs().amax(1, keepdim=True) / 127).expand_as(blocks).reshape(-1)
        assert ((y - x).abs() <= step / 2 * (1 + 1e-5)).all()
    err_tensor = (Int8().decode(Int8().encode(x)) - x)[256:].abs().max()
    err_block = (Int8(block=256).decode(Int8(block=256).encode(x)) - x)[256:].abs().max()
    assert err_block < err_tensor / 50


def test_onebit_sends_column_means_of_each_sign():
    x = torch.randn(50, 4, generator=gen())
    y = OneBit().decode(OneBit().encode(x))
    for c in range(4):
        col = x[:, c]
        assert torch.allclose(y[col >= 0, c], col[col >= 0].mean().expand(int((col >= 0).sum())), atol=1e-6)
        assert torch.allclose(y[col < 0, c], col[col < 0].mean().expand(int((col < 0).sum())), atol=1e-6)
    # one column for 1-D tensors: every element gets one of two values
    assert len(torch.unique(OneBit().decode(OneBit().encode(torch.randn(100, generator=gen()))))) == 2


def test_signsgd_scale_is_mean_abs_and_signs_match():
    x = torch.randn(999, generator=gen())
    y = SignSGD().decode(SignSGD().encode(x))
    assert torch.allclose(y.abs(), x.abs().mean().expand(999))
    assert torch.equal(y < 0, x < 0)


def test_threshold_sends_exactly_the_large_elements_as_tau():
    x = torch.randn(5000, generator=gen())
    y = Threshold(tau=1.5).decode(Threshold(tau=1.5).encode(x))
    big = x.abs() >= 1.5
    assert torch.equal(y != 0, big)
    assert torch.equal(y[big], torch.where(x[big] < 0, -1.5, 1.5))


def test_topk_keeps_the_k_largest_magnitudes():
    x = torch.randn(1000, generator=gen())
    y = TopK(ratio=0.05).decode(TopK(ratio=0.05).encode(x))
    kept = y != 0
    assert int(kept.sum()) == 50
    assert torch.equal(y[kept], x[kept])
    assert x[kept].abs().min() >= x[~kept].abs().max()


def test_randk_keeps_k_and_scales_by_d_over_k():
    x = torch.randn(1000, generator=gen()) + 5
    y = RandK(ratio=0.03).decode(RandK(ratio=0.03).encode(x, generator=gen()))
    kept = y != 0
    assert int(kept.sum()) == 30
    assert torch.allclose(y[kept], x[kept] * (1000 / 30))


# ------------------------------------------------------------------ unbiasedness

N_DRAWS = 2000


def mean_and_var(codec, x, n=N_DRAWS):
    g = gen(1234)
    ys = torch.stack([codec.decode(codec.encode(x, generator=g)).double() for _ in range(n)])
    return ys.mean(0), ys.var(0)


def assert_unbiased(mean, x, per_elem_var, n=N_DRAWS):
    """Each element within 5 standard errors (sqrt(var / n)) of x, plus float32 slack."""
    tol = 5 * torch.sqrt(per_elem_var / n) + 1e-6 * (1 + x.abs())
    assert ((mean - x.double()).abs() <= tol).all(), float(((mean - x.double()).abs() - tol).max())


def bucket_norms(x: torch.Tensor, bucket: int) -> torch.Tensor:
    """Each element's bucket L2 norm (float64); bucket 0 = the whole tensor."""
    x = x.double().reshape(-1)
    w = x.numel() if bucket == 0 else bucket
    return torch.cat([c.norm().expand(c.numel()) for c in x.split(w)])


@pytest.mark.parametrize("bucket", [0, 16])
def test_qsgd_unbiased_and_within_the_papers_variance_bound(bucket):
    x = torch.randn(100, generator=gen())  # bucket 16: six full buckets and one of 4
    s = 4
    mean, var = mean_and_var(QSGD(levels=s, bucket=bucket), x)
    norm = bucket_norms(x, bucket)
    r = x.double().abs() / norm * s
    p = r - torch.floor(r)
    exact_var = (norm / s) ** 2 * p * (1 - p)  # Bernoulli between adjacent levels
    assert_unbiased(mean, x, exact_var)
    b = bucket or x.numel()
    total = float(var.sum())
    assert total <= min(b / s**2, math.sqrt(b) / s) * float(x.double().norm()) ** 2
    assert abs(total - float(exact_var.sum())) <= 0.15 * float(exact_var.sum())


def test_qsgd_buckets_quantize_with_their_own_norm():
    x = torch.cat([torch.randn(8, generator=gen()) * 1000, torch.randn(9, generator=gen(1)) * 1e-3])
    y = QSGD(levels=4, bucket=8).decode(QSGD(levels=4, bucket=8).encode(x, generator=gen()))
    for chunk, out in zip(x.split(8), y.split(8)):
        step = float(chunk.float().norm()) / 4
        assert torch.allclose(out.abs() / step, (out.abs() / step).round(), atol=1e-4)
        assert ((out - chunk).abs() <= step * (1 + 1e-5)).all()
    assert (y[8:].abs() < 1).all()  # the small buckets do not inherit the big norm


def test_qsgd_bucket_zero_is_one_norm_for_the_whole_tensor():
    x = torch.randn(1000, generator=gen())
    c = QSGD(levels=16, bucket=0)
    p = c.encode(x, generator=gen())
    h, body = unpack(p)
    assert struct.unpack("<HI", h.params) == (16, 0)
    assert len(body) == 4 + 125 + 625
    y = c.decode(p)
    step = float(x.norm()) / 16
    assert torch.allclose(y.abs() / step, (y.abs() / step).round(), atol=1e-4)
    # a bucket at least d long encodes like bucket 0 except for the params
    assert unpack(QSGD(levels=16, bucket=1000).encode(x, generator=gen()))[1] == body
    assert unpack(QSGD(levels=16, bucket=4096).encode(x, generator=gen()))[1] == body


def test_qsgd_default_is_bucket_512():
    assert QSGD().config.bucket == 512 and QSGD().config.levels == 16


def test_qsgd_bucketing_cuts_the_error_of_a_large_tensor(big):
    """1M randn elements, s = 16: bucket 0 has relative error ||Q(x) - x|| / ||x|| ~ 6.99
    (expected value sqrt(sum (||x||/s)^2 p(1-p)) / ||x||), bucket 512 ~ 0.577: 12x smaller.
    Both stay under the paper's bound sqrt(min(b/s^2, sqrt(b)/s)): 7.91 and 1.19."""
    err = {}
    for bucket in (0, 512):
        y = decode_any(QSGD(levels=16, bucket=bucket).encode(big, generator=gen(5)))
        err[bucket] = float((y.double() - big.double()).norm() / big.double().norm())
        b = bucket or D
        assert err[bucket] <= math.sqrt(min(b / 16**2, math.sqrt(b) / 16))
    assert err[0] > 6.5
    assert err[512] < 0.6
    assert err[0] / err[512] > 11


def test_qsgd_body_length_is_checked_against_bucket_and_levels():
    x = torch.randn(17, generator=gen())
    h, body = unpack(QSGD(levels=16, bucket=4).encode(x, generator=gen()))
    assert len(body) == 4 * 5 + 3 + 11
    for s, bucket in ((16, 8), (16, 0), (7, 4)):
        forged = pack(Header("qsgd", h.dtype, h.shape, struct.pack("<HI", s, bucket)), body)
        with pytest.raises(MalformedPayloadError, match=f"bucket = {bucket} and s = {s} must be"):
            decode_any(forged)
    # a forged huge bucket means one norm; it must decode without allocating per bucket
    h0, body0 = unpack(QSGD(levels=16, bucket=0).encode(x, generator=gen()))
    huge = pack(Header("qsgd", h.dtype, h.shape, struct.pack("<HI", 16, 2**32 - 1)), body0)
    assert torch.equal(decode_any(huge), decode_any(pack(h0, body0)))
    with pytest.raises(MalformedPayloadError, match="parameters are 2 bytes, expected 6"):
        decode_any(pack(Header("qsgd", h.dtype, h.shape, struct.pack("<H", 16)), body))


def test_terngrad_unbiased():
    x = torch.randn(64, generator=gen(1))
    mean, _ = mean_and_var(TernGrad(), x)
    s = float(x.abs().max())
    assert_unbiased(mean, x, s * x.double().abs() - x.double() ** 2)


def test_randk_unbiased():
    x = torch.randn(64, generator=gen(2))
    d, k = 64, 8
    mean, _ = mean_and_var(RandK(ratio=k / d), x)
    assert_unbiased(mean, x, x.double() ** 2 * (d / k - 1))


def test_int8_stochastic_unbiased_and_deterministic_biased():
    x = torch.randn(64, generator=gen(3)) * 0.01
    x[0] = 1.0  # a coarse step: deterministic rounding is visibly biased
    step = 1.0 / 127
    mean, _ = mean_and_var(Int8(stochastic=True), x)
    assert_unbiased(mean, x, torch.full((64,), step**2 / 4, dtype=torch.float64))
    assert Int8(stochastic=True).biased is False and Int8().biased is True
    det = Int8().decode(Int8().encode(x)).double()
    # deterministic rounding misses by far more than the stochastic tolerance
    assert (det - x.double()).abs().max() > 5 * (5 * math.sqrt(step**2 / 4 / N_DRAWS))


# ------------------------------------------------------------------ payload sizes

D = 1_000_000


@pytest.fixture(scope="module")
def big():
    return torch.randn(D, generator=gen(11))


def test_sizes_of_casts_and_int8(big):
    assert len(Raw().encode(big)) == head(1, 0) + 4 * D
    assert len(FP16().encode(big)) == head(1, 0) + 2 * D
    assert len(BF16().encode(big)) == head(1, 0) + 2 * D
    assert len(Int8().encode(big)) == head(1, 5) + 4 + D
    assert len(Int8(block=256).encode(big)) == head(1, 5) + 4 * math.ceil(D / 256) + D


def test_onebit_of_a_million_is_125kB_plus_scales(big):
    assert len(OneBit().encode(big)) == head(1, 0) + 8 + 125_000  # one column: 2 floats
    m = big.view(1000, 1000)
    assert len(OneBit().encode(m)) == head(2, 0) + 8 * 1000 + 125_000


@pytest.mark.parametrize("bucket", [0, 512, 1000])
@pytest.mark.parametrize("s,bits", [(1, 1), (16, 5), (255, 8), (256, 9)])
def test_qsgd_size(big, s, bits, bucket):
    x = big[:100_003]
    d = x.numel()
    norms = 1 if bucket == 0 else math.ceil(d / bucket)
    assert len(QSGD(levels=s, bucket=bucket).encode(x, generator=gen())) == (
        head(1, 6) + 4 * norms + math.ceil(d / 8) + math.ceil(d * bits / 8))


def test_qsgd_size_of_a_million_with_bucket_512(big):
    # 23 header (17 + 6 params) + 1954 norms x 4 (ceil(1e6 / 512)) + 125,000 sign bytes
    # + 625,000 bytes of 5-bit levels = 757,839 (bucket 0: 750,027)
    assert len(QSGD(levels=16, bucket=512).encode(big, generator=gen())) == 757_839
    assert len(QSGD(levels=16).encode(big, generator=gen())) == 757_839
    assert len(QSGD(levels=16, bucket=0).encode(big, generator=gen())) == 750_027


def test_terngrad_and_signsgd_sizes(big):
    assert len(TernGrad().encode(big, generator=gen())) == head(1, 0) + 4 + D // 4
    assert len(SignSGD().encode(big[:D - 3])) == head(1, 0) + 4 + math.ceil((D - 3) / 8)


def sparse_size(payload_body_tag: int, idx: np.ndarray, d: int, per_value: float) -> int:
    if payload_body_tag == 0:
        index = 1 + math.ceil(d / 8)
    else:
        gaps = np.diff(idx, prepend=-1) - 1
        index = 1 + varint_len(len(idx)) + sum(varint_len(int(g)) for g in gaps)
    return index + math.ceil(per_value * len(idx))


@pytest.mark.parametrize("ratio,tag", [(0.5, 0), (0.01, 1), (0.001, 1)])
def test_topk_size_picks_the_smaller_index_encoding(big, ratio, tag):
    p = TopK(ratio=ratio).encode(big)
    h, body = unpack(p)
    assert body[0] == tag
    idx = np.flatnonzero(decode_any(p).numpy())
    assert len(idx) == math.ceil(ratio * D)
    assert len(p) == head(1, 4) + sparse_size(tag, idx, D, 4)
    # the other encoding would not have been smaller
    other = sparse_size(1 - tag, idx, D, 4)
    assert other >= len(body) if tag == 0 else other > len(body)


@pytest.mark.parametrize("values,width,dtype", [("fp16", 2, torch.float16), ("bf16", 2, torch.bfloat16)])
@pytest.mark.parametrize("codec", [TopK, RandK])
def test_sparse_values_in_half_precision(big, codec, values, width, dtype):
    p = codec(ratio=0.05, values=values).encode(big, generator=gen(3))
    h, body = unpack(p)
    assert struct.unpack("<fB", h.params) == (pytest.approx(0.05), 1 if values == "fp16" else 2)
    out = decode_any(p).numpy()
    idx = np.flatnonzero(out)
    # The same indices as float32 values would keep, the values rounded to the precision.
    ref = decode_any(codec(ratio=0.05).encode(big, generator=gen(3))).numpy()
    assert np.array_equal(idx, np.flatnonzero(ref))
    assert np.array_equal(out[idx], torch.from_numpy(ref[idx]).to(dtype).float().numpy())
    assert len(p) == head(1, 5) + sparse_size(body[0], idx, D, width)


def test_sparse_value_precision_bad_input():
    with pytest.raises(ValueError, match="values must be one of fp32, fp16, bf16"):
        TopK(ratio=0.1, values="fp8")
    with pytest.raises(ValueError, match="overflows float16"):
        TopK(ratio=0.5, values="fp16").encode(torch.tensor([1e5, 1.0]))
    assert decode_any(TopK(ratio=0.5, values="bf16").encode(torch.tensor([1e5, 1.0])))[0] == 99840.0
    body = bytes([1, 1, 3]) + struct.pack("<e", 1.0)  # varint: k=1, index 3; one fp16 value
    ok = decode_any(pack(Header("topk", torch.float32, (10,), struct.pack("<fB", 0.1, 1)), body))
    assert ok[3] == 1.0 and ok.sum() == 1.0
    with pytest.raises(MalformedPayloadError, match="value code 3 is unknown"):
        decode_any(pack(Header("topk", torch.float32, (10,), struct.pack("<fB", 0.1, 3)), body))
    with pytest.raises(MalformedPayloadError, match="must be 5 bytes"):  # fp16 values, 4-byte body
        decode_any(pack(Header("topk", torch.float32, (10,), struct.pack("<fB", 0.1, 1)), body + b"\0\0"))
    with pytest.raises(MalformedPayloadError, match="parameters are 6 bytes"):
        decode_any(pack(Header("topk", torch.float32, (10,), struct.pack("<fBB", 0.1, 1, 0)), body))
    inf = bytes([1, 1, 3]) + struct.pack("<e", float("inf"))
    with pytest.raises(MalformedPayloadError, match="NaN or Inf"):
        decode_any(pack(Header("topk", torch.float32, (10,), struct.pack("<fB", 0.1, 1)), inf))


def test_threshold_size(big):
    for tau, tag in ((0.5, 0), (3.0, 1)):
        p = Threshold(tau=tau).encode(big)
        idx = np.flatnonzero(decode_any(p).numpy())
        assert unpack(p)[1][0] == tag
        assert len(p) == head(1, 4) + sparse_size(tag, idx, D, 1 / 8)


def test_powersgd_size():
    x = torch.randn(1000, 1000, generator=gen())
    assert len(build_codec("powersgd", rank=2).encode(x, generator=gen())) == head(2, 2) + 4 * 2 * 2000


# ------------------------------------------------------------------ configs and errors


@pytest.mark.parametrize("name,params,match", [
    ("qsgd", {"levels": 0}, "levels must be"),
    ("qsgd", {"bucket": -1}, "bucket must be a positive element count"),
    ("qsgd", {"bucket": 2**32}, "bucket must be"),
    ("qsgd", {"bucket": 1.5}, "bucket must be"),
    ("qsgd", {"bucket": True}, "bucket must be"),
    ("int8", {"block": -1}, "block must be"),
    ("threshold", {"tau": 0.0}, "tau must be"),
    ("topk", {"ratio": 0.0}, "ratio must be in"),
    ("randk", {"ratio": 1.5}, "ratio must be in"),
    ("powersgd", {"rank": 0}, "rank must be"),
    ("raw", {"lossless": 1}, "lossless must be"),
    ("qsgd", {"bogus": 1}, "unknown parameter"),
    ("nope", {}, "unknown codec"),
])
def test_bad_configs_say_what_to_change(name, params, match):
    with pytest.raises(ValueError, match=match):
        build_codec(name, **params)


def test_encode_refuses_nan():
    with pytest.raises(ValueError, match="NaN or Inf"):
        QSGD().encode(torch.tensor([1.0, float("nan")]))


def test_configs_are_frozen():
    c = build_codec("qsgd", levels=4)
    with pytest.raises(Exception):
        c.config.levels = 8  # type: ignore[misc]


@pytest.mark.parametrize("name", CODECS)
def test_every_truncation_is_rejected(name):
    p = build_codec(name, **PARAMS.get(name, {})).encode(torch.randn(6, 5, generator=gen()), generator=gen())
    for n in range(len(p)):
        with pytest.raises(MalformedPayloadError):
            decode_any(p[:n])
    with pytest.raises(MalformedPayloadError, match="body length"):
        decode_any(p + b"\x00")


def test_unknown_version_codec_and_dtype():
    p = bytearray(Raw().encode(torch.ones(3)))
    for off, val, match in ((2, 2, "version"), (3, 200, "codec id"), (5, 9, "dtype"), (0, 0, "magic"), (4, 2, "flag")):
        q = bytearray(p)
        q[off] = val
        with pytest.raises(MalformedPayloadError, match=match):
            decode_any(bytes(q))


def test_shape_mismatch_is_named():
    h, body = unpack(Raw().encode(torch.ones(3, 4)))
    with pytest.raises(MalformedPayloadError, match="must be 64 bytes"):
        decode_any(pack(Header("raw", h.dtype, (4, 4), b""), body))
    with pytest.raises(MalformedPayloadError, match="not 'qsgd'"):
        QSGD.decode(Raw().encode(torch.ones(3)))


def test_topk_index_out_of_range_and_bad_tags():
    params = struct.pack("<f", 0.5)
    body = bytes([1, 1, 10]) + struct.pack("<f", 1.0)  # varint: k=1, index 10 of 10 elements
    with pytest.raises(MalformedPayloadError, match="out of range"):
        decode_any(pack(Header("topk", torch.float32, (10,), params), body))
    with pytest.raises(MalformedPayloadError, match="index-encoding tag"):
        decode_any(pack(Header("topk", torch.float32, (10,), params), bytes([7]) + body[1:]))
    bitmap = bytes([0, 0, 0b100])  # 10 elements: bit 10 is padding
    with pytest.raises(MalformedPayloadError, match="padding"):
        decode_any(pack(Header("topk", torch.float32, (10,), params), bitmap + struct.pack("<f", 1.0)))
    with pytest.raises(MalformedPayloadError, match="10 indices for a tensor of 3"):
        decode_any(pack(Header("topk", torch.float32, (3,), params), bytes([1, 10]) + bytes(10)))


def test_nan_and_inf_after_decoding_are_rejected():
    nan = struct.pack("<f", float("nan"))
    with pytest.raises(MalformedPayloadError, match="NaN or Inf"):
        decode_any(pack(Header("raw", torch.float32, (1,), b""), nan))
    with pytest.raises(MalformedPayloadError, match="NaN or Inf"):
        decode_any(pack(Header("qsgd", torch.float32, (1,), struct.pack("<HI", 1, 0)), struct.pack("<f", float("inf")) + b"\x00\x01"))
    # finite factors whose product overflows: caught after decoding
    big = struct.pack("<f", 3e38)
    with pytest.raises(MalformedPayloadError, match="NaN or Inf"):
        decode_any(pack(Header("powersgd", torch.float32, (1, 1), struct.pack("<H", 1)), big + big))
    # ... but a product near float32's largest value that is finite decodes (the cheap
    # bound r max|P| max|Q| refused P = 1, Q = 3.2e38)
    one, near = struct.pack("<f", 1.0), struct.pack("<f", 3.2e38)
    got = decode_any(pack(Header("powersgd", torch.float32, (1, 1), struct.pack("<H", 1)), one + near))
    assert float(got) == pytest.approx(3.2e38, rel=1e-6)


def test_an_encoder_refuses_what_its_decoder_would_refuse():
    """bf16 rounds |x| over ~3.39e38 to Inf and random-k's d / k scaling can overflow:
    both built payloads that their own decoders then refused."""
    from fededge.compress import BF16, RandK, TopK

    with pytest.raises(ValueError, match="overflows bfloat16"):
        BF16().encode(torch.tensor([3.4e38]))
    with pytest.raises(ValueError, match="overflows bfloat16"):
        TopK(ratio=1.0, values="bf16").encode(torch.tensor([3.4e38, 1.0]))
    with pytest.raises(ValueError, match="random-k's d / k = 2 scaling overflows float32"):
        RandK(ratio=0.5).encode(torch.tensor([3e38, 3e38]))
    assert decode_any(BF16().encode(torch.tensor([3.3e38]))).isfinite().all()


def test_decode_limit_refuses_huge_shapes_before_allocating():
    params = struct.pack("<f", 1e-9)
    tiny = pack(Header("topk", torch.float32, (2**30,), params), bytes([1, 1, 0]) + struct.pack("<f", 1.0))
    with decode_limit(1 << 20):
        with pytest.raises(MalformedPayloadError, match="decode limit"):
            decode_any(tiny)
    # dense codecs never need the limit: the body length gives a forged shape away
    for name in ("raw", "fp16", "int8", "qsgd", "terngrad", "onebit", "signsgd"):
        h, body = unpack(build_codec(name).encode(torch.ones(8), generator=gen()))
        with pytest.raises(MalformedPayloadError, match="must be"):
            decode_any(pack(Header(name, h.dtype, (2**31,), h.params), body))


def test_zlib_trailing_garbage_rejected():
    p = Raw(lossless=True).encode(torch.ones(100))
    h, _ = unpack(p)
    import zlib
    body = zlib.compress(bytes(400)) + b"junk"
    raw = pack(Header("raw", torch.float32, (100,), b""), body)
    forged = bytearray(raw)
    forged[4] = 1  # set the zlib flag on a body that has trailing bytes
    with pytest.raises(MalformedPayloadError, match="follow the end of the zlib stream"):
        decode_any(bytes(forged))


# ------------------------------------------------------------------ test vectors


def _vectors():
    index = json.loads((VECTORS / "index.json").read_text())
    return index["vectors"]


#: Encoders whose output is a sum over floats or a matmul/QR (qsgd's L2 norms, onebit's
#: column means, signsgd's mean |x|, powersgd's power step): the float fields they put in
#: the payload depend on summation order, and so on the CPU's vector width, FMA and BLAS
#: kernels (docs/wire-format.md, "What is exact"). Every other encoder is elementwise, a
#: max, a selection or a generator draw: the same bytes on every machine.
REDUCING_ENCODERS = {"qsgd", "onebit", "signsgd", "powersgd"}


def _vector(v):
    shape = tuple(v["shape"])
    x = torch.from_numpy(np.fromfile(VECTORS / f"{v['name']}.input.f32", dtype="<f4").copy()).reshape(shape)
    payload = (VECTORS / f"{v['name']}.payload.bin").read_bytes()
    expected = np.fromfile(VECTORS / f"{v['name']}.decoded.f32", dtype="<f4").reshape(shape)
    return x, payload, expected


@pytest.mark.parametrize("v", _vectors(), ids=lambda v: v["name"])
def test_vector_decodes_bit_for_bit(v):
    # Every decoder is exact by construction, powersgd's too (float64 accumulation in a
    # stated order, one rounding): the same bits on any CPU, whatever MKL or ATen picks.
    _, payload, expected = _vector(v)
    assert decode_any(payload).numpy().tobytes() == expected.tobytes()


@pytest.mark.parametrize("v", _vectors(), ids=lambda v: v["name"])
def test_vector_reencodes_byte_for_byte_or_within_rounding(v):
    x, payload, expected = _vector(v)
    again = build_codec(v["codec"], **v["params"]).encode(x, generator=gen(v["seed"]))
    if v["codec"] not in REDUCING_ENCODERS:
        assert again == payload
        return
    # Same header and length; the float fields may differ by rounding, so the decode of
    # the re-encoding is compared with the vector's decode to float32 tolerance (a flipped
    # sign, a wrong level or a lost rank would be off by far more).
    h_again, body_again = unpack(again)
    h_vec, body_vec = unpack(payload)
    assert h_again == h_vec and len(body_again) == len(body_vec)
    np.testing.assert_allclose(decode_any(again).numpy(), expected, rtol=1e-5,
                               atol=1e-6 * float(np.abs(expected).max()))


@pytest.mark.parametrize("r", [1, 2, 3, 5])
def test_powersgd_reconstruction_is_the_stated_float64_sum(r):
    # The wire format's rule, checked against a NumPy evaluation of it term by term: exact
    # float64 products, summed in k order, rounded once. Includes signed zeros and a
    # denormal-sized product, where a different rule would show.
    from fededge.compress.powersgd import reconstruct

    g = gen(r)
    p, q = torch.randn(37, r, generator=g), torch.randn(23, r, generator=g)
    p[0] = -0.0
    q[1, 0] = 1e-30
    p[2, 0] = 1e-20
    got = reconstruct(p, q).numpy()
    P, Q = p.numpy().astype(np.float64), q.numpy().astype(np.float64)
    acc = P[:, :1] * Q[:, 0][None, :]
    for k in range(1, r):
        acc = acc + P[:, k:k + 1] * Q[:, k][None, :]
    assert got.tobytes() == acc.astype(np.float32).tobytes()


def test_vectors_cover_every_codec_and_stay_small():
    names = {v["codec"] for v in _vectors()}
    assert names == set(CODECS)
    assert sum(f.stat().st_size for f in VECTORS.iterdir()) < 200_000


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 63, 64, 65, 40_001])
@pytest.mark.parametrize("s", [0.0123, 0.0, 3.0e38])
def test_signed_scalars_is_the_select_of_the_unpacked_signs_bit_for_bit(n, s):
    from fededge.compress._bits import pack_bools, signed_scalars, unpack_bools

    bits = np.random.default_rng(n).random(n) < 0.5
    data = pack_bools(bits)
    want = np.where(unpack_bools(data, n, "x"), -np.float32(s), np.float32(s))
    got = signed_scalars(data, n, np.float32(s), "x")
    assert got.dtype == np.float32 and got.shape == (n,) and got.flags.writeable
    assert got.tobytes() == want.tobytes()  # -0.0 where the bit is set and s is 0


def test_signed_scalars_checks_length_and_padding_like_unpack_bools():
    from fededge.compress._bits import signed_scalars

    with pytest.raises(MalformedPayloadError, match="signs: 3 bytes for 9 x 1 bits"):
        signed_scalars(b"\x00\x00\x00", 9, np.float32(1), "signs")
    with pytest.raises(MalformedPayloadError, match="padding bits"):
        signed_scalars(b"\x00\x02", 9, np.float32(1), "signs")
    assert signed_scalars(b"\x00\x01", 9, np.float32(1), "signs")[-1] == -1
