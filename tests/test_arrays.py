"""fededge.arrays against Flower's own conversions: the same values and the same bytes."""

import copy as copying
import pickle

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord

from fededge import arrays
from fededge.models.zoo import build_model

CASES = [
    np.arange(12, dtype=np.float32).reshape(3, 4),
    np.asfortranarray(np.arange(12, dtype=np.float64).reshape(3, 4)),  # written in Fortran order
    np.arange(24, dtype=np.int64).reshape(2, 3, 4)[:, ::2],  # not contiguous
    np.array(3.5, dtype=np.float16),  # 0-d
    np.zeros((0, 5), dtype=np.float32),  # empty
    np.arange(6, dtype=">i4"),  # big-endian
    np.array([True, False, True]),
    np.frombuffer(bytes(range(16)), dtype=np.uint8),
    np.arange(10, dtype=np.complex64),
    np.zeros((2,), dtype=[("a", "<f4"), ("b", "<i2")]),  # structured
    np.array(["2026-11-28", "2026-11-29"], dtype="datetime64[D]"),  # no buffer protocol: the second failed
    np.array([5, 7], dtype="timedelta64[s]"),
]


@pytest.mark.parametrize("nd", CASES, ids=lambda a: f"{a.dtype}-{a.shape}")
def test_both_ways_equal_flowers_bytes_and_values(nd):
    for _ in range(2):  # the first call checks the header against Flower's, the second uses it
        ours, flower = arrays.from_numpy(nd), Array.from_numpy_ndarray(nd)
        assert (ours.dtype, tuple(ours.shape), ours.stype, ours.data) == \
            (flower.dtype, tuple(flower.shape), flower.stype, flower.data)
        assert ours.object_id == flower.object_id
        back, ref = arrays.to_numpy(flower), flower.numpy()
        assert back.dtype == ref.dtype and back.shape == ref.shape
        assert back.tobytes() == ref.tobytes()
        assert back.flags.writeable and not np.shares_memory(back, np.frombuffer(flower.data, np.uint8))


def test_a_model_state_dict_round_trips_as_flower_does():
    sd = build_model("cnn", input_shape=(1, 8, 8), num_classes=10, seed=0).state_dict()
    ours, flower = arrays.record_from_torch(sd), ArrayRecord(torch_state_dict=sd)
    assert ours.object_id == flower.object_id
    back, ref = arrays.record_to_torch(flower), flower.to_torch_state_dict()
    assert list(back) == list(ref)
    assert all(torch.equal(back[k], ref[k]) and back[k].dtype == ref[k].dtype for k in ref)


def test_two_structured_dtypes_of_one_size_keep_their_own_headers():
    a = np.zeros((2,), dtype=[("a", "<f4"), ("b", "<i2")])
    b = np.zeros((2,), dtype=[("x", "<i2"), ("y", "<f4")])
    for nd in (a, b, a, b):
        assert arrays.from_numpy(nd).data == Array.from_numpy_ndarray(nd).data


def test_bad_bytes_get_numpys_own_error():
    good = Array.from_numpy_ndarray(np.arange(8, dtype=np.float32))
    cut = Array(dtype=good.dtype, shape=good.shape, stype=good.stype, data=good.data[:-4])
    with pytest.raises(ValueError):
        arrays.to_numpy(cut)
    other = Array(dtype="float32", shape=(2,), stype="torch.Tensor", data=b"\x00" * 8)
    with pytest.raises(TypeError, match="Unsupported serialization type"):
        arrays.to_numpy(other)


def test_a_header_numpy_would_write_differently_falls_back_to_flower(monkeypatch):
    nd = np.arange(7, dtype=np.float32)
    monkeypatch.setattr(arrays, "_written", {})
    monkeypatch.setattr(arrays, "_npy_header", lambda a: b"\x93NUMPY-wrong")
    assert arrays.from_numpy(nd).data == Array.from_numpy_ndarray(nd).data
    assert arrays._written[(nd.dtype.str, (7,), False)] is None
    assert arrays.from_numpy(nd).data == Array.from_numpy_ndarray(nd).data


@pytest.mark.parametrize("nd", CASES, ids=lambda a: f"{a.dtype}-{a.shape}")
def test_a_view_reads_the_same_values_in_place(nd):
    """``copy=False``: the values and layout of ``copy=True``, read from the Array's own
    bytes, read-only."""
    arr = arrays.from_numpy(nd)
    view, fresh = arrays.to_numpy(arr, copy=False), arrays.to_numpy(arr)
    assert view.dtype == fresh.dtype and view.shape == fresh.shape and view.tobytes() == fresh.tobytes()
    in_place = np.shares_memory(view, np.frombuffer(arr.data, np.uint8))
    assert in_place == (nd.size > 0)
    assert not in_place or not view.flags.writeable


def test_a_state_dict_read_in_place_loads_as_a_copy_does():
    model = build_model("cnn-bn", input_shape=(1, 8, 8), num_classes=10, seed=0)
    record = arrays.record_from_torch(build_model("cnn-bn", input_shape=(1, 8, 8), num_classes=10,
                                                  seed=1).state_dict())
    before = bytes(record["fc.weight"].data) if "fc.weight" in record else None
    shared = arrays.record_to_torch(record, copy=False)
    ref = arrays.record_to_torch(record)
    assert list(shared) == list(ref)
    assert all(torch.equal(shared[k], ref[k]) and shared[k].dtype == ref[k].dtype for k in ref)
    model.load_state_dict(shared)
    assert all(torch.equal(model.state_dict()[k], ref[k]) for k in ref)
    with torch.no_grad():  # the model holds copies: training it leaves the record's bytes alone
        for p in model.parameters():
            p.add_(1.0)
    assert all(torch.equal(shared[k], ref[k]) for k in ref)
    assert before is None or record["fc.weight"].data == before


def test_one_transfer_to_the_host_gives_the_same_bytes_as_one_per_tensor():
    """record_from_torch's bulk path (one copy per device, used for tensors on an
    accelerator; ``bulk=True`` forces it here): each Array equal to the per-tensor path's,
    for the dtypes and layouts a state dict can hold; a strided tensor keeps its own path
    (its layout decides the .npy order), and a dtype numpy lacks is left to it."""
    sd = build_model("cnn-bn", input_shape=(1, 8, 8), num_classes=10, seed=0).state_dict()
    sd.update({
        "f64": torch.arange(5, dtype=torch.float64), "f16": torch.ones(3, 2, dtype=torch.float16),
        "flag": torch.tensor([True, False, True]),
        "empty": torch.zeros(0, 3), "scalar": torch.tensor(7, dtype=torch.int64),
        "strided": torch.arange(12.0).reshape(3, 4).T, "i8": torch.arange(-3, 4, dtype=torch.int8),
        "grad": torch.nn.Parameter(torch.randn(2, 3)),
    })
    bulk, each = arrays.record_from_torch(sd, bulk=True), arrays.record_from_torch(sd, bulk=False)
    assert list(bulk) == list(each) == list(sd)
    for k in sd:
        assert vars(bulk[k]) == vars(each[k]), k
    assert set(arrays._host_copies(sd, everywhere=True)) == set(sd) - {"strided"}
    assert arrays._numpy_dtype(torch.bfloat16) is None
    assert arrays._host_copies({"a": torch.ones(2, dtype=torch.bfloat16), "b": torch.ones(2, dtype=torch.bfloat16)},
                               everywhere=True) == {}
    assert arrays._host_copies(sd) == {}  # CPU tensors: nothing to gather by default


def test_reading_in_place_shows_no_warning_even_as_errors():
    """torch warns (once a process) that a read-only array's tensor is writable; fededge's
    in-place reads are never written, so that warning is kept quiet, in a fresh process
    where it would otherwise be the first (and warnings as errors make it fatal)."""
    import subprocess
    import sys

    code = ("import torch, warnings\n"
            "from fededge import arrays\n"
            "warnings.simplefilter('error')\n"
            "r = arrays.record_from_torch({'w': torch.ones(3, 2), 'b': torch.zeros(2)})\n"
            "for _ in range(2):\n"
            "    t = arrays.record_to_torch(r, copy=False)\n"
            "assert torch.equal(t['w'], torch.ones(3, 2))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


# -- TensorArray: a reply's model that stays on its device (issue 35, item 2) ------------

TENSORS = [
    torch.arange(12, dtype=torch.float32).reshape(3, 4),
    torch.arange(6, dtype=torch.float64),
    torch.tensor(7, dtype=torch.int64),  # 0-d, as num_batches_tracked
    torch.zeros(0, 5),
    torch.tensor([True, False]),
    torch.arange(8, dtype=torch.float16).reshape(2, 4),
    torch.arange(24, dtype=torch.float32).reshape(4, 6).t(),  # not contiguous: the host path
    torch.arange(3, dtype=torch.bfloat16),  # numpy has no bfloat16: the host path
]


@pytest.mark.parametrize("t", TENSORS, ids=lambda t: f"{t.dtype}-{tuple(t.shape)}")
def test_a_tensor_array_is_flowers_array_of_the_tensor(t):
    state = {"t": t}
    if t.dtype == torch.bfloat16:
        with pytest.raises(TypeError):  # Flower's own path cannot either
            arrays.record_from_torch(state)
        return
    arrays.record_from_torch(state)  # the first array of a (dtype, shape) checks its header against Flower's
    record = arrays.record_from_torch(state, on_device=True, bulk=False)
    assert not isinstance(record["t"], arrays.TensorArray)  # on the CPU: only ever in tests
    with arrays.replies_on_device(everywhere=True):
        record = arrays.record_from_torch(state, on_device=None)
    a, flower = record["t"], Array.from_torch_tensor(t)
    # kept on the device: the float tensors the server averages there (float32/64, >= 1 dimension)
    assert isinstance(a, arrays.TensorArray) == (t.is_contiguous() and t.dtype in (torch.float32, torch.float64)
                                                 and t.dim() > 0)
    if not isinstance(a, arrays.TensorArray) and arrays._resident_header(t) is not None:
        a = arrays.TensorArray(t.clone(), *arrays._resident_header(t))  # the class holds any dtype numpy has
        record = ArrayRecord()
        record["t"] = a
    if isinstance(a, arrays.TensorArray):
        assert a.tensor is not t and (t.numel() == 0 or a.tensor.data_ptr() != t.data_ptr())  # its own copy
        assert a.nbytes_on_wire() == len(flower.data) and a.__dict__["_data"] is None  # sized without its bytes
        assert "TensorArray" in repr(a) and a.__dict__["_data"] is None
    assert (a.dtype, tuple(a.shape), a.stype, a.data) == (flower.dtype, tuple(flower.shape), flower.stype, flower.data)
    assert a == flower and flower == a and a.object_id == flower.object_id
    assert a.numpy().tobytes() == flower.numpy().tobytes()
    if isinstance(a, arrays.TensorArray):
        twin = a.shared()
        assert twin is not a and twin == flower and twin.tensor is a.tensor
        for other in (pickle.loads(pickle.dumps(a)), copying.deepcopy(a)):  # the plain Array of its bytes
            assert type(other) is Array and other == flower
    for copy in (True, False):
        back = arrays.record_to_torch(record, copy=copy)["t"]
        assert back.dtype == t.dtype and torch.equal(back, t)
        if copy:
            assert back.device.type == "cpu" and (t.numel() == 0 or back.data_ptr() != getattr(a, "tensor", t).data_ptr())


def test_setting_a_tensor_arrays_bytes_drops_its_tensor():
    state = {"w": torch.arange(4, dtype=torch.float32)}
    arrays.record_from_torch(state)
    with arrays.replies_on_device(everywhere=True):
        a = arrays.record_from_torch(state, on_device=None)["w"]
    other = Array.from_numpy_ndarray(np.full(4, 9, dtype=np.float32))
    a.data = other.data
    assert a.tensor is None and a.numpy().tolist() == [9.0] * 4 and a.shared() == other
    assert not isinstance(a.shared(), arrays.TensorArray)


def test_a_state_dict_comes_back_from_tensor_arrays_in_one_transfer_as_it_went():
    model = build_model("cnn-bn", input_shape=(1, 8, 8), num_classes=10, seed=0)
    state = model.state_dict()
    arrays.record_from_torch(state)
    with arrays.replies_on_device(everywhere=True):
        record = arrays.record_from_torch(state, on_device=None)
    assert {k for k, a in record.items() if isinstance(a, arrays.TensorArray)} == {
        k for k, t in state.items() if t.is_floating_point() and t.dim() > 0}
    back = arrays.record_to_torch(record)
    assert list(back) == list(state)
    for k, t in state.items():
        assert back[k].dtype == t.dtype and torch.equal(back[k], t)
        back[k].add_(1)  # writable, and its own bytes
        assert torch.equal(arrays.record_to_torch(record, copy=False)[k], t)
    outside = arrays.record_from_torch(state, on_device=None)  # no replies_on_device block: the host path
    assert not any(isinstance(a, arrays.TensorArray) for a in outside.values())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the budget is a GPU's memory")
def test_tensor_arrays_on_a_gpu_are_counted_against_its_budget(monkeypatch):
    import gc

    state = {"w": torch.randn(256, 256, device="cuda"), "b": torch.randn(256, device="cuda")}
    arrays.record_from_torch(state)
    device = state["w"].device
    before = arrays._held.get(device, 0)
    record = arrays.record_from_torch(state, on_device=True)
    assert all(isinstance(a, arrays.TensorArray) and a.tensor.is_cuda for a in record.values())
    assert arrays._held[device] - before == 4 * (256 * 256 + 256)
    assert arrays.record_to_torch(record)["w"].device.type == "cpu"
    del record
    gc.collect()
    assert arrays._held.get(device, 0) == before  # released with the tensors
    monkeypatch.setattr(arrays, "DEVICE_SHARE", 0.0)  # no room: the host path
    assert not any(isinstance(a, arrays.TensorArray) for a in arrays.record_from_torch(state, on_device=True).values())
