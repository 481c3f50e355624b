"""Client mods: Flower's hook around the ClientApp's functions.

:func:`compression_mod` turns a train reply into a compressed update. It keeps the
delta from the weights the client received, encoded tensor by tensor, with the encoder's
state (residuals, PowerSGD's Q, DGC's buffers) in ``context.state``. The compressed
payloads travel in a record named ``compressed`` instead of ``arrays``, so a server
without :class:`fededge.strategies.compressed.Compressed` fails loudly rather than
averaging bytes. The arithmetic is :mod:`fededge.compress.update`.

:func:`config_error_mod` answers a message the client cannot run because of its
configuration with a named error reply, which stops the run on the server.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, Context, Error, Message, RecordDict
from flwr.clientapp.typing import ClientAppCallable

from fededge import keys
from fededge.compress.bundle import pack_bundle, unpack_bundle
from fededge.compress.update import UpdateEncoder, decode_update
from fededge.config import ConfigError, RunConfig
from fededge.data.partition import PartitionError

__all__ = ["bundle_payloads", "bundle_record", "compression_mod", "config_error_mod", "decode_downlink",
           "decode_update_record", "BUNDLE", "COMPRESSED", "COMPRESSED_DOWN", "UNCOMPRESSED"]

log = logging.getLogger(__name__)

#: ``flwr.common.constant.ErrorCode.CLIENT_APP_RAISED_EXCEPTION`` (not public API): the
#: code Flower's runtimes give a reply whose ClientApp raised.
CLIENT_APP_RAISED_EXCEPTION = 2

COMPRESSED = "compressed"  # record holding one uint8 array: the bundle of wire payloads
COMPRESSED_DOWN = "compressed-down"  # the same, for the model the server broadcasts
BUNDLE = "bundle"  # the array's name in those records
UNCOMPRESSED = "arrays-uncompressed"  # non-float tensors (BatchNorm's counters), as they are
STATE_KEY = "fededge.compress"


def bundle_record(payloads: dict[str, bytes]) -> ArrayRecord:
    """Every payload in one uint8 array: Flower's per-object framing is paid once."""
    return ArrayRecord({BUNDLE: Array(np.frombuffer(pack_bundle(payloads), dtype=np.uint8))})


def bundle_payloads(record: ArrayRecord) -> dict[str, bytes]:
    """The payloads :func:`bundle_record` packed."""
    return unpack_bundle(record[BUNDLE].numpy().tobytes())


def decode_update_record(record: ArrayRecord, *, max_elements: int) -> dict[str, torch.Tensor]:
    """An update record (a :func:`bundle_record` of wire payloads, or raw float arrays)
    -> its tensors."""
    if list(record.keys()) == [BUNDLE]:
        return decode_update(bundle_payloads(record), max_elements=max_elements)
    return dict(record.to_torch_state_dict())


def decode_downlink(content: RecordDict) -> RecordDict:
    """A message content whose model came compressed -> the same with ``arrays``."""
    from fededge.compress import decode_any

    payloads = bundle_payloads(content[COMPRESSED_DOWN])
    arrays = {k: decode_any(p).numpy() for k, p in payloads.items()}
    if UNCOMPRESSED in content:
        arrays.update({k: v.numpy() for k, v in content[UNCOMPRESSED].to_torch_state_dict().items()})
    out = RecordDict({keys.ARRAYS: ArrayRecord({k: Array(v) for k, v in arrays.items()})})
    for name in content.keys():
        if name not in (COMPRESSED_DOWN, UNCOMPRESSED):
            out[name] = content[name]
    return out


def _dga_round_delta(msg: Message, context: Context) -> dict[str, torch.Tensor] | None:
    """For a DGA train message: the client's change Δ(t) over this round's K steps.

    A DGA reply is ``G(g) + Δ(t)``, and the message may carry no arrays (the client
    already holds G(g)), so the update to compress is Δ(t) itself, which the DGA state
    keeps in flight (``inflight/t/...``). None for any other message."""
    conf = msg.content[keys.CONFIG] if keys.CONFIG in msg.content else None
    if conf is None or keys.DGA_GLOBAL_ROUND not in conf or keys.STATE_DGA not in context.state:
        return None
    prefix = f"inflight/{int(conf[keys.SERVER_ROUND])}/"
    state = context.state[keys.STATE_DGA]  # only this round's arrays, not the model and older rounds
    return {k[len(prefix):]: torch.from_numpy(state[k].numpy()) for k in state.keys() if k.startswith(prefix)}


def compression_mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """Decode a compressed downlink model; compress the reply of a train message when the
    run config names a compressor."""
    if COMPRESSED_DOWN in msg.content:
        msg.content = decode_downlink(msg.content)
    reply = call_next(msg, context)
    if not msg.metadata.message_type.startswith("train") or reply.has_error():
        return reply
    cfg = RunConfig.from_mapping(context.run_config)
    if cfg.compressor == "none" or keys.ARRAYS not in reply.content:
        # No model weights in the reply (a gossip message, already encoded by its own
        # path): nothing to take a delta of.
        return reply
    t0 = time.perf_counter()
    trained = reply.content[keys.ARRAYS].to_torch_state_dict()
    own = _dga_round_delta(msg, context)
    received = msg.content[keys.ARRAYS].to_torch_state_dict() if own is None else {}
    delta, raw = {}, {}
    for name, new in trained.items():
        if not new.is_floating_point():
            raw[name] = new
        elif own is not None:  # DGA: its own K-step change, the reply minus G(g)
            delta[name] = own[name].float()
        else:
            delta[name] = new.float() - received[name].float()
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


def config_error_mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """Turn a configuration error of this client into an error reply the server recognises.

    A :class:`~fededge.config.ConfigError` (a run config, node config or data split that
    cannot work) or the partitioner's :class:`~fededge.data.PartitionError` raised while
    handling ``msg`` becomes an error reply whose reason starts with
    ``keys.CONFIG_ERROR``. :class:`fededge.server.metering.MeteredGrid` stops the run on
    it with the client's message: every later round would fail the same way, so counting
    it as one more failed client per round would only delay the news. Any other
    exception passes through, and the runtime turns it into an ordinary failure.

    No traceback is logged (a configuration error is not a bug) and the client logs it
    at DEBUG only: the server reports it, naming the node.

    Examples
    --------
    >>> app = ClientApp(mods=[config_error_mod])  # doctest: +SKIP
    """
    try:
        return call_next(msg, context)
    except (ConfigError, PartitionError) as err:
        log.debug("configuration error, replied to the server: %s", err)
        return Message(Error(code=CLIENT_APP_RAISED_EXCEPTION, reason=f"{keys.CONFIG_ERROR}: {err}"),
                       reply_to=msg)
