"""Flower's ``Array`` to and from numpy and torch: the same bytes and values as Flower's
own conversions, without their per-array cost.

A Flower ``Array`` holds a numpy array in ``.npy`` format (``np.save``'s bytes: a header
naming dtype, order and shape, then the raw data). ``Array.numpy()`` runs ``np.load``,
which parses that header with Python's ``ast`` (about 0.1 ms), and
``Array.from_numpy_ndarray`` runs ``np.save`` through a ``BytesIO``. A model is tens of
arrays, and fededge's client state (DGA's model and its updates in flight, residuals,
momentum buffers) hundreds: converted on every message, on every small device. Here the
header is parsed (by numpy's own parser) once per distinct header and remembered, and
the data is read with ``np.frombuffer``; writing reuses the header numpy wrote for the
same dtype, order and shape. Anything else (an object dtype, a ``.npy`` version numpy
writes only for non-ASCII field names, another ``stype``) goes through Flower's own path.

Exact by construction and checked (tests/test_arrays.py): :func:`to_numpy` equals
``Array.numpy()`` bit for bit, and :func:`from_numpy` gives the very bytes of
``Array.from_numpy_ndarray`` (the first array of each header is also encoded by Flower and
compared, and a mismatch sends that header through Flower's path from then on), so object
ids and the bytes counted on the wire are Flower's.
"""

from __future__ import annotations

import contextlib
import contextvars
import io
import threading
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord

__all__ = ["TensorArray", "from_numpy", "from_torch", "record_from_torch", "record_to_torch", "replies_on_device",
           "to_numpy"]

_NUMPY_STYPE = "numpy.ndarray"
_MAX_CACHED = 4096  # distinct headers remembered (a model has a handful of shapes)

# header bytes -> (dtype, shape, fortran order), as numpy's parser read them
_parsed: dict[bytes, tuple[np.dtype, tuple[int, ...], bool]] = {}
# (dtype.str, shape, fortran order) -> the header np.save writes, or None: use Flower's path
_written: dict[tuple[str, tuple[int, ...], bool], bytes | None] = {}


def to_numpy(arr: Array, *, copy: bool = True) -> np.ndarray:
    """``arr.numpy()``: a fresh, writable array equal to it bit for bit.

    ``copy=False``: a read-only view of the Array's own bytes where they can be read in
    place (no copy: a 45 MB model is read without allocating 45 MB), else a fresh array
    as with ``copy=True``. For reading only (an average, ``load_state_dict``)."""
    data = arr.data
    if arr.stype != _NUMPY_STYPE or len(data) < 10 or data[:6] != b"\x93NUMPY":
        return arr.numpy()
    major = data[6]
    if major == 1:
        start = 10 + int.from_bytes(data[8:10], "little")
    elif major == 2:
        start = 12 + int.from_bytes(data[8:12], "little")
    else:
        return arr.numpy()
    header = bytes(data[:start])
    parsed = _parsed.get(header)
    if parsed is None:
        fp = io.BytesIO(header)
        version = np.lib.format.read_magic(fp)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(fp)
        else:
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(fp)
        if dtype.hasobject:
            return arr.numpy()  # np.load refuses it (allow_pickle=False): so does Flower
        if len(_parsed) >= _MAX_CACHED:
            _parsed.clear()
        parsed = _parsed[header] = (dtype, tuple(shape), bool(fortran))
    dtype, shape, fortran = parsed
    count = int(np.prod(shape, dtype=np.int64))
    if len(data) - start != count * dtype.itemsize:
        return arr.numpy()  # truncated or padded: let np.load say what is wrong
    flat = np.frombuffer(data, dtype=dtype, count=count, offset=start)
    view = flat.reshape(shape, order="F" if fortran else "C")
    return view.copy(order="K") if copy else view


def from_numpy(nd: np.ndarray) -> Array:
    """``Array.from_numpy_ndarray(nd)``: the same dtype, shape, stype and bytes."""
    if nd.dtype.hasobject or nd.dtype.names is not None or nd.dtype.subdtype is not None or nd.dtype.kind in "mM":
        # structured: dtype.str would not tell two apart; datetimes: no buffer protocol (memoryview fails)
        return Array.from_numpy_ndarray(nd)
    fortran = bool(nd.flags.f_contiguous and not nd.flags.c_contiguous)
    key = (nd.dtype.str, tuple(nd.shape), fortran)
    header = _written.get(key, b"")
    if header is None:
        return Array.from_numpy_ndarray(nd)
    if header == b"":  # first array of this kind: numpy writes the header, Flower checks it
        flower = Array.from_numpy_ndarray(nd)
        header = _npy_header(nd)
        ok = header + nd.tobytes(order="F" if fortran else "C") == flower.data
        if len(_written) >= _MAX_CACHED:
            _written.clear()
        _written[key] = header if ok else None
        return flower
    # One copy: the header and the array's own buffer where it is laid out as written.
    if fortran:
        body = memoryview(np.ascontiguousarray(nd.T)) if nd.ndim else nd.tobytes()
    else:
        body = memoryview(nd) if nd.flags.c_contiguous else memoryview(nd.tobytes())
    return Array(dtype=str(nd.dtype), shape=tuple(nd.shape), stype=_NUMPY_STYPE, data=header + body)


def _npy_header(nd: np.ndarray) -> bytes:
    """The header np.save writes for ``nd``: version 1.0, or 2.0 when it does not fit."""
    d = np.lib.format.header_data_from_array_1_0(nd)
    fp = io.BytesIO()
    try:
        np.lib.format.write_array_header_1_0(fp, d)
    except ValueError:  # over 65535 bytes (a shape of thousands of dimensions)
        fp = io.BytesIO()
        np.lib.format.write_array_header_2_0(fp, d)
    return fp.getvalue()


def from_torch(tensor: Any) -> Array:
    """``Array.from_torch_tensor(tensor)``, fast."""
    return from_numpy(tensor.detach().cpu().numpy())


def record_to_torch(record: ArrayRecord, *, copy: bool = True) -> "OrderedDict[str, Any]":
    """``record.to_torch_state_dict()``: name -> CPU tensor, in the record's order.

    ``copy=False``: tensors that share the record's bytes where they can (no copy), for a
    reader that copies them itself, e.g. ``model.load_state_dict(record_to_torch(r,
    copy=False))``. They must not be written to: the bytes are the message's (immutable
    for Python, not for torch), shared with every copy of the message. A
    :class:`TensorArray` gives its own tensor there, wherever it is (a GPU's memory):
    ``load_state_dict`` copies it to the model's device. With ``copy=True`` the
    :class:`TensorArray` tensors of one device come to the host in one transfer."""
    import torch

    if not copy:
        return OrderedDict((k, a.tensor if _resident(a) else _tensor_of_view(to_numpy(a, copy=False)))
                           for k, a in record.items())
    resident = {k: a.tensor for k, a in record.items() if _resident(a)}
    host = _host_copies(resident, everywhere=True) if len(resident) > 1 else {}
    out: OrderedDict[str, Any] = OrderedDict()
    for k, a in record.items():
        if k in host:
            out[k] = torch.from_numpy(host[k])  # views of one fresh buffer, each its own bytes
        elif k in resident:
            out[k] = resident[k].detach().to("cpu", copy=True)
        else:
            out[k] = torch.from_numpy(to_numpy(a))
    return out


_quiet_lock = threading.Lock()
_quieted = False  # torch has had (and been kept from showing) its one "not writable" warning


def _tensor_of_view(nd: np.ndarray) -> Any:
    """``torch.from_numpy`` of a read-only view. Torch warns, once per process, that the
    tensor of a read-only array is writable; these are not written (see
    :func:`record_to_torch`), so that one warning is kept quiet: only then are the warning
    filters touched (``catch_warnings`` is not thread-safe), under a lock."""
    import torch

    global _quieted
    if _quieted or nd.flags.writeable:
        return torch.from_numpy(nd)
    with _quiet_lock, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*not writable.*", category=UserWarning)
        tensor = torch.from_numpy(nd)
        _quieted = True
    return tensor


def record_from_torch(tensors: Mapping[str, Any], *, bulk: bool | None = None,
                      on_device: bool | None = False) -> ArrayRecord:
    """``ArrayRecord(tensors)``: the same record, fast. Values are torch tensors (a
    ``state_dict``), numpy arrays or Flower ``Array`` objects (kept as they are).

    Tensors on an accelerator (a CUDA client's model) come to the host in one transfer
    per device (:func:`_host_copies`) instead of one per tensor, each of which waits for
    the device; ``bulk=True`` does the same for CPU tensors too (to test it anywhere),
    ``bulk=False`` never. The record's bytes are the same either way.

    ``on_device``: tensors not on the CPU become :class:`TensorArray` copies that stay
    where they are, their bytes made only if asked (``None``: where
    :func:`replies_on_device` is in force, as the in-process runtime's direct delivery
    sets it for a reply's model; ``False``, the default: never). For a record that
    crosses no wire, e.g. a reply handed over in the same process."""
    if on_device is None:
        on_device = _on_device.get()
    record = ArrayRecord()
    resident = _resident_copies(tensors, everywhere=_everywhere_users > 0) if on_device else {}
    rest = {k: v for k, v in tensors.items() if k not in resident} if resident else tensors
    host = _host_copies(rest, everywhere=bool(bulk)) if bulk is not False else {}
    for k, v in tensors.items():
        if k in resident:
            record[k] = resident[k]
        elif isinstance(v, Array):
            record[k] = v
        elif isinstance(v, np.ndarray):
            record[k] = from_numpy(v)
        elif k in host:
            record[k] = from_numpy(host[k])
        else:
            record[k] = from_torch(v)
    return record


#: torch dtype -> numpy dtype, for the dtypes numpy has (None: it has none, e.g. bfloat16)
_numpy_dtypes: dict[Any, np.dtype | None] = {}


def _numpy_dtype(dtype: Any) -> np.dtype | None:
    if dtype not in _numpy_dtypes:
        import torch

        try:
            _numpy_dtypes[dtype] = torch.empty(0, dtype=dtype).numpy().dtype
        except (TypeError, RuntimeError):
            _numpy_dtypes[dtype] = None
    return _numpy_dtypes[dtype]


def _host_copies(tensors: Mapping[str, Any], *, everywhere: bool = False) -> dict[str, np.ndarray]:
    """name -> a numpy array equal to ``tensor.detach().cpu().numpy()`` (dtype, shape,
    C order, bytes) for each contiguous torch tensor not on the CPU (each one, with
    ``everywhere``) whose dtype numpy has: the tensors of one device laid end to end as
    bytes on that device and copied to the host at once, the arrays views of that copy.
    A non-contiguous tensor keeps its own path (``.cpu()`` keeps its strides, which
    decide the ``.npy`` layout), and so does a GPU whose free memory would not hold the
    gathered copy twice over (a small edge GPU)."""
    import torch

    groups: dict[Any, list[tuple[str, Any, np.dtype]]] = {}
    for k, v in tensors.items():
        if not isinstance(v, torch.Tensor) or (v.device.type == "cpu" and not everywhere):
            continue
        dtype = _numpy_dtype(v.dtype)
        if dtype is None or not v.is_contiguous() or v.is_sparse or v.is_quantized:
            continue
        groups.setdefault(v.device, []).append((k, v, dtype))
    out: dict[str, np.ndarray] = {}
    for device, items in groups.items():
        if len(items) < 2:
            continue  # nothing to save
        size = sum(t.numel() * t.element_size() for _, t, _ in items)
        if device.type == "cuda" and torch.cuda.mem_get_info(device)[0] < 2 * size:
            continue  # the gathered copy would not fit beside the model: one tensor at a time
        with torch.no_grad():
            flat = torch.cat([t.detach().reshape(-1).view(torch.uint8) for _, t, _ in items])
            host = flat.cpu().numpy()
        offset = 0
        for k, t, dtype in items:
            n = t.numel() * t.element_size()
            out[k] = host[offset:offset + n].view(dtype).reshape(tuple(t.shape))
            offset += n
    return out


# -- arrays that stay on their device: a reply handed over in the same process ----------

class TensorArray(Array):
    """A Flower ``Array`` whose bytes are a torch tensor's, made only when asked.

    It is the ``Array`` that ``Array.from_torch_tensor(tensor)`` would be (the same
    ``dtype``, ``shape``, ``stype``, and ``data`` equal to its bytes, made from the
    tensor on first access and kept), for a record that may never need its bytes: a
    GPU client's reply handed to the server in the same process, which the server
    averages on the GPU (:func:`fededge._flwr_internals.average_arrayrecords`) and hands
    on to the next round's clients, who load it from the GPU. Whatever reads ``data``
    (serialising the message, ``Array.numpy()``, a checkpoint) gets the very bytes of the
    host path. The tensor is the array's own (a copy: see :func:`record_from_torch`) and
    is never written to. Only for dtypes numpy has, in C order (contiguous tensors)."""

    #: The type name Flower writes in a serialised object's header (an Array, on the wire)
    __qualname__ = "Array"

    def __init__(self, tensor: Any, header: bytes, dtype: str) -> None:
        self.__dict__["_tensor"] = tensor
        self.__dict__["_header"] = header
        self.__dict__["_data"] = None
        self.dtype = dtype
        self.shape = tuple(tensor.shape)
        self.stype = _NUMPY_STYPE

    @property
    def tensor(self) -> Any:
        """The tensor (on its device); None once ``data`` has been set to other bytes."""
        return self.__dict__["_tensor"]

    @property  # type: ignore[override]
    def data(self) -> bytes:
        data = self.__dict__["_data"]
        if data is None:
            nd = self.__dict__["_tensor"].detach().cpu().numpy()
            data = self.__dict__["_data"] = b"".join((self.__dict__["_header"], nd.reshape(-1).view(np.uint8)))
        return data

    @data.setter
    def data(self, value: bytes) -> None:  # what Array.__setattr__ sets after dropping its caches
        self.__dict__["_data"] = value
        self.__dict__["_tensor"] = None

    def nbytes_on_wire(self) -> int:
        """``len(self.data)``, without making the bytes."""
        if self.__dict__["_data"] is not None or self.__dict__["_tensor"] is None:
            return len(self.data)
        t = self.__dict__["_tensor"]
        return len(self.__dict__["_header"]) + t.numel() * t.element_size()

    def shared(self) -> Array:
        """A new Array object for the same tensor and bytes (a message's copy: none of
        this one's cached ids or chunks)."""
        if self.__dict__["_tensor"] is None:
            return Array(dtype=self.dtype, shape=tuple(self.shape), stype=self.stype, data=self.data)
        twin = TensorArray(self.__dict__["_tensor"], self.__dict__["_header"], self.dtype)
        twin.__dict__["_data"] = self.__dict__["_data"]
        return twin

    def __eq__(self, other: object) -> bool:  # as Array's dataclass equality, across the two classes
        if not isinstance(other, Array):
            return NotImplemented
        return (self.dtype, tuple(self.shape), self.stype, self.data) == (
            other.dtype, tuple(other.shape), other.stype, other.data)

    __hash__ = None  # type: ignore[assignment]  # equal objects could not hash equal

    def __reduce__(self) -> tuple:
        """Pickled (and deep-copied) as the plain Array of its bytes: what it is on the
        wire. (The class's ``__qualname__`` is Array's, so pickle could not find it.)"""
        return (_plain_array, (self.dtype, tuple(self.shape), self.stype, self.data))

    def __repr__(self) -> str:  # the dataclass's would make the bytes
        t = self.__dict__["_tensor"]
        where = f", device={t.device}" if t is not None else ""
        return f"TensorArray(dtype={self.dtype!r}, shape={tuple(self.shape)!r}{where})"


def _plain_array(dtype: str, shape: tuple[int, ...], stype: str, data: bytes) -> Array:
    return Array(dtype=dtype, shape=shape, stype=stype, data=data)


def _resident(a: Any) -> bool:
    return isinstance(a, TensorArray) and a.tensor is not None


# Whether this thread's (context's) ClientApp call may keep its reply on the device: set
# by replies_on_device() around the call, in the thread that runs it, so that nothing else
# running in the process at the time (a serialised call, the server) is affected.
_on_device: contextvars.ContextVar[bool] = contextvars.ContextVar("fededge_replies_on_device", default=False)
_everywhere_lock = threading.Lock()
_everywhere_users = 0  # replies_on_device(everywhere=True) blocks open (tests): CPU tensors too


@contextlib.contextmanager
def replies_on_device(*, everywhere: bool = False) -> Iterator[None]:
    """For the length of the block, in this thread (context), a ClientApp's reply model
    built with ``record_from_torch(..., on_device=None)`` keeps its GPU tensors as
    :class:`TensorArray` copies: the in-process runtime's direct delivery, where nothing
    needs the bytes. ``everywhere=True`` makes every such block in the process (of any
    thread) do the same for CPU tensors, for as long as it lasts: a switch for tests
    and benchmarks, to run the path without a GPU."""
    global _everywhere_users
    token = _on_device.set(True)
    if everywhere:
        with _everywhere_lock:
            _everywhere_users += 1
    try:
        yield
    finally:
        _on_device.reset(token)
        if everywhere:
            with _everywhere_lock:
                _everywhere_users -= 1


def _resident_header(tensor: Any) -> tuple[bytes, str] | None:
    """(the ``.npy`` header, numpy's dtype name) for a :class:`TensorArray` of ``tensor``,
    or None where it cannot be one with Flower's bytes: a dtype numpy lacks, a
    non-contiguous, sparse or quantized tensor, or a (dtype, shape) whose header has not
    yet been checked against Flower's (:func:`from_numpy` checks it on the first array
    of each, so the caller takes the host path that once)."""
    dtype = _numpy_dtype(tensor.dtype)
    if dtype is None or not tensor.is_contiguous() or tensor.is_sparse or tensor.is_quantized:
        return None
    header = _written.get((dtype.str, tuple(tensor.shape), False))
    if not header:  # unseen (missing or b"") or Flower's path (None)
        return None
    return header, str(dtype)


def _resident_copies(tensors: Mapping[str, Any], *, everywhere: bool = False) -> dict[str, Array]:
    """name -> a :class:`TensorArray` of a copy, for each float tensor (float32 or
    float64, at least one dimension: what the server averages on the device) not on the
    CPU (each one, with ``everywhere``) that can be one (:func:`_resident_header`). The
    rest (integer counters, 0-d tensors) take the host path, in one transfer. None at all
    where the copies would take the device past its budget (:func:`_within_budget`)."""
    import torch

    groups: dict[Any, list[tuple[str, Any, tuple[bytes, str]]]] = {}
    for k, v in tensors.items():
        if (isinstance(v, torch.Tensor) and (v.device.type != "cpu" or everywhere)
                and v.dtype in (torch.float32, torch.float64) and v.dim() > 0):
            made = _resident_header(v)
            if made is not None:
                groups.setdefault(v.device, []).append((k, v, made))
    out: dict[str, Array] = {}
    for device, items in groups.items():
        if not _within_budget(device, sum(t.numel() * t.element_size() for _, t, _ in items)):
            continue
        try:
            with torch.no_grad():
                copies = [(k, t.detach().clone(), made) for k, t, made in items]
        except torch.cuda.OutOfMemoryError:
            continue  # the host path, as before
        for k, t, (header, dtype) in copies:
            out[k] = kept_on_device(t, header, dtype)
    return out


# device -> bytes held by live TensorArray tensors (a model per reply until the server
# averages them; more where replies wait, as in asynchronous strategies)
_held: dict[Any, int] = {}
_held_lock = threading.Lock()
#: The share of a GPU's memory that TensorArrays may hold at once; past it (or where the
#: free memory is under twice the new copies) a reply takes the host path. Training
#: needs the rest: a reply kept on the device must never cost the next client its
#: activations.
DEVICE_SHARE = 0.25


def _within_budget(device: Any, size: int) -> bool:
    """Whether ``size`` more bytes of TensorArrays fit on ``device``: always on the CPU
    (tests); on a GPU, within :data:`DEVICE_SHARE` of its memory with what is held (over
    the runs that share the machine, :func:`~fededge.machine.runs_sharing`), and with
    twice ``size`` free."""
    if device.type != "cuda":
        return True
    import torch

    from fededge.machine import runs_sharing  # a sweep's runs side by side: each its share

    free, total = torch.cuda.mem_get_info(device)
    with _held_lock:
        return free >= 2 * size and _held.get(device, 0) + size <= DEVICE_SHARE * total / runs_sharing()


def _release(device: Any, size: int) -> None:
    with _held_lock:
        _held[device] = _held.get(device, 0) - size


def kept_on_device(tensor: Any, header: bytes, dtype: str) -> TensorArray:
    """A :class:`TensorArray` of ``tensor`` (given up by the caller), counted against
    its device's budget while the tensor lives."""
    if tensor.device.type == "cuda":
        size = tensor.numel() * tensor.element_size()
        with _held_lock:
            _held[tensor.device] = _held.get(tensor.device, 0) + size
        weakref.finalize(tensor, _release, tensor.device, size)
    return TensorArray(tensor, header, dtype)
