"""Client mods: Flower's hook around the ClientApp's functions.

:func:`compression_mod` turns a train reply into a compressed update. It keeps the
delta from the weights the client received, encoded tensor by tensor, with the encoder's
state (residuals, PowerSGD's Q, DGC's buffers) in ``context.state``. The compressed
payloads travel in a record named ``compressed`` instead of ``arrays``, so a server
without :class:`fededge.strategies.compressed.Compressed` fails loudly rather than
averaging bytes. The arithmetic is :mod:`fededge.compress.update`.
"""

from __future__ import annotations

import time

import numpy as np
from flwr.app import Array, ArrayRecord, Context, Message, RecordDict
from flwr.clientapp.typing import ClientAppCallable

from fededge import keys
from fededge.compress.bundle import pack_bundle, unpack_bundle
from fededge.compress.update import UpdateEncoder
from fededge.config import RunConfig

__all__ = ["bundle_record", "compression_mod", "decode_downlink", "BUNDLE", "COMPRESSED",
           "COMPRESSED_DOWN", "UNCOMPRESSED"]

COMPRESSED = "compressed"  # record holding one uint8 array: the bundle of wire payloads
COMPRESSED_DOWN = "compressed-down"  # the same, for the model the server broadcasts
BUNDLE = "bundle"  # the array's name in those records
UNCOMPRESSED = "arrays-uncompressed"  # non-float tensors (BatchNorm's counters), as they are
STATE_KEY = "fededge.compress"


def bundle_record(payloads: dict[str, bytes]) -> ArrayRecord:
    """Every payload in one uint8 array: Flower's per-object framing is paid once."""
    return ArrayRecord({BUNDLE: Array(np.frombuffer(pack_bundle(payloads), dtype=np.uint8))})


def decode_downlink(content: RecordDict) -> RecordDict:
    """A message content whose model came compressed -> the same with ``arrays``."""
    from fededge.compress import decode_any

    payloads = unpack_bundle(content[COMPRESSED_DOWN][BUNDLE].numpy().tobytes())
    arrays = {k: decode_any(p).numpy() for k, p in payloads.items()}
    if UNCOMPRESSED in content:
        arrays.update({k: v.numpy() for k, v in content[UNCOMPRESSED].to_torch_state_dict().items()})
    out = RecordDict({keys.ARRAYS: ArrayRecord({k: Array(v) for k, v in arrays.items()})})
    for name in content.keys():
        if name not in (COMPRESSED_DOWN, UNCOMPRESSED):
            out[name] = content[name]
    return out


def compression_mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """Decode a compressed downlink model; compress the reply of a train message when the
    run config names a compressor."""
    if COMPRESSED_DOWN in msg.content:
        msg.content = decode_downlink(msg.content)
    reply = call_next(msg, context)
    if not msg.metadata.message_type.startswith("train") or reply.has_error():
        return reply
    cfg = RunConfig.from_mapping(context.run_config)
    if cfg.compressor == "none":
        return reply
    t0 = time.perf_counter()
    received = msg.content[keys.ARRAYS].to_torch_state_dict()
    trained = reply.content[keys.ARRAYS].to_torch_state_dict()
    delta, raw = {}, {}
    for name, new in trained.items():
        if new.is_floating_point():
            delta[name] = new.float() - received[name].float()
        else:
            raw[name] = new
    pid = int(context.node_config.get(keys.PARTITION_ID, 0))
    encoder = UpdateEncoder(cfg.update_config(), stream=pid)
    if STATE_KEY in context.state:
        encoder.load_state_dict(context.state[STATE_KEY].to_torch_state_dict())
    rnd = int(msg.content[keys.CONFIG].get(keys.SERVER_ROUND, 1)) if keys.CONFIG in msg.content else 1
    payloads = encoder.encode(delta, round=rnd - 1)
    state = encoder.state_dict()
    if state:
        context.state[STATE_KEY] = ArrayRecord({k: Array(v.numpy()) for k, v in state.items()})
    content = RecordDict({
        COMPRESSED: bundle_record(payloads),
        keys.METRICS: reply.content[keys.METRICS],
    })
    if raw:
        content[UNCOMPRESSED] = ArrayRecord({k: Array(v.numpy()) for k, v in raw.items()})
    # Encoding is the client's work too: it counts in the compute the clock sees.
    metrics = content[keys.METRICS]
    if keys.COMPUTE_S in metrics:
        metrics[keys.COMPUTE_S] = float(metrics[keys.COMPUTE_S]) + (time.perf_counter() - t0)
    reply.content = content
    return reply

