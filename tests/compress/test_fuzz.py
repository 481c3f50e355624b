"""Fuzz the decoder: >= 10,000 random and mutated payloads; only MalformedPayloadError.

Four hypothesis tests (3,000 + 3,000 + 2,500 + 2,000 examples, derandomized, no example
database) start from valid payloads of every codec and flip, insert, delete, overwrite
and truncate bytes, forge header fields (huge shapes included), or send random bytes.
Each call must either decode to a finite float32 tensor of the header's shape or raise
MalformedPayloadError, within a time bound. Decoding runs under ``decode_limit(2**20)``
(what a server that knows its model does), so a forged huge shape cannot allocate more
than 4 MiB; dense codecs must also reject forged shapes by body length alone (see
test_codecs.test_decode_limit_refuses_huge_shapes_before_allocating).
"""

from __future__ import annotations

import struct
import time

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fededge.compress import CODECS, MalformedPayloadError, build_codec, decode_any, decode_limit
from fededge.compress.wire import CODEC_IDS

PARAMS = {"threshold": {"tau": 0.5}, "topk": {"ratio": 0.3}, "randk": {"ratio": 0.1},
          "powersgd": {"rank": 2}, "int8": {"block": 4}}
SHAPES = [(3, 5), (17,), (2, 3, 4), (40,)]


def _seeds() -> list[bytes]:
    out = []
    g = torch.Generator().manual_seed(0)
    for name in CODECS:
        for shape in SHAPES:
            for lossless in (False, True):
                x = torch.randn(shape, generator=g)
                if name == "powersgd" and len(shape) < 2:
                    continue
                out.append(build_codec(name, lossless=lossless, **PARAMS.get(name, {})).encode(x, generator=g))
    out.append(build_codec("topk", ratio=0.01).encode(torch.randn(2000, generator=g)))  # varint indices
    for values in ("fp16", "bf16"):  # the 5-byte params form
        out.append(build_codec("topk", ratio=0.3, values=values).encode(torch.randn(40, generator=g)))
    return out


SEEDS = _seeds()
def fuzz(n: int) -> settings:
    return settings(max_examples=n, deadline=None, database=None, derandomize=True,
                    suppress_health_check=list(HealthCheck))
CALLS = {"n": 0}


def check(payload: bytes) -> None:
    CALLS["n"] += 1
    t0 = time.perf_counter()
    try:
        with decode_limit(1 << 20):
            y = decode_any(payload)
    except MalformedPayloadError as err:
        assert str(err)  # names the problem
    else:
        assert y.dtype == torch.float32 and torch.isfinite(y).all()
    # Under the 1 MiB limit a decode takes milliseconds; a runaway one (a forged count
    # looped over) takes minutes. 10 s separates them even on a loaded 2-core machine,
    # where 2 s once failed beside three other pytest processes.
    assert time.perf_counter() - t0 < 10.0, "decode took too long"


@st.composite
def mutated(draw):
    p = bytearray(draw(st.sampled_from(SEEDS)))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "set", "insert", "delete", "truncate", "extend"]))
        if not p:
            break
        i = draw(st.integers(0, len(p) - 1))
        if op == "flip":
            p[i] ^= 1 << draw(st.integers(0, 7))
        elif op == "set":
            p[i] = draw(st.integers(0, 255))
        elif op == "insert":
            p[i:i] = draw(st.binary(min_size=1, max_size=8))
        elif op == "delete":
            del p[i:i + draw(st.integers(1, 8))]
        elif op == "truncate":
            del p[i:]
        else:
            p += draw(st.binary(min_size=1, max_size=16))
    return bytes(p)


@st.composite
def forged_header(draw):
    """A well-formed header (any codec, dtype, shape up to huge) over a random or real body."""
    codec = draw(st.sampled_from(sorted(CODEC_IDS.values())))
    ndim = draw(st.integers(0, 4))
    dims = draw(st.lists(st.one_of(st.integers(0, 64), st.integers(0, 2**32 - 1)), min_size=ndim, max_size=ndim))
    params = draw(st.one_of(st.binary(max_size=6), st.sampled_from([b"", b"\x10\x00", struct.pack("<f", 0.5),
                                                                     struct.pack("<IB", 4, 0), b"\x02\x00"])))
    body = draw(st.one_of(st.binary(max_size=300), st.sampled_from(SEEDS).map(lambda s: s[-64:])))
    flags = draw(st.sampled_from([0, 0, 1]))
    head = struct.pack("<2sBBBBB", b"FE", 1, codec, flags, draw(st.integers(0, 3)), ndim)
    head += struct.pack(f"<{ndim}I", *dims) + struct.pack("<H", len(params)) + params
    return head + struct.pack("<I", len(body)) + body


@fuzz(3000)
@given(mutated())
def test_mutated_payloads(payload):
    check(payload)


@fuzz(3000)
@given(st.sampled_from(SEEDS), st.integers(0, 2**32 - 1), st.integers(0, 7))
def test_forged_dimensions_of_valid_payloads(seed, value, which):
    """Overwrite one shape dimension of a valid payload (huge values included)."""
    ndim = seed[6]
    if ndim == 0:
        return check(seed)
    off = 7 + 4 * (which % ndim)
    check(seed[:off] + struct.pack("<I", value) + seed[off + 4:])


@fuzz(2500)
@given(forged_header())
def test_forged_headers(payload):
    check(payload)


@fuzz(2000)
@given(st.one_of(st.binary(max_size=200), st.binary(max_size=40).map(lambda b: b"FE\x01" + b)))
def test_random_bytes(payload):
    check(payload)


def test_zz_at_least_ten_thousand_payloads_were_thrown():
    # runs after the @given tests in file order; alone (-k) it has nothing to count
    if CALLS["n"]:
        assert CALLS["n"] >= 10_000
