"""Write the wire-format test vectors into tests/compress/vectors/ (see its README).

Run from the repository root: ``python tests/compress/make_vectors.py``. Deterministic:
inputs come from seeded local generators, encodings use ``torch.Generator().manual_seed(seed)``.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from fededge.compress import build_codec, decode_any, unpack
from fededge.compress.bundle import pack_bundle

OUT = Path(__file__).parent / "vectors"

#: (vector name, codec, params, input shape, input scale, seed)
CASES = [
    ("raw", "raw", {}, (4, 8), 1.0, 1),
    ("raw_zlib", "raw", {"lossless": True}, (64,), 0.0, 2),
    ("fp16", "fp16", {}, (4, 8), 1.0, 3),
    ("bf16", "bf16", {}, (4, 8), 1.0, 4),
    ("int8", "int8", {}, (4, 8), 1.0, 5),
    ("int8_block_stochastic", "int8", {"block": 8, "stochastic": True}, (3, 7), 1.0, 6),
    ("qsgd_s16", "qsgd", {"levels": 16}, (4, 8), 1.0, 7),
    ("qsgd_s3_zlib", "qsgd", {"levels": 3, "lossless": True}, (37,), 1.0, 8),
    ("qsgd_s4_bucket8", "qsgd", {"levels": 4, "bucket": 8}, (3, 7), 1.0, 21),  # 3 norms, last bucket of 5
    ("qsgd_s16_bucket0", "qsgd", {"levels": 16, "bucket": 0}, (4, 8), 1.0, 22),  # one norm per tensor
    ("terngrad", "terngrad", {}, (4, 8), 1.0, 9),
    ("onebit_matrix", "onebit", {}, (6, 5), 1.0, 10),
    ("onebit_vector", "onebit", {}, (13,), 1.0, 11),
    ("signsgd", "signsgd", {}, (4, 8), 1.0, 12),
    ("threshold_bitmap", "threshold", {"tau": 0.7}, (4, 8), 1.0, 13),
    ("threshold_varint", "threshold", {"tau": 2.0}, (300,), 1.0, 14),
    ("topk_bitmap", "topk", {"ratio": 0.5}, (4, 8), 1.0, 15),
    ("topk_varint", "topk", {"ratio": 0.02}, (10, 30), 1.0, 16),
    ("randk_varint", "randk", {"ratio": 0.02}, (300,), 1.0, 17),
    ("randk_bitmap", "randk", {"ratio": 0.3}, (2, 2, 5), 1.0, 18),
    ("topk_fp16_values", "topk", {"ratio": 0.25, "values": "fp16"}, (4, 8), 1.0, 23),
    ("randk_bf16_values", "randk", {"ratio": 0.1, "values": "bf16"}, (50,), 1.0, 24),
    ("powersgd_r2", "powersgd", {"rank": 2}, (6, 2, 3), 1.0, 19),
    ("powersgd_full_rank", "powersgd", {"rank": 3}, (3, 4), 1.0, 20),
]


#: A bundle's entries (docs/wire-format.md, "Bundles"): tensor name -> the vector whose
#: payload it holds (a sparse, a low-rank, a raw, a cast and a zlib payload).
BUNDLE_ENTRIES = [
    ("conv1.weight", "topk_varint"),
    ("layer1.0.conv1.weight", "powersgd_r2"),
    ("layer1.0.bn1.weight", "raw"),
    ("fc.bias", "fp16"),
    ("zlib.weight", "qsgd_s3_zlib"),
]


def main() -> None:
    OUT.mkdir(exist_ok=True)
    for f in OUT.glob("*.f32"):
        f.unlink()
    for f in OUT.glob("*.bin"):
        f.unlink()
    index = []
    for name, codec, params, shape, scale, seed in CASES:
        x = torch.randn(shape, generator=torch.Generator().manual_seed(1000 + seed)) * scale
        payload = build_codec(codec, **params).encode(x, generator=torch.Generator().manual_seed(seed))
        decoded = decode_any(payload)
        (OUT / f"{name}.input.f32").write_bytes(x.numpy().astype("<f4").tobytes())
        (OUT / f"{name}.payload.bin").write_bytes(payload)
        (OUT / f"{name}.decoded.f32").write_bytes(decoded.numpy().astype("<f4").tobytes())
        header, body = unpack(payload)
        index.append({
            "name": name, "codec": codec, "params": params, "shape": list(shape), "seed": seed,
            "payload_bytes": len(payload), "body_bytes": len(body),
            "payload_sha256": hashlib.sha256(payload).hexdigest(),
        })
    bundles = []
    payloads = {tensor: (OUT / f"{vector}.payload.bin").read_bytes() for tensor, vector in BUNDLE_ENTRIES}
    for version in (1, 2):
        blob = pack_bundle(payloads, version=version)
        (OUT / f"bundle_v{version}.bin").write_bytes(blob)
        bundles.append({"name": f"bundle_v{version}", "version": version, "bytes": len(blob),
                        "sha256": hashlib.sha256(blob).hexdigest(),
                        "entries": [{"tensor": t, "payload": f"{v}.payload.bin"} for t, v in BUNDLE_ENTRIES]})
    doc = {
        "format": "fededge wire format version 1; arrays are little-endian float32, row-major",
        "files": "NAME.input.f32 (encoder input), NAME.payload.bin, NAME.decoded.f32 (expected decode); "
                 "bundle_vN.bin: a bundle of version N of the payloads its entries name",
        "vectors": index,
        "bundles": bundles,
    }
    (OUT / "index.json").write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {len(index)} vectors and {len(bundles)} bundles to {OUT}")


if __name__ == "__main__":
    main()
