"""The bundle container: exact layout, round trip, and malformed input."""

import struct
import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fededge.compress import MalformedPayloadError, build_codec
from fededge.compress.bundle import pack_bundle, unpack_bundle


def test_layout_by_hand():
    b = pack_bundle({"w": b"\x01\x02\x03", "bias": b""}, version=1)
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
    for version in (1, 2):
        back = unpack_bundle(pack_bundle(payloads, version=version))
        assert list(back) == list(payloads) and back == payloads


def test_version_2_by_hand_deflates_the_names_and_headers_and_keeps_the_bodies():
    import torch

    from fededge.compress.wire import header_length

    w = build_codec("fp16").encode(torch.ones(2, 3))
    h = header_length(w)
    assert h == 21 and len(w) == 21 + 12
    payloads = {"w": w, "x": b"\x01\x02\x03", "e": b""}  # bytes that are not a payload have no head
    b = pack_bundle(payloads)
    meta = (struct.pack("<I", 3)
            + struct.pack("<H", 1) + b"w" + struct.pack("<I", len(w)) + struct.pack("<H", h)
            + struct.pack("<H", 1) + b"x" + struct.pack("<I", 3) + struct.pack("<H", 0)
            + struct.pack("<H", 1) + b"e" + struct.pack("<I", 0) + struct.pack("<H", 0)
            + w[:h])
    z = zlib.compress(meta, 9)
    assert b == b"FB" + bytes([2]) + struct.pack("<I", len(z)) + z + w[h:] + b"\x01\x02\x03"
    assert unpack_bundle(b) == payloads
    # Any zlib stream of the same metadata reads the same (another implementation, level).
    z1 = zlib.compress(meta, 1)
    assert unpack_bundle(b"FB\x02" + struct.pack("<I", len(z1)) + z1 + w[h:] + b"\x01\x02\x03") == payloads


def test_version_2_is_smaller_for_a_models_update():
    from fededge.models.zoo import build_model

    sd = build_model("resnet18-w8", input_shape=(3, 32, 32), num_classes=10, seed=0).state_dict()
    codec = build_codec("topk", ratio=0.01)
    payloads = {k: codec.encode(v.float(), generator=None) for k, v in sd.items() if v.is_floating_point()}
    v1, v2 = pack_bundle(payloads, version=1), pack_bundle(payloads)
    assert unpack_bundle(v1) == unpack_bundle(v2) == payloads
    assert len(v1) - len(v2) > 2000  # of 2.9 kB of names and headers (2026-11-28: 2,435 saved)


def _v2(meta: bytes, tails: bytes = b"", zlen: int | None = None) -> bytes:
    z = zlib.compress(meta)
    return b"FB\x02" + struct.pack("<I", len(z) if zlen is None else zlen) + z + tails


_ENTRY = struct.pack("<H", 1) + b"a" + struct.pack("<I", 3) + struct.pack("<H", 1)
_BOMB = zlib.compress(bytes(64 * 2**20 + 1), 9)
_c = zlib.compressobj(zdict=b"dictionary")
_ZDICT = _c.compress(struct.pack("<I", 0)) + _c.flush()


@pytest.mark.parametrize(("data", "match"), [
    (b"FB\x02" + struct.pack("<I", 9) + b"xx", "announces 9 bytes of metadata"),
    (b"FB\x02" + struct.pack("<I", 3) + b"abc", "does not decompress"),
    (b"FB\x02" + struct.pack("<I", 8) + zlib.compress(b"\x00\x00")[:-2], "truncated or inflates past"),
    (_v2(b"\x00\x00\x00"), "shorter than its 4-byte count"),
    (_v2(struct.pack("<I", 70000)), "more than 65535"),
    (_v2(struct.pack("<I", 1) + _ENTRY), "announces 14 bytes, but inflates to 13"),
    (_v2(struct.pack("<I", 1) + _ENTRY + b"ab"), "announces 14 bytes, but inflates to 15"),
    (_v2(struct.pack("<I", 1) + _ENTRY[:-2] + struct.pack("<H", 4) + b"abcd"), "longer than its 3-byte payload"),
    (_v2(struct.pack("<I", 1) + _ENTRY + b"a", b"bcd"), "announce"),
    (_v2(struct.pack("<I", 2) + _ENTRY * 2 + b"aa", b"bcbc"), "twice"),
    (_v2(struct.pack("<I", 1) + struct.pack("<H", 1) + b"\xff" + struct.pack("<I", 0) + struct.pack("<H", 0)),
     "not UTF-8"),
    # junk after the stream, inside Z
    (b"FB\x02" + struct.pack("<I", len(zlib.compress(struct.pack("<I", 0))) + 2) + zlib.compress(struct.pack("<I", 0))
     + b"xx", "2 bytes follow the end of the bundle's metadata stream"),
    # a stream that inflates past the limit (64 MiB of zeros, 65 kB deflated)
    (b"FB\x02" + struct.pack("<I", len(_BOMB)) + _BOMB, "inflates past its limit"),
    # a preset dictionary
    (b"FB\x02" + struct.pack("<I", len(_ZDICT)) + _ZDICT, "does not decompress"),
])
def test_malformed_version_2_bundles_name_the_problem(data, match):
    with pytest.raises(MalformedPayloadError, match=match):
        unpack_bundle(data)
    # and the well-formed one next to them reads
    assert unpack_bundle(_v2(struct.pack("<I", 1) + _ENTRY + b"a", b"bc")) == {"a": b"abc"}


@pytest.mark.parametrize(("data", "match"), [
    (b"FB\x01", "shorter than its 7-byte header"),
    (b"XX\x01" + struct.pack("<I", 0), "bad bundle magic"),
    (b"FB\x03" + struct.pack("<I", 0), "unknown bundle version 3"),
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


_VALID = pack_bundle({"a": b"xyz", "b": b"\x00" * 10, "c": b""}, version=1)
# "a" a 1-D payload of 2 elements (raw codec, no params, 8 body bytes): a head of 17 bytes
_VALID2 = pack_bundle({"a": b"FE\x01\x00\x00\x00\x01" + b"\x02\x00\x00\x00" + b"\x00\x00" + b"\x08\x00\x00\x00"
                       + b"x" * 8, "b": b"\x00" * 10, "c": b""})


def _mutations(valid: bytes):
    return [
        st.tuples(st.integers(0, len(valid) - 1), st.integers(0, 255)).map(
            lambda t: valid[:t[0]] + bytes([t[1]]) + valid[t[0] + 1:]),
        st.integers(0, len(valid)).map(lambda n: valid[:n]),
        st.binary(max_size=16).map(lambda extra: valid + extra),
    ]


@settings(max_examples=3000, deadline=None, database=None, derandomize=True)
@given(st.one_of(st.binary(max_size=64), *_mutations(_VALID), *_mutations(_VALID2)))
def test_fuzz_only_malformed_payload_error(data):
    try:
        out = unpack_bundle(data)
    except MalformedPayloadError:
        return
    assert isinstance(out, dict)
    if data[2] == 1:  # version 1 holds its payloads as they are
        assert sum(map(len, out.values())) <= len(data)


_META = zlib.decompress(_VALID2[7:7 + struct.unpack_from("<I", _VALID2, 3)[0]])
_TAILS = _VALID2[7 + struct.unpack_from("<I", _VALID2, 3)[0]:]


@settings(max_examples=3000, deadline=None, database=None, derandomize=True)
@given(st.one_of(*_mutations(_META)), st.one_of(st.just(_TAILS), *_mutations(_TAILS)))
def test_fuzz_version_2_metadata_only_malformed_payload_error(meta, tails):
    """The metadata mutated before it is deflated, so that the parser behind zlib is
    reached; a bundle that reads gives payloads of exactly the announced lengths."""
    data = _v2(meta, tails)
    try:
        out = unpack_bundle(data)
    except MalformedPayloadError:
        return
    assert sum(map(len, out.values())) == len(tails) + sum(
        struct.unpack_from("<H", meta, off)[0] for off in _head_offsets(meta))


def _head_offsets(meta: bytes) -> list[int]:
    (count,) = struct.unpack_from("<I", meta, 0)
    off, heads = 4, []
    for _ in range(count):
        (nlen,) = struct.unpack_from("<H", meta, off)
        off += 2 + nlen + 4
        heads.append(off)
        off += 2
    return heads


def test_a_bundle_whose_names_would_not_read_back_is_not_written():
    with pytest.raises(ValueError, match="write version 1"):
        pack_bundle({f"{i:05d}" + "n" * 65000: b"" for i in range(1100)})
    assert len(unpack_bundle(pack_bundle({f"{i:05d}" + "n" * 65000: b"" for i in range(1100)}, version=1))) == 1100


def test_the_bundle_vectors_read_back_their_payloads_and_version_1_rewrites_byte_for_byte():
    """tests/compress/vectors/bundle_v1.bin and bundle_v2.bin (make_vectors.py): what
    another implementation checks its reader against."""
    import hashlib
    import json
    from pathlib import Path

    vectors = Path(__file__).parent / "vectors"
    bundles = json.loads((vectors / "index.json").read_text())["bundles"]
    assert [b["version"] for b in bundles] == [1, 2]
    for b in bundles:
        blob = (vectors / f"{b['name']}.bin").read_bytes()
        assert len(blob) == b["bytes"] and hashlib.sha256(blob).hexdigest() == b["sha256"]
        assert blob[2] == b["version"]
        payloads = {e["tensor"]: (vectors / e["payload"]).read_bytes() for e in b["entries"]}
        assert unpack_bundle(blob) == payloads and list(unpack_bundle(blob)) == list(payloads)
        # Version 1 has one encoding; version 2's zlib stream may differ between zlib builds.
        again = pack_bundle(payloads, version=b["version"])
        assert unpack_bundle(again) == payloads
        if b["version"] == 1:
            assert again == blob
    assert bundles[1]["bytes"] < bundles[0]["bytes"]
