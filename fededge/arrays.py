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

import io
import threading
import warnings
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord

__all__ = ["from_numpy", "from_torch", "record_from_torch", "record_to_torch", "to_numpy"]

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
    if nd.dtype.hasobject or nd.dtype.names is not None or nd.dtype.subdtype is not None:
        return Array.from_numpy_ndarray(nd)  # structured: dtype.str would not tell two apart
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
    for Python, not for torch), shared with every copy of the message."""
    import torch

    if copy:
        return OrderedDict((k, torch.from_numpy(to_numpy(a))) for k, a in record.items())
    return OrderedDict((k, _tensor_of_view(to_numpy(a, copy=False))) for k, a in record.items())


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


def record_from_torch(tensors: Mapping[str, Any], *, bulk: bool | None = None) -> ArrayRecord:
    """``ArrayRecord(tensors)``: the same record, fast. Values are torch tensors (a
    ``state_dict``), numpy arrays or Flower ``Array`` objects (kept as they are).

    Tensors on an accelerator (a CUDA client's model) come to the host in one transfer
    per device (:func:`_host_copies`) instead of one per tensor, each of which waits for
    the device; ``bulk=True`` does the same for CPU tensors too (to test it anywhere),
    ``bulk=False`` never. The record's bytes are the same either way."""
    record = ArrayRecord()
    host = _host_copies(tensors, everywhere=bool(bulk)) if bulk is not False else {}
    for k, v in tensors.items():
        if isinstance(v, Array):
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
