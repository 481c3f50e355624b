"""The bundle container: exact layout, round trip, and malformed input."""

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fededge.compress import MalformedPayloadError, build_codec
from fededge.compress.bundle import pack_bundle, unpack_bundle


def test_layout_by_hand():
    b = pack_bundle({"w": b"\x01\x02\x03", "bias": b""})
    expected = (b"FB" + bytes([1]) + struct.pack("<I", 2)
                + struct.pack("<H", 1) + b"w" + struct.pack("<I", 3)
                + struct.pack("<H", 4) + b"bias" + struct.pack("<I", 0)
                + b"\x01\x02\x03")
    assert b == expected
    assert unpack_bundle(b) == {"w": b"\x01\x02\x03", "bias": b""}


def test_round_trip_keeps_order_and_real_payloads():
    import torch

    payloads = {f"layer{i}.weight": build_codec("topk", ratio=0.1).encode(torch.randn(50), generator=None)
                for i in range(5)}
    back = unpack_bundle(pack_bundle(payloads))
    assert list(back) == list(payloads) and back == payloads


@pytest.mark.parametrize(("data", "match"), [
    (b"FB\x01", "shorter than its 7-byte header"),
    (b"XX\x01" + struct.pack("<I", 0), "bad bundle magic"),
    (b"FB\x02" + struct.pack("<I", 0), "unknown bundle version 2"),
    (b"FB\x01" + struct.pack("<I", 70000), "more than 65535"),
    (b"FB\x01" + struct.pack("<I", 1) + struct.pack("<H", 0), "empty or truncated"),
    (b"FB\x01" + struct.pack("<I", 1) + struct.pack("<H", 1) + b"\xff" + struct.pack("<I", 0), "not UTF-8"),
    (b"FB\x01" + struct.pack("<I", 1) + struct.pack("<H", 1) + b"a" + struct.pack("<I", 5) + b"abc",
     "announce 19 bytes in all, but it has 17"),
    (b"FB\x01" + struct.pack("<I", 2) + (struct.pack("<H", 1) + b"a" + struct.pack("<I", 0)) * 2, "twice"),
])
def test_malformed_bundles_name_the_problem(data, match):
    with pytest.raises(MalformedPayloadError, match=match):
        unpack_bundle(data)


_VALID = pack_bundle({"a": b"xyz", "b": b"\x00" * 10, "c": b""})


@settings(max_examples=2000, deadline=None, database=None, derandomize=True)
@given(st.one_of(
    st.binary(max_size=64),
    st.tuples(st.integers(0, len(_VALID) - 1), st.integers(0, 255)).map(
        lambda t: _VALID[:t[0]] + bytes([t[1]]) + _VALID[t[0] + 1:]),
    st.integers(0, len(_VALID)).map(lambda n: _VALID[:n]),
    st.binary(max_size=16).map(lambda extra: _VALID + extra),
))
def test_fuzz_only_malformed_payload_error(data):
    try:
        out = unpack_bundle(data)
    except MalformedPayloadError:
        return
    assert isinstance(out, dict) and sum(map(len, out.values())) <= len(data)
