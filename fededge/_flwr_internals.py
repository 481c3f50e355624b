"""Every use of Flower's private internals, in one place.

fededge measures bytes on the wire the way Flower serialises a message, and its
in-process runtime stands in for the SuperLink. Both need pieces of Flower that are not
public API. They are imported here and nowhere else. :func:`check` verifies them, and a
test calls it, so that a Flower upgrade that moves or changes one fails loudly with
the internal's name rather than producing wrong byte counts.

Internals used (checked against flwr 1.41):

- ``flwr.supercore.inflatable.inflatable_object.get_all_nested_objects``: the object
  tree of a Message. Since flwr 1.20 a message travels as content-addressed objects,
  and each unique object's ``deflate()`` bytes is what is pushed or pulled.
- ``flwr.supercore.inflatable.inflatable_object.no_object_id_recompute``: computes each
  object's id once while a message is serialised, as Flower's own runtimes do
  (``HttpGrid.push_messages``, the SuperNode): without it an object's id is recomputed
  by every ancestor, about 30 ``deflate()`` calls per object of a training message.
- ``flwr.supercore.inflatable.inflatable_utils.inflate_object_from_contents``: rebuild a
  Message from those bytes (the receiving side of the in-process transport).
- ``flwr.supercore.task_identity.TaskIdentity``: process-global run/node/task ids that
  ``Message(...)`` reads when the ServerApp creates an instruction message.
- ``Metadata.__dict__["_message_id"]`` / ``["_run_id"]``: set by the SuperLink in a real
  deployment; Flower's own grids set them the same way.
- ``flwr.supercore.run.Run``: what ``Grid.run`` returns.
- ``flwr.superlink.grid.http_grid.HttpGrid`` / ``inmemory_grid.InMemoryGrid``: which
  runtime a ServerApp's Grid belongs to (a deployment runs each node's messages in
  order; Ray simulation may run two at once), for strategies that push rounds ahead,
  and for the server's check of the clients' data split, done in simulation only; and
  whether replies arrive in real time (a SuperLink), for the asynchronous strategies.
- ``flwr.serverapp.strategy.strategy_utils.sample_nodes`` / ``aggregate_arrayrecords``:
  the node sampling (wait for ``min_available_nodes``, then ``random.sample``) and the
  weighted average Flower's own strategies use, for the strategies with their own round
  loop (DGA, gossip, the asynchronous ones), so that they sample and average as FedAvg does.
  ``flwr.serverapp.strategy.fedavg.aggregate_arrayrecords`` (the name FedAvg and every
  strategy built on it call): :func:`fast_average` points it, for the length of a run, at
  :func:`average_arrayrecords`, the same arithmetic on the same bytes without a
  ``np.load``/``np.save`` per array.
- ``flwr.clientapp.typing.ClientAppCallable`` / ``Mod``: the signatures of a ClientApp
  callable and of a client mod (annotations of fededge's mods).
- For the in-process runtime's direct delivery (:func:`detached_copy`,
  :func:`direct_wire_size`): ``flwr.app.message.message.make_message`` (a Message from
  metadata, content and error), ``flwr.app.message.arraychunk.ArrayChunk``,
  ``flwr.app.message.array.FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE`` (how an Array's bytes are
  cut into chunks), an Array's cached chunks (``__dict__["_chunks"]``), the object-id
  cache of ``no_object_id_recompute`` (``_get_computed_object_ids``), the object
  header's format (``add_header_to_object_body``), and ``get_object_id`` (an object's id
  is the hash of its ``deflate()`` bytes: each object is deflated once, for its id and
  its size together).
"""

from __future__ import annotations

import importlib
import threading
import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

__all__ = [
    "ClientAppCallable",
    "Mod",
    "FlowerInternalsChanged",
    "aggregate_arrayrecords",
    "aggregate_metricrecords",
    "average_arrayrecords",
    "check",
    "fast_average",
    "message_objects",
    "serialise",
    "serialise_all",
    "message_from_objects",
    "recorddict_from_objects",
    "recorddict_to_objects",
    "set_message_id",
    "set_run_id",
    "task_identity",
    "empty_run",
    "is_deployment",
    "is_flower_simulation",
    "runs_messages_in_order",
    "sample_nodes",
    "note_wire_size",
    "take_noted_wire_size",
    "remember_counted_size",
    "counted_wire_size",
    "wire_size",
    "wire_sizes",
    "detached_copy",
    "direct_wire_size",
    "direct_wire_split",
    "message_own_bytes",
]


class FlowerInternalsChanged(RuntimeError):
    """A Flower internal fededge relies on has moved or changed.

    The message names the internal. Pin flwr to a tested version (see constraints.txt)
    or update ``fededge/_flwr_internals.py``.
    """


def _fail(name: str, err: BaseException) -> FlowerInternalsChanged:
    import flwr

    return FlowerInternalsChanged(
        f"Flower internal '{name}' is not as fededge expects in flwr {flwr.__version__}: "
        f"{type(err).__name__}: {err}. fededge was tested with flwr 1.41; update "
        "fededge/_flwr_internals.py or install flwr==1.41.0."
    )


# Every import of a Flower internal, in one block: one that moved fails here, named (the
# ImportError says which name of which module; ``e.name`` is the module).
try:
    from flwr.clientapp.typing import ClientAppCallable, Mod
    from flwr.serverapp.strategy import fedavg as _fedavg_module
    from flwr.serverapp.strategy.fedavg import aggregate_arrayrecords as _flower_fedavg_average
    from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords, aggregate_metricrecords, sample_nodes
    from flwr.app.message import array as _array_module
    from flwr.app.message.arraychunk import ArrayChunk
    from flwr.app.message.message import make_message
    from flwr.supercore.inflatable.inflatable_object import (_get_computed_object_ids, add_header_to_object_body,
                                                             get_all_nested_objects, get_object_id,
                                                             no_object_id_recompute)
    from flwr.supercore.inflatable.inflatable_utils import inflate_object_from_contents
    from flwr.supercore.run import Run
    from flwr.supercore.task_identity import TaskIdentity
except ImportError as e:  # exercised by a test that hides one module
    raise _fail(e.name or "a flwr module", e) from e

from flwr.app import Message, RecordDict


def serialise_all(objs: Iterable[Message | Any]) -> list[tuple[str, dict[str, bytes]]]:
    """Each of ``objs`` (Messages or RecordDicts) as the serialised objects it travels
    as: its root object id and object id -> bytes, children before parents.

    Each object's id is computed once, inside Flower's ``no_object_id_recompute`` (as its
    own runtimes serialise), instead of once per ancestor; an object shared by several
    of ``objs`` (the model a round broadcasts) is hashed and deflated once for all of
    them. Ids cached by an earlier computation are dropped first: inside that context
    Flower trusts a cached id that another object of the tree also has, which a record
    changed since (a ConfigRecord tracks no changes) could otherwise carry. Nothing may
    change ``objs`` meanwhile (the call holds no lock)."""
    return _deflated(objs, {}, sizes=False)


def _deflated(objs: Iterable[Any], done: dict[str, Any], *, sizes: bool) -> list[tuple[str, dict[str, Any]]]:
    """:func:`serialise_all`, or with each object's size instead of its bytes
    (``sizes``); ``done`` (object id -> bytes or size) is filled and reused: equal ids,
    equal bytes."""
    objs = list(objs)
    for obj in objs:
        _forget_ids(obj)
    out = []
    with no_object_id_recompute():
        for obj in objs:
            objects = {}
            for oid, o in get_all_nested_objects(obj).items():
                value = done.get(oid)
                if value is None:
                    data = o.deflate()
                    value = done[oid] = len(data) if sizes else data
                objects[oid] = value
            out.append((obj.object_id, objects))
    return out


def serialise(obj: Message | Any) -> tuple[str, dict[str, bytes]]:
    """:func:`serialise_all` of one object."""
    return serialise_all([obj])[0]


def _forget_ids(obj: Any) -> None:
    """Drop the object ids cached on ``obj`` and its records (an Array drops its own
    when it changes; its chunks are its data's)."""
    obj.__dict__.pop("_object_id", None)
    if isinstance(obj, Message):
        if obj.has_content():
            _forget_ids(obj.content)
    elif isinstance(obj, RecordDict):
        for value in obj.values():  # records; an ArrayRecord's Arrays keep theirs
            _forget_ids(value)


def message_objects(msg: Message) -> dict[str, bytes]:
    """The serialised objects a Message travels as: object id -> bytes.

    Identical objects inside one message (two equal array chunks) appear once, as on
    the wire. ``sum(map(len, ...))`` is the message's size on the wire, less the few
    tens of bytes of the transport's own request framing.
    """
    return serialise(msg)[1]


def wire_sizes(msgs: Iterable[Message | Any], cache: dict[str, int] | None = None) -> list[int]:
    """Bytes of each of ``msgs`` (Messages, or records) on Flower's wire: the sum of its
    unique serialised objects. An object shared by several (a broadcast model) is
    serialised once; ``cache`` (object id -> size) carries that across calls."""
    return [sum(objects.values()) for _, objects in _deflated(msgs, {} if cache is None else cache, sizes=True)]


def wire_size(msg: Message | Any, cache: dict[str, int] | None = None) -> int:
    """Bytes of ``msg`` (a Message, or one of its records) on Flower's wire: the sum of
    its unique serialised objects. ``cache`` maps object ids to sizes, so a model
    broadcast in ten messages is serialised once for counting."""
    return wire_sizes([msg], cache)[0]


def average_arrayrecords(records: list[RecordDict], weighting_metric_name: str) -> Any:
    """Flower's ``aggregate_arrayrecords``, bit for bit: the same weights, the same
    float operations in the same order, the same bytes out. Each ``Array`` is read and
    written with :mod:`fededge.arrays` (a ``.npy`` header parsed once per shape) instead
    of ``np.load``/``np.save``: on 100 replies of a small model, most of the average's
    time."""
    from flwr.app import ArrayRecord

    from fededge.arrays import to_numpy

    weights = [next(iter(r.metric_records.values()))[weighting_metric_name] for r in records]  # as Flower: raw
    total = sum(weights)
    factors = [w / total for w in weights]
    out: dict[str, Any] = {}
    # Each array is read in place (no copy of its bytes), and each product goes to one
    # buffer per key, reused while the arrays' dtype and shape are the first's (then the
    # product's dtype is too): the same operations, without allocating a model per reply.
    # A key whose first array is a float TensorArray (a GPU reply handed over in this
    # process) is averaged with torch on that array's device: the same float operations
    # (a product by the factor rounded to the dtype, then a sum, in the same order),
    # so the same bits, without bringing the models to the host.
    scratch: dict[str, tuple[Any, Any]] = {}  # key -> (the arrays' dtype, the product buffer)
    for record, factor in zip(records, factors, strict=True):
        for arrays in record.array_records.values():
            for key, value in arrays.items():
                if key not in out:
                    t = _float_tensor(value)
                    out[key] = t * factor if t is not None else to_numpy(value, copy=False) * factor
                    continue
                if not isinstance(out[key], np.ndarray) and not isinstance(out[key], np.generic):
                    _add_product_torch(out[key], value, factor, scratch, key)
                    continue
                v = to_numpy(value, copy=False)
                dtype, buf = scratch.get(key, (None, None))
                if buf is not None and v.dtype == dtype and v.shape == buf.shape:
                    out[key] += np.multiply(v, factor, out=buf)
                else:
                    product = v * factor
                    if isinstance(product, np.ndarray):  # a 0-d array's product is a numpy scalar
                        scratch[key] = (v.dtype, product)
                    out[key] += product
    averaged = ArrayRecord()  # item by item: ArrayRecord(dict) would rebuild each Array from its bytes
    for k, v in out.items():
        averaged[k] = _array_of_average(v)
    return averaged


def _float_tensor(value: Any) -> Any:
    """The tensor of a TensorArray of float32 or float64 with at least one dimension
    (the dtypes whose products by a Python float numpy and torch compute alike), else
    None."""
    import torch

    from fededge.arrays import TensorArray

    if not isinstance(value, TensorArray) or value.tensor is None:
        return None
    t = value.tensor
    return t if t.dtype in (torch.float32, torch.float64) and t.dim() > 0 else None


def _add_product_torch(acc: Any, value: Any, factor: float, scratch: dict[str, tuple[Any, Any]], key: str) -> None:
    """``acc += value * factor`` on ``acc``'s device, as numpy does it: a TensorArray of
    ``acc``'s device, dtype and shape with torch (the same float operations), anything
    else by numpy's own product (its promotion rules: an integer array times a Python
    float is float64, a float16 one float16), then added as numpy adds into ``acc``."""
    import torch

    from fededge.arrays import to_numpy

    t = _float_tensor(value)
    if t is None or t.device != acc.device or t.dtype != acc.dtype or t.shape != acc.shape:
        product = torch.from_numpy(np.asarray(to_numpy(value, copy=False) * factor)).to(acc.device)
        if product.dtype == acc.dtype and product.shape == acc.shape:
            acc += product
        else:  # numpy adds in the wider dtype and casts back into the accumulator
            acc.copy_(acc + product)
        return
    _, buf = scratch.get(key, (None, None))
    if buf is None:
        buf = torch.empty_like(acc)
        scratch[key] = (acc.dtype, buf)
    acc += torch.mul(t, factor, out=buf)


def _array_of_average(v: Any) -> Any:
    """The Array of an averaged value: a TensorArray for a tensor (it stays where it is),
    else Flower's bytes (:func:`~fededge.arrays.from_numpy`)."""
    from fededge.arrays import _resident_header, from_numpy, kept_on_device

    if isinstance(v, np.ndarray) or isinstance(v, np.generic):
        return from_numpy(np.asarray(v))
    made = _resident_header(v)
    if made is None:  # a header not yet checked against Flower's: once through the host
        return from_numpy(v.cpu().numpy())
    return kept_on_device(v, *made)


_fast_lock = threading.Lock()
_fast_users = 0


@contextmanager
def fast_average() -> Iterator[None]:
    """For the length of the block, FedAvg (and the Flower strategies built on it that
    call its name: FedAdam, FedProx, ...) averages with :func:`average_arrayrecords`;
    Flower's own function is put back when the last such block (of any thread) ends,
    whatever happens. Where the name is someone else's patch, it is left alone. The
    results are the same bit for bit; only the time differs."""
    global _fast_users
    with _fast_lock:
        _fast_users += 1
        if _fedavg_module.aggregate_arrayrecords is _flower_fedavg_average:  # not someone else's patch
            _fedavg_module.aggregate_arrayrecords = average_arrayrecords
    try:
        yield
    finally:
        with _fast_lock:
            _fast_users -= 1
            if not _fast_users and _fedavg_module.aggregate_arrayrecords is average_arrayrecords:
                _fedavg_module.aggregate_arrayrecords = _flower_fedavg_average


# -- direct delivery: a message handed over as a copy, its size on the wire computed ----

def detached_copy(msg: Message) -> Message:
    """A copy of ``msg`` that shares nothing mutable with it: new metadata, content,
    records and Arrays; only the Arrays' bytes (immutable) are shared. What the other
    side of a transport gets, without serialising and rebuilding 45 MB per message
    (the in-process runtime's direct delivery). Error messages are copied too."""
    import copy

    from flwr.app import Array, ArrayRecord, ConfigRecord, Error, MetricRecord

    from fededge.arrays import TensorArray

    def array(a: Any) -> Any:
        if isinstance(a, TensorArray):
            return a.shared()  # the same tensor (never written) and bytes, if made
        data = a.data if isinstance(a.data, bytes) else bytes(a.data)
        return Array(dtype=a.dtype, shape=tuple(a.shape), stype=a.stype, data=data)

    def plain(v: Any) -> Any:  # as the wire gives it back: numpy scalars and subclasses as Python's own
        if isinstance(v, list):
            return [plain(x) for x in v]
        if isinstance(v, np.generic):
            return v.item()
        for kind in (bool, int, float, str, bytes):
            if isinstance(v, kind):
                return kind(v)
        return v

    def record(r: Any) -> Any:
        if isinstance(r, ArrayRecord):
            out = ArrayRecord()  # item by item: ArrayRecord(dict) would rebuild each Array from its bytes
            for k, a in r.items():
                out[k] = array(a)
            return out
        if isinstance(r, (ConfigRecord, MetricRecord)):
            return type(r)({k: plain(v) for k, v in r.items()})
        return copy.deepcopy(r)  # a record type of a later Flower: copied whole

    content = RecordDict({k: record(r) for k, r in msg.content.items()}) if msg.has_content() else None
    error = Error(int(msg.error.code), msg.error.reason or None) if msg.has_error() else None  # "" travels as None
    return make_message(metadata=copy.copy(msg.metadata), content=content, error=error)


def _direct_sizes(msg: Message) -> tuple[int, int]:
    """``(the message object's own bytes, all its bytes)`` on Flower's wire
    (:func:`direct_wire_size`, :func:`direct_wire_split`), without hashing or copying its
    arrays' data: the same numbers, from the format.

    An object's size does not depend on its id's value (a fixed 64 hex digits), only on
    which objects are equal (a message carries each distinct object once). So each
    array chunk gets a stand-in id, the same for chunks of equal bytes (compared, not
    hashed), and Flower's own ``deflate`` sizes every other object (message, records,
    arrays: small) with those ids in their headers; a chunk's size is its header's
    and its bytes'. Meant for a message no one else holds (a :func:`detached_copy`):
    its objects' cached ids and chunks are dropped before (an id cached by an earlier
    serialisation would count its object as another's equal) and after (so that a real
    serialisation later computes real ids)."""
    import hashlib

    from fededge.arrays import TensorArray

    arrays = [a for r in (msg.content.array_records.values() if msg.has_content() else ()) for a in r.values()]
    _forget_all(msg, arrays)
    step = _array_module.FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE
    # Each chunk as (array, start, end); a TensorArray's bytes are not made but for a
    # chunk whose length a chunk of a plain Array's shares (rare: then compared as bytes).
    spans = []
    for a in arrays:
        n = a.nbytes_on_wire() if isinstance(a, TensorArray) else len(a.data)
        spans.append([(a, start, min(start + step, n)) for start in range(0, n, step)])
    plain_lengths = {end - start for row in spans for a, start, end in row if not _bytes_unmade(a)}
    on_device_lengths = {end - start for row in spans for a, start, end in row if _bytes_unmade(a)}
    compare_on_device = on_device_lengths - plain_lengths
    classes_on_device = _device_chunk_classes(
        [c for row in spans for c in row if _bytes_unmade(c[0]) and c[2] - c[1] in compare_on_device])
    # chunks of equal length and fingerprint, compared byte for byte: (view, stand-in id) per class
    classes: dict[tuple[int, bytes], list[tuple[memoryview, str]]] = {}
    stand_in: dict[Any, str] = {}  # (length, class) of chunks compared on the device -> id
    distinct = 0  # stand-in ids made
    salt = hashlib.sha256(repr(id(msg)).encode()).hexdigest()

    def new_id() -> str:
        nonlocal distinct
        distinct += 1
        return hashlib.sha256(f"{salt}:{distinct - 1}".encode()).hexdigest()

    try:
        with no_object_id_recompute():
            known = _get_computed_object_ids()
            for a, row in zip(arrays, spans, strict=True):
                chunks = []
                for span in row:
                    _, start, end = span
                    if (end - start) in compare_on_device:
                        key = (end - start, classes_on_device[id(span)])
                        sid = stand_in.get(key)
                        if sid is None:
                            sid = stand_in[key] = new_id()
                        chunk = ArrayChunk(_Length(end - start))
                    else:
                        part = memoryview(a.data).cast("B")[start:end]
                        same = classes.setdefault((len(part), _fingerprint(part)), [])
                        sid = next((cid for other, cid in same if _equal(part, other)), None)
                        if sid is None:
                            sid = new_id()
                            same.append((part, sid))
                        chunk = ArrayChunk(part)
                    chunk.__dict__["_object_id"] = sid
                    known.add(sid)
                    chunks.append((sid, chunk))
                a.__dict__["_chunks"] = chunks
            return _sizes_once(msg, known)
    finally:
        _forget_all(msg, arrays)


def direct_wire_size(msg: Message) -> int:
    """The bytes ``msg`` takes on Flower's wire (:func:`wire_size`), without hashing or
    copying its arrays' data: the same number, from the format (:func:`_direct_sizes`)."""
    return _direct_sizes(msg)[1]


def direct_wire_split(msg: Message) -> tuple[int, int]:
    """:func:`direct_wire_size` in two parts: the message object's own bytes (its
    metadata, :func:`message_own_bytes`) and its content's (every record, array and
    chunk). Messages whose contents are the same record objects have the same second
    part: a grid pushing one model to many nodes sizes it once."""
    own, total = _direct_sizes(msg)
    return own, total - own


def message_own_bytes(msg: Message) -> int:
    """The bytes of ``msg``'s own object on the wire: its metadata and error, and its
    header, which names its content by id. An id is 64 hex digits whatever its value,
    so the content stands under a stand-in id here: its real one would hash the whole
    model (and make a GPU model's bytes)."""
    if not msg.has_content():
        return len(msg.deflate())
    content = msg.content
    before = content.__dict__.get("_object_id")
    stand_in = "0" * 64  # any 64 hex digits: only the id's length is in the message's bytes
    with no_object_id_recompute():
        _get_computed_object_ids().add(stand_in)
        content.__dict__["_object_id"] = stand_in
        try:
            return len(msg.deflate())
        finally:
            if before is None:
                content.__dict__.pop("_object_id", None)
            else:
                content.__dict__["_object_id"] = before


def _sizes_once(msg: Message, known: set[str]) -> tuple[int, int]:
    """``(msg``'s own object's bytes, the bytes of all its distinct objects)``
    (``get_all_nested_objects``' sum), each object deflated once: children before
    parents, each one's id (the hash of its bytes, what its ``object_id`` computes) set
    and added to ``known`` before its parent's ``deflate()`` asks for it. Its chunks
    already hold their stand-in ids. Config and metric records have no children (Flower
    1.41: their values are in their own bytes)."""
    from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord

    seen: set[str] = set()
    total = 0

    def visit(o: Any) -> int:
        nonlocal total
        if isinstance(o, ArrayChunk):
            sid = o.__dict__["_object_id"]
            if sid not in seen:
                seen.add(sid)
                total += _chunk_size(o)
            return 0
        if isinstance(o, Message):
            kids = [o.content] if o.has_content() else []
        elif isinstance(o, (RecordDict, ArrayRecord)):
            kids = list(o.values())
        elif isinstance(o, Array):
            kids = [c for _, c in o.__dict__["_chunks"]]
        elif isinstance(o, (ConfigRecord, MetricRecord)):
            kids = []
        else:  # an object type of a later Flower: its children as Flower lists them
            kids = list((o.children or {}).values())
        for kid in kids:
            visit(kid)
        body = o.deflate()
        oid = get_object_id(body)
        o.__dict__["_object_id"] = oid
        known.add(oid)
        if oid not in seen:
            seen.add(oid)
            total += len(body)
        return len(body)

    own = visit(msg)
    return own, total


class _Length:
    """The stand-in for a chunk's bytes not made (a :class:`~fededge.arrays.TensorArray`'s):
    only its length is read (:func:`_chunk_size`)."""

    __slots__ = ("n",)

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n


def _bytes_unmade(a: Any) -> bool:
    """Whether ``a`` is a TensorArray whose bytes are not made (its chunks are compared as
    tensors)."""
    from fededge.arrays import TensorArray

    return isinstance(a, TensorArray) and a.tensor is not None and a.__dict__["_data"] is None


def _device_chunk_classes(spans: list[tuple[Any, int, int]]) -> dict[int, Any]:
    """id(span) -> its class among the spans of its length: equal classes for equal
    bytes, exactly. A span's bytes are its TensorArray's ``.npy`` header followed by its
    tensor's bytes, from ``start`` to ``end``.

    As for chunks of bytes (:func:`_fingerprint`), spans of one length are first told
    apart by 32 bytes from four places: the places' tensor bytes are gathered on each
    tensor's device and brought to the host together, in one wait for the devices per
    message. Only spans that agree there (nearly always equal ones, such as fresh
    normalisation statistics) are compared whole (:func:`_equal_spans`: one wait each). A span alone in its
    length is compared with nothing."""
    import torch

    groups: dict[int, list[tuple[Any, int, int]]] = {}
    for span in spans:
        groups.setdefault(span[2] - span[1], []).append(span)
    several = [m for m in groups.values() if len(m) > 1]
    out: dict[int, Any] = {id(m[0]): 0 for m in groups.values() if len(m) == 1}
    if not several:
        return out
    # the four places of each span (8 bytes or fewer each), as (header bytes, tensor bytes)
    places: list[list[tuple[bytes, Any]]] = []
    gathers: dict[Any, list[Any]] = {}  # device -> index tensors' results, in order
    wanted: list[tuple[Any, int]] = []  # per place with tensor bytes: (device, how many)
    for members in several:
        for a, start, end in members:
            n = end - start
            spots = sorted({0, n // 3, 2 * n // 3, max(n - 8, 0)})
            places.append([_span_parts(a, start + p, start + p + min(8, n - p)) for p in spots])
            for _, body in places[-1]:
                if body.numel():
                    gathers.setdefault(body.device, []).append(body)
                    wanted.append((body.device, body.numel()))
    host = {d: torch.cat(parts).cpu().numpy().tobytes() if parts else b"" for d, parts in gathers.items()}
    offsets = {d: 0 for d in host}
    pieces = []
    for device, length in wanted:  # gathers[device] are in the order of wanted's entries for it
        pieces.append(host[device][offsets[device]:offsets[device] + length])
        offsets[device] += length
    pieces_iter = iter(pieces)
    place_iter = iter(places)
    for number, members in enumerate(several):
        classes: dict[bytes, list[tuple[Any, int, int]]] = {}
        for span in members:
            fingerprint = [head + (next(pieces_iter) if body.numel() else b"") for head, body in next(place_iter)]
            classes.setdefault(b"".join(fingerprint), []).append(span)
        for fp_number, alike in enumerate(classes.values()):
            for span, cls in zip(alike, _equal_spans(alike), strict=True):
                out[id(span)] = (number, fp_number, cls)
    return out


def _equal_spans(spans: list[tuple[Any, int, int]]) -> list[int]:
    """Each span's class among ``spans`` (of one length): the index of the first span
    with the same bytes. Only spans whose fingerprints agree get here. The header bytes
    a span holds are compared on the host, its tensor bytes with ``torch.equal`` on the
    first one's device (each view moved there only if it is elsewhere)."""
    import torch

    if len(spans) == 1:
        return [0]
    parts = [_span_parts(a, start, end) for a, start, end in spans]
    device = parts[0][1].device
    firsts: list[int] = []
    for i, (head, body) in enumerate(parts):
        firsts.append(next((j for j in range(i) if firsts[j] == j and parts[j][0] == head
                            and torch.equal(parts[j][1].to(device), body.to(device))), i))
    return firsts


def _span_parts(a: Any, start: int, end: int) -> tuple[bytes, Any]:
    """The bytes ``start:end`` of TensorArray ``a``'s ``.npy`` form, not made: the part
    in its header (bytes) and the part in its tensor (a uint8 view, on its device)."""
    import torch

    header = a.__dict__["_header"]
    h = len(header)
    return (header[start:min(end, h)] if start < h else b"",
            a.tensor.detach().reshape(-1).view(torch.uint8)[max(start - h, 0):max(end - h, 0)])


def _fingerprint(view: memoryview) -> bytes:
    """32 bytes from four places of a chunk (its start is an .npy header, the same for
    arrays of one shape; its end may be padding): chunks that differ nearly always
    differ here, so few pairs are compared whole."""
    n = len(view)
    return b"".join(bytes(view[i:i + 8]) for i in {0, n // 3, 2 * n // 3, max(n - 8, 0)})


def _equal(a: memoryview, b: memoryview) -> bool:
    """Whether two byte views of one length hold the same bytes."""
    return np.array_equal(np.frombuffer(a, dtype=np.uint8), np.frombuffer(b, dtype=np.uint8))


def _chunk_size(chunk: Any) -> int:
    """The length of ``chunk.deflate()`` (its header, the divider, its bytes), from the
    header's format alone."""
    return len(add_header_to_object_body(b"", chunk)) + len(chunk.data) + len(str(len(chunk.data))) - 1


def _forget_all(msg: Message, arrays: list[Any]) -> None:
    """Drop every id and chunk list cached on ``msg``, its records and ``arrays``."""
    for a in arrays:
        for key in ("_chunks", "_object_id", "_is_dirty"):
            a.__dict__.pop(key, None)
    if msg.has_content():
        for r in msg.content.values():
            r.__dict__.pop("_is_dirty", None)
    _forget_ids(msg)


# message -> its size on the wire, noted by whoever serialised it (the in-process grid)
_noted_sizes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def note_wire_size(msg: Message, size: int) -> None:
    """Note that ``msg`` is ``size`` bytes on the wire (its serialised objects were just
    made or read), so that whoever counts it next (the meter) need not serialise it
    again. The note is taken once (:func:`take_noted_wire_size`)."""
    _noted_sizes[msg] = size


# reply -> its size on the wire as the meter counted it when it was pulled
_counted_sizes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def remember_counted_size(msg: Message, size: int) -> None:
    """Note that the meter counted ``size`` bytes for the pulled reply ``msg``, for
    whoever needs that number again (the simulated clock's upload): not taken, and kept
    as long as the message lives."""
    _counted_sizes[msg] = size


def counted_wire_size(msg: Message) -> int:
    """The bytes ``msg`` took on the wire: what the meter counted when it was pulled
    (the reply as it crossed, before a strategy decoded it in place), else
    :func:`wire_size` (serialising it)."""
    size = _counted_sizes.get(msg)
    return wire_size(msg) if size is None else size


def take_noted_wire_size(msg: Message) -> int | None:
    """The size :func:`note_wire_size` noted for ``msg`` (and forget it), or None."""
    return _noted_sizes.pop(msg, None)


def message_from_objects(root_id: str, objects: dict[str, bytes]) -> Message:
    """Rebuild a Message from :func:`message_objects` (consumes ``objects``)."""
    msg = inflate_object_from_contents(root_id, objects, keep_object_contents=False)
    if not isinstance(msg, Message):
        raise FlowerInternalsChanged(
            f"inflate_object_from_contents returned {type(msg).__name__}, expected Message"
        )
    return msg


def recorddict_to_objects(content: Any) -> dict[str, Any]:
    """A RecordDict (a node's ``context.state``) as its serialised Flower objects: the
    root object id and object id -> bytes (:func:`recorddict_from_objects` reverses it).
    No Message around it: building one needs Flower's task identity, which a ClientApp
    under Ray does not have."""
    root, objects = serialise(content)
    return {"root": root, "objects": objects}


def recorddict_from_objects(state: dict[str, Any]) -> Any:
    """The RecordDict :func:`recorddict_to_objects` saved, bit for bit."""
    rd = inflate_object_from_contents(state["root"], dict(state["objects"]), keep_object_contents=False)
    if not isinstance(rd, RecordDict):
        raise FlowerInternalsChanged(
            f"inflate_object_from_contents returned {type(rd).__name__}, expected RecordDict")
    return rd


def set_message_id(msg: Message, message_id: str) -> None:
    """Give a message the id a SuperLink would (Flower's grids do the same)."""
    msg.metadata.__dict__["_message_id"] = message_id


def set_run_id(msg: Message, run_id: int) -> None:
    msg.metadata.__dict__["_run_id"] = run_id


@contextmanager
def task_identity(run_id: int, node_id: int, task_id: int) -> Iterator[None]:
    """Set Flower's process-global task identity for the duration, then restore it."""
    saved = (TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id)
    TaskIdentity.run_id = run_id
    TaskIdentity.node_id = node_id
    TaskIdentity.task_id = task_id
    try:
        yield
    finally:
        TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = saved


def empty_run(run_id: int) -> Run:
    return Run.create_empty(run_id)


def runs_messages_in_order(grid: object) -> bool | None:
    """Whether ``grid`` runs each node's messages one at a time, in push order.

    True for a deployment (``HttpGrid``: a SuperNode pulls and runs its messages in
    order) and for grids that say so (``runs_messages_in_order = True``, as fededge's
    in-process grid does); False for Ray simulation (``InMemoryGrid``), which may run
    two queued messages of one node at once (shared/reference/flower-notes.md); None
    for a grid it does not know. Wrappers with an ``inner`` grid are looked through.
    """
    while hasattr(grid, "inner"):
        grid = grid.inner
    own = getattr(type(grid), "runs_messages_in_order", None)
    if isinstance(own, bool):
        return own
    if is_deployment(grid):
        return True
    if is_flower_simulation(grid):
        return False
    return None


def _is_grid(grid: object, module: str, name: str) -> bool:
    """Whether ``grid`` (or the grid it wraps, as ``inner``) is Flower's ``module.name``."""
    while hasattr(grid, "inner"):
        grid = grid.inner
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as err:  # pragma: no cover - exercised only on a changed Flower
        raise _fail(f"{module}.{name}", err) from err
    return isinstance(grid, cls)


def is_deployment(grid: object) -> bool:
    """Whether ``grid`` is Flower's deployment grid (``HttpGrid``: a SuperLink, where
    replies arrive when real devices send them), looking through wrappers with an
    ``inner`` grid."""
    return _is_grid(grid, "flwr.superlink.grid.http_grid", "HttpGrid")


def is_flower_simulation(grid: object) -> bool:
    """Whether ``grid`` is Flower's simulation grid (``InMemoryGrid``, the Ray runtime),
    looking through wrappers with an ``inner`` grid."""
    return _is_grid(grid, "flwr.superlink.grid.inmemory_grid", "InMemoryGrid")


def check() -> None:
    """Exercise every internal above on a small message; raise FlowerInternalsChanged."""
    from flwr.app import Array, ArrayRecord, MetricRecord, RecordDict

    expected = np.arange(4, dtype=np.float32)
    name = "flwr.supercore.task_identity.TaskIdentity"
    try:
        with task_identity(run_id=7, node_id=1, task_id=1):
            msg = Message(RecordDict({"a": ArrayRecord({"x": Array(expected)})}), 3, "train")
        name = "Metadata.__dict__['_run_id' / '_message_id']"
        set_run_id(msg, 7)
        set_message_id(msg, "m1")
        if (msg.metadata.run_id, msg.metadata.message_id) != (7, "m1"):
            raise AssertionError("setting the ids had no effect")
        name = "flwr.supercore.inflatable.inflatable_object.get_all_nested_objects"
        objs = message_objects(msg)
        if len(objs) < 3:
            raise AssertionError(f"expected >= 3 objects (message, record dict, array), got {len(objs)}")
        name = "flwr.supercore.inflatable.inflatable_utils.inflate_object_from_contents"
        back = message_from_objects(msg.object_id, dict(objs))
        if not np.array_equal(back.content["a"]["x"].numpy(), expected):
            raise AssertionError("array changed in the round trip")
        name = "direct delivery: make_message, ArrayChunk, an Array's cached chunks, the computed-ids cache"
        if direct_wire_size(detached_copy(msg)) != sum(map(len, objs.values())):
            raise AssertionError("the size computed from the format is not the serialised size")
        name = "flwr.supercore.run.Run.create_empty"
        if empty_run(7).run_id != 7:
            raise AssertionError("run id not kept")
        name = "flwr.serverapp.strategy.strategy_utils.aggregate_arrayrecords"
        weighted = [RecordDict({"a": ArrayRecord({"x": Array(np.full(2, v, dtype=np.float32))}),
                                "m": MetricRecord({"n": w})}) for v, w in ((0.0, 1), (2.0, 3))]
        if not np.allclose(aggregate_arrayrecords(weighted, "n")["x"].numpy(), 1.5):
            raise AssertionError("not the weighted average")
        name = "flwr.superlink.grid.{http_grid.HttpGrid, inmemory_grid.InMemoryGrid}"
        if runs_messages_in_order(object()) is not None or is_flower_simulation(object()) or is_deployment(object()):
            raise AssertionError("an unknown grid was classified")
    except FlowerInternalsChanged:
        raise
    except Exception as err:  # noqa: BLE001 - re-raised with the internal's name
        raise _fail(name, err) from err
