"""Offline data sets as plain tensors: digits, synthetic, MNIST and CIFAR-10.

Nothing here downloads. ``digits`` ships with scikit-learn and ``synthetic`` is
generated, so both work on a machine with no network (a Raspberry Pi in the field, a CI
runner). MNIST and CIFAR-10 are read from files a user has placed in ``data_dir``, in
the formats their authors distribute (IDX for MNIST, the "python version" pickles for
CIFAR-10). The CIFAR-10 pickles are read with a restricted unpickler that can build
numpy arrays and nothing else, so a tampered file cannot run code.

This module never imports Flower. See docs/data.md.
"""

from __future__ import annotations

import gzip
import importlib
import math
import pickle
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from .partition import _check_int

__all__ = ["DATASETS", "Dataset", "ForbiddenGlobalError", "load_dataset"]

DATASETS: tuple[str, ...] = ("digits", "synthetic", "synthetic-images", "mnist", "cifar10")

# Conventional normalisation constants (torchvision examples use the same numbers).
MNIST_MEAN = 0.1307
MNIST_STD = 0.3081
# Per-channel statistics of the 50,000 CIFAR-10 training images. (The often-copied
# (0.2023, 0.1994, 0.2010) are the means of per-image stds, not the dataset stds.)
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)

MNIST_FILES: dict[str, str] = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}
CIFAR10_TRAIN_FILES: tuple[str, ...] = tuple(f"data_batch_{i}" for i in range(1, 6))
CIFAR10_TEST_FILE = "test_batch"
CIFAR10_SUBDIR = "cifar-10-batches-py"

_IDX_UBYTE = 0x08
_IDX_IMAGES_MAGIC = 0x00000803  # uint8, 3 dimensions (count, rows, cols)
_IDX_LABELS_MAGIC = 0x00000801  # uint8, 1 dimension (count)


@dataclass(frozen=True, eq=False)
class Dataset:
    """A train/test pair of tensors ready for a plain PyTorch loop.

    Parameters
    ----------
    name : str
        Which data set this is (one of :data:`DATASETS` when built by
        :func:`load_dataset`).
    x_train, x_test : torch.Tensor
        float32 inputs, already normalised. Images are ``(N, C, H, W)``, tabular data
        ``(N, D)``. Train and test share the per-sample shape.
    y_train, y_test : torch.Tensor
        int64 class labels in ``[0, num_classes)``, one per row of the inputs.
    num_classes : int
        Number of classes (>= 2).

    Notes
    -----
    Equality is identity (``eq=False``): comparing tensors field by field has no single
    truth value. Partition a data set by indexing, e.g.
    ``ds.x_train[parts[i]]`` with the arrays from :func:`fededge.data.partition`.

    Examples
    --------
    >>> ds = load_dataset("digits", seed=0)
    >>> ds.input_shape, ds.num_classes
    ((1, 8, 8), 10)
    """

    name: str
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    num_classes: int

    def __post_init__(self) -> None:
        if not isinstance(self.num_classes, int) or isinstance(self.num_classes, bool):
            raise ValueError(f"num_classes must be an int, got {self.num_classes!r}")
        if self.num_classes < 2:
            raise ValueError(f"num_classes must be >= 2, got {self.num_classes}")
        for split in ("train", "test"):
            x = getattr(self, f"x_{split}")
            y = getattr(self, f"y_{split}")
            if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor):
                raise ValueError(f"x_{split} and y_{split} must be torch.Tensor")
            if x.dtype != torch.float32:
                raise ValueError(f"x_{split} must be float32, got {x.dtype}")
            if y.dtype != torch.int64:
                raise ValueError(f"y_{split} must be int64, got {y.dtype}")
            if x.ndim < 2 or y.ndim != 1:
                raise ValueError(
                    f"x_{split} must be (N, ...) with at least 2 dims and y_{split} "
                    f"(N,); "
                    f"got {tuple(x.shape)} and {tuple(y.shape)}"
                )
            if x.shape[0] != y.shape[0]:
                raise ValueError(
                    f"x_{split} has {x.shape[0]} rows but y_{split} has "
                    f"{y.shape[0]} labels"
                )
            if y.numel() and (int(y.min()) < 0 or int(y.max()) >= self.num_classes):
                raise ValueError(
                    f"y_{split} must lie in [0, num_classes={self.num_classes}), "
                    f"got range [{int(y.min())}, {int(y.max())}]"
                )
        if self.x_train.shape[1:] != self.x_test.shape[1:]:
            raise ValueError(
                f"x_train and x_test must share the per-sample shape, got "
                f"{tuple(self.x_train.shape[1:])} and {tuple(self.x_test.shape[1:])}"
            )

    @property
    def input_shape(self) -> tuple[int, ...]:
        """Shape of one input sample, ``x_train.shape[1:]``."""
        return tuple(self.x_train.shape[1:])

    def __repr__(self) -> str:
        return (
            f"Dataset(name={self.name!r}, train={len(self.y_train)}, "
            f"test={len(self.y_test)}, input_shape={self.input_shape}, "
            f"num_classes={self.num_classes})"
        )


def load_dataset(
    name: str,
    *,
    data_dir: str | None = None,
    seed: int = 0,
    synthetic_samples: int = 6000,
    synthetic_features: int = 32,
    synthetic_classes: int = 10,
    synthetic_amplitude: float = 0.35,
    test_fraction: float = 0.2,
) -> Dataset:
    """Load one of :data:`DATASETS` as normalised float32 / int64 tensors.

    Parameters
    ----------
    name : str
        ``"digits"``: scikit-learn's bundled 1,797 8x8 handwritten digits, shape
        ``(N, 1, 8, 8)``. ``"synthetic"``: a seeded Gaussian-mixture classification
        problem, shape ``(N, synthetic_features)``. ``"mnist"``: IDX files in
        ``data_dir``, shape ``(N, 1, 28, 28)``. ``"cifar10"``: the CIFAR-10 python
        pickles in ``data_dir``, shape ``(N, 3, 32, 32)``.
    data_dir : str, optional
        Directory holding the MNIST or CIFAR-10 files; required for those two, unused
        otherwise. MNIST: ``train-images-idx3-ubyte``, ``train-labels-idx1-ubyte``,
        ``t10k-images-idx3-ubyte``, ``t10k-labels-idx1-ubyte``, each optionally
        ``.gz``, in ``data_dir`` or ``data_dir/MNIST/raw`` (torchvision's layout).
        CIFAR-10: ``data_batch_1`` .. ``data_batch_5`` and ``test_batch`` in
        ``data_dir`` or ``data_dir/cifar-10-batches-py``.
    seed : int
        Seeds the train/test split (digits, synthetic) and the synthetic generator.
        The same seed gives the identical split. MNIST and CIFAR-10 use their
        official test sets, so the seed does not affect them.
    synthetic_samples, synthetic_features, synthetic_classes : int
        Size of the synthetic problem (total samples before the split, features per
        sample, classes). Classes are balanced to within one sample.
    test_fraction : float
        Fraction in (0, 1) held out for testing, stratified by class (digits,
        synthetic). MNIST and CIFAR-10 keep their official test split and ignore it.

    Returns
    -------
    Dataset
        Train and test tensors. Inputs are standardised with statistics of the
        training split (digits, synthetic) or the conventional published constants
        (MNIST, CIFAR-10), so no test information leaks into training.

    Raises
    ------
    ValueError
        Unknown ``name``; invalid argument; missing ``data_dir`` or files (the message
        lists what was expected); malformed IDX or CIFAR-10 files (the message names
        the file).
    ForbiddenGlobalError
        (a ``pickle.UnpicklingError``) A CIFAR-10 file asks to build anything other
        than numpy arrays; nothing it names is called.

    Examples
    --------
    >>> ds = load_dataset("synthetic", synthetic_samples=1000, seed=3)
    >>> ds.x_train.shape, ds.x_test.shape
    (torch.Size([800, 32]), torch.Size([200, 32]))
    """
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; choose one of {DATASETS}")
    _check_int("seed", seed, minimum=0)
    if seed >= 2**32:
        raise ValueError(f"seed must be < 2**32 (sklearn's limit), got {seed}")
    if isinstance(test_fraction, bool) or not isinstance(test_fraction, (int, float)):
        raise ValueError(
            f"test_fraction must be a float in (0, 1), got {test_fraction!r}"
        )
    if not 0.0 < float(test_fraction) < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")

    if name == "digits":
        return _load_digits(seed=seed, test_fraction=float(test_fraction))
    if name == "synthetic":
        return _make_synthetic(
            seed=seed,
            samples=synthetic_samples,
            features=synthetic_features,
            classes=synthetic_classes,
            test_fraction=float(test_fraction),
        )
    if name == "synthetic-images":
        return _make_synthetic_images(
            seed=seed, samples=synthetic_samples, classes=synthetic_classes,
            amplitude=synthetic_amplitude, test_fraction=float(test_fraction),
        )
    if name == "mnist":
        return _load_mnist(_require_dir(name, data_dir))
    return _load_cifar10(_require_dir(name, data_dir))


# --------------------------------------------------------------------------- helpers


def _stratified_split(
    y: np.ndarray, *, test_fraction: float, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    from sklearn.model_selection import train_test_split

    idx = np.arange(len(y))
    train_idx, test_idx = train_test_split(
        idx, test_size=test_fraction, random_state=seed, stratify=y
    )
    return np.sort(train_idx), np.sort(test_idx)


def _standardise(
    x_train: np.ndarray, x_test: np.ndarray, *, axis: int | None
) -> tuple[np.ndarray, np.ndarray]:
    # Statistics come from the training split only, so the test set stays unseen.
    mean = x_train.mean(axis=axis, keepdims=axis is not None)
    std = x_train.std(axis=axis, keepdims=axis is not None)
    std = np.where(std > 0, std, 1.0)  # a constant feature stays finite (becomes 0)
    return (x_train - mean) / std, (x_test - mean) / std


def _as_dataset(
    name: str,
    x_train: np.ndarray,
    y_train: np.ndarray,
    x_test: np.ndarray,
    y_test: np.ndarray,
    num_classes: int,
) -> Dataset:
    return Dataset(
        name=name,
        x_train=torch.from_numpy(np.ascontiguousarray(x_train, dtype=np.float32)),
        y_train=torch.from_numpy(np.ascontiguousarray(y_train, dtype=np.int64)),
        x_test=torch.from_numpy(np.ascontiguousarray(x_test, dtype=np.float32)),
        y_test=torch.from_numpy(np.ascontiguousarray(y_test, dtype=np.int64)),
        num_classes=num_classes,
    )


def _require_dir(name: str, data_dir: str | None) -> Path:
    expected = (
        ", ".join(f"{f}[.gz]" for f in MNIST_FILES.values())
        if name == "mnist"
        else ", ".join((*CIFAR10_TRAIN_FILES, CIFAR10_TEST_FILE))
        + f" (optionally inside {CIFAR10_SUBDIR}/)"
    )
    if data_dir is None:
        raise ValueError(
            f"dataset {name!r} is read from disk: pass data_dir=<directory holding "
            f"{expected}>; nothing is downloaded"
        )
    path = Path(data_dir)
    if not path.is_dir():
        raise ValueError(
            f"data_dir {str(path)!r} for dataset {name!r} is not a directory; "
            f"it must hold {expected}"
        )
    return path


# --------------------------------------------------------------------------- digits


def _load_digits(*, seed: int, test_fraction: float) -> Dataset:
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = x.astype(np.float64) / 16.0  # pixel intensities are 0..16
    train_idx, test_idx = _stratified_split(y, test_fraction=test_fraction, seed=seed)
    # One scalar mean/std, as for MNIST: per-pixel stats would blow up the always-zero
    # border pixels.
    x_train, x_test = _standardise(x[train_idx], x[test_idx], axis=None)
    return _as_dataset(
        "digits",
        x_train.reshape(-1, 1, 8, 8),
        y[train_idx],
        x_test.reshape(-1, 1, 8, 8),
        y[test_idx],
        num_classes=10,
    )


# --------------------------------------------------------------------------- synthetic

# Distance of each class mean from the origin, in units of the (unit) noise std. With
# orthonormal means two classes sit radius*sqrt(2) ~ 4.2 std apart: a linear model
# reaches roughly 85-90% on 10 classes, far above chance yet not saturated.
_SYNTHETIC_RADIUS = 3.0


def min_split_samples(classes: int, test_fraction: float) -> int:
    """The fewest samples whose stratified split keeps one of each of ``classes`` on each
    side: sklearn puts ``ceil(test_fraction * n)`` in the test set.

    >>> min_split_samples(10, 0.2)
    46
    """
    n = classes
    while min(math.ceil(test_fraction * n), n - math.ceil(test_fraction * n)) < classes:
        n += 1
    return n


def _check_split(samples: int, classes: int, test_fraction: float) -> None:
    if samples < min_split_samples(classes, test_fraction):
        n_test = math.ceil(test_fraction * samples)
        raise ValueError(
            f"synthetic_samples={samples} is too small for synthetic_classes={classes} "
            f"with test_fraction={test_fraction}: the split gives {samples - n_test} train and "
            f"{n_test} test samples, and each side needs at least one per class; raise synthetic_samples "
            f"to {min_split_samples(classes, test_fraction)} or more (or lower synthetic_classes)"
        )


def _make_synthetic(
    *, seed: int, samples: int, features: int, classes: int, test_fraction: float
) -> Dataset:
    _check_int("synthetic_classes", classes, minimum=2)
    _check_int("synthetic_features", features, minimum=1)
    _check_int("synthetic_samples", samples, minimum=1)
    _check_split(samples, classes, test_fraction)

    rng = np.random.default_rng(seed)
    directions = rng.standard_normal((features, classes))
    if features >= classes:
        # Orthonormal class directions: every pair of classes is equally hard.
        directions, _ = np.linalg.qr(directions)
    else:
        directions /= np.linalg.norm(directions, axis=0, keepdims=True)
    means = _SYNTHETIC_RADIUS * directions.T  # (classes, features)
    y = rng.permutation(np.arange(samples) % classes)  # balanced to within one
    x = means[y] + rng.standard_normal((samples, features))

    train_idx, test_idx = _stratified_split(y, test_fraction=test_fraction, seed=seed)
    x_train, x_test = _standardise(x[train_idx], x[test_idx], axis=0)
    return _as_dataset(
        "synthetic", x_train, y[train_idx], x_test, y[test_idx], num_classes=classes
    )


#: Default amplitude of the class template against unit noise in ``synthetic-images``: low
#: enough that one image is ambiguous to the eye, high enough that a small CNN learns.
#: McMahan et al.'s larger CNN nearly saturates it (99.9%); 0.1 with 12,000 images is a
#: harder task on which it plateaus near 81% (benchmarks/bench_compression.py).
_TEMPLATE_AMPLITUDE = 0.35


def _make_synthetic_images(*, seed: int, samples: int, classes: int, amplitude: float = _TEMPLATE_AMPLITUDE,
                           test_fraction: float) -> Dataset:
    """CIFAR-shaped (3, 32, 32) images: a smooth class template under pixel noise.

    Each class has a random 3x8x8 pattern, upsampled bilinearly to 32x32, so that the
    signal is spatially correlated as in natural images and a CNN's convolutions help.
    An image is ``amplitude * template[y] + N(0, 1)`` per pixel (``amplitude`` sets the
    difficulty: lower is noisier), shifted by up to 2
    pixels at random (so a plain template match is not enough), then standardised per
    channel. For CIFAR-10-sized workloads (compression, timing) without a download.
    """
    _check_int("synthetic_classes", classes, minimum=2)
    _check_int("synthetic_samples", samples, minimum=1)
    _check_split(samples, classes, test_fraction)
    if isinstance(amplitude, bool) or not isinstance(amplitude, (int, float)) or not 0 < amplitude < math.inf:
        raise ValueError(f"synthetic_amplitude must be a positive finite number (0.35 by default), got {amplitude!r}")
    rng = np.random.default_rng(np.random.SeedSequence([seed, 0x696D67]))  # "img"
    small = torch.from_numpy(rng.standard_normal((classes, 3, 8, 8)).astype(np.float32))
    templates = torch.nn.functional.interpolate(small, size=(36, 36), mode="bilinear",
                                                align_corners=False).numpy()
    y = rng.permutation(np.arange(samples) % classes)
    dx, dy = rng.integers(0, 5, samples), rng.integers(0, 5, samples)
    x = np.empty((samples, 3, 32, 32), dtype=np.float32)
    for i in range(samples):
        x[i] = templates[y[i], :, dy[i]:dy[i] + 32, dx[i]:dx[i] + 32]
    x = float(amplitude) * x + rng.standard_normal(x.shape, dtype=np.float32)
    train_idx, test_idx = _stratified_split(y, test_fraction=test_fraction, seed=seed)
    x_train, x_test = _standardise(x[train_idx], x[test_idx], axis=(0, 2, 3))
    return _as_dataset("synthetic-images", x_train, y[train_idx], x_test, y[test_idx],
                       num_classes=classes)


# --------------------------------------------------------------------------- MNIST


def _find_mnist_file(data_dir: Path, stem: str) -> Path:
    candidates = [
        d / f"{stem}{suffix}"
        for d in (data_dir, data_dir / "MNIST" / "raw")
        for suffix in ("", ".gz")
    ]
    for path in candidates:
        if path.is_file():
            return path
    expected = ", ".join(f"{f}[.gz]" for f in MNIST_FILES.values())
    raise ValueError(
        f"MNIST file {stem!r} not found in data_dir {str(data_dir)!r} (looked for "
        f"{', '.join(str(p) for p in candidates)}); the directory must hold the four "
        f"IDX files {expected}"
    )


def _read_bytes(path: Path) -> bytes:
    """The file's bytes, gunzipped where they are gzip's (by its magic bytes, not the name:
    a browser unpacks a download and keeps its ``.gz``, and a gzip file may lack one)."""
    raw = path.read_bytes()
    if raw[:2] != b"\x1f\x8b":
        return raw
    try:
        return gzip.decompress(raw)
    except (OSError, EOFError, zlib.error) as exc:
        raise ValueError(f"{path} is not a readable gzip file: {exc}") from exc


def _read_idx(path: Path, *, magic: int) -> np.ndarray:
    """Parse an IDX file (LeCun's MNIST format), checking header and size.

    Header: two zero bytes, a dtype byte (0x08 = unsigned byte), a byte with the
    number of dimensions, then one big-endian uint32 per dimension; the body is the
    row-major data.
    """
    raw = _read_bytes(path)
    ndim = magic & 0xFF
    header_len = 4 + 4 * ndim
    if len(raw) < 4:
        raise ValueError(f"{path} is too short to be an IDX file ({len(raw)} bytes)")
    found = int.from_bytes(raw[:4], "big")
    if found != magic:
        dtype_note = (
            f" (dtype byte 0x{raw[2]:02x}; only unsigned byte 0x{_IDX_UBYTE:02x} "
            f"is supported)"
            if raw[2] != _IDX_UBYTE
            else ""
        )
        raise ValueError(
            f"{path} has IDX magic number 0x{found:08x}, expected 0x{magic:08x} "
            f"(uint8, {ndim} dimension{'s' if ndim > 1 else ''}){dtype_note}"
        )
    if len(raw) < header_len:
        raise ValueError(f"{path} is truncated inside its IDX header")
    dims = tuple(
        int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)
    )
    expected = math.prod(dims)
    body = len(raw) - header_len
    if body != expected:
        state = "truncated" if body < expected else "longer than its header says"
        raise ValueError(
            f"{path} is {state}: header dims {dims} need {expected} data bytes, "
            f"file has {body}"
        )
    return np.frombuffer(raw, dtype=np.uint8, offset=header_len).reshape(dims)


def _load_mnist_split(data_dir: Path, split: str) -> tuple[np.ndarray, np.ndarray]:
    img_path = _find_mnist_file(data_dir, MNIST_FILES[f"{split}_images"])
    lbl_path = _find_mnist_file(data_dir, MNIST_FILES[f"{split}_labels"])
    images = _read_idx(img_path, magic=_IDX_IMAGES_MAGIC)
    labels = _read_idx(lbl_path, magic=_IDX_LABELS_MAGIC)
    if images.shape[0] != labels.shape[0]:
        raise ValueError(
            f"{img_path} holds {images.shape[0]} images but {lbl_path} holds "
            f"{labels.shape[0]} labels; the counts must match"
        )
    if labels.size and labels.max() >= 10:
        raise ValueError(
            f"{lbl_path} has label {int(labels.max())}; MNIST labels are 0..9"
        )
    return images, labels


def _load_mnist(data_dir: Path) -> Dataset:
    x_train, y_train = _load_mnist_split(data_dir, "train")
    x_test, y_test = _load_mnist_split(data_dir, "test")
    if x_train.shape[1:] != x_test.shape[1:]:
        raise ValueError(
            f"MNIST train images are {x_train.shape[1:]} but test images are "
            f"{x_test.shape[1:]}; both files must have the same rows and columns"
        )

    def norm(x: np.ndarray) -> np.ndarray:
        out = x.astype(np.float32)[:, None, :, :]
        out /= 255.0  # in place: no second full-size copy on small devices
        out -= MNIST_MEAN
        out /= MNIST_STD
        return out

    return _as_dataset("mnist", norm(x_train), y_train, norm(x_test), y_test, 10)


# --------------------------------------------------------------------------- CIFAR-10


class ForbiddenGlobalError(pickle.UnpicklingError):
    """A CIFAR-10 pickle asked for something other than numpy array reconstruction.

    Raised before anything it names is called, so the file's payload never runs.
    Corrupt or truncated files raise ``ValueError`` instead.
    """


def _numpy_global(module: str, name: str) -> Callable[..., Any]:
    # numpy 2 moved numpy.core to numpy._core and leaves a deprecation shim behind;
    # resolve old and new spellings to the real object without touching the shim.
    for mod in (module.replace("numpy.core", "numpy._core"), module):
        try:
            return getattr(importlib.import_module(mod), name)
        except (ImportError, AttributeError):
            continue
    raise ForbiddenGlobalError(f"numpy global {module}.{name} is unavailable")


def _latin1_encode(obj: Any, encoding: str = "utf-8", errors: str = "strict") -> bytes:
    # Python 3 writes bytes at pickle protocol <= 2 as _codecs.encode(str, "latin1").
    # Allow exactly that use, not arbitrary codecs.
    if not isinstance(obj, str) or encoding not in ("latin1", "latin-1"):
        raise ForbiddenGlobalError(
            f"_codecs.encode is allowed only as encode(str, 'latin1'), got "
            f"encoding={encoding!r}"
        )
    return obj.encode("latin1", errors)


def _empty_bytes(*args: Any) -> bytes:
    # Python 3 writes b"" at protocol <= 2 as bytes().
    if args:
        raise ForbiddenGlobalError("bytes(...) is allowed only without arguments")
    return b""


# Everything a CIFAR-10 batch needs, and nothing that can run code: numpy's array
# reconstruction (protocols 0-4 and numpy 1.x/2.x spellings), protocol-5 buffers, and
# the two helpers Python 3 uses for bytes at protocol <= 2.
_CIFAR_ALLOWED_GLOBALS: dict[tuple[str, str], Callable[[], Any]] = {
    ("numpy.core.multiarray", "_reconstruct"): lambda: _numpy_global(
        "numpy.core.multiarray", "_reconstruct"
    ),
    ("numpy._core.multiarray", "_reconstruct"): lambda: _numpy_global(
        "numpy._core.multiarray", "_reconstruct"
    ),
    ("numpy.core.numeric", "_frombuffer"): lambda: _numpy_global(
        "numpy.core.numeric", "_frombuffer"
    ),
    ("numpy._core.numeric", "_frombuffer"): lambda: _numpy_global(
        "numpy._core.numeric", "_frombuffer"
    ),
    ("numpy", "ndarray"): lambda: np.ndarray,
    ("numpy", "dtype"): lambda: np.dtype,
    ("_codecs", "encode"): lambda: _latin1_encode,
    ("__builtin__", "bytes"): lambda: _empty_bytes,  # how protocol <= 2 spells it
    ("builtins", "bytes"): lambda: _empty_bytes,
}


class _ArrayOnlyUnpickler(pickle.Unpickler):
    """Unpickler that may only build numpy arrays (and plain containers).

    ``pickle.load`` will call any importable callable a file names, so a tampered
    CIFAR-10 batch could run ``os.system``. ``find_class`` is the one door through
    which a pickle reaches code; this subclass opens it only for the globals in
    ``_CIFAR_ALLOWED_GLOBALS``.
    """

    def __init__(self, file: Any, *, path: Path) -> None:
        super().__init__(file, encoding="bytes")
        self._path = path

    def find_class(self, module: str, name: str) -> Any:
        factory = _CIFAR_ALLOWED_GLOBALS.get((module, name))
        if factory is None:
            allowed = ", ".join(f"{m}.{n}" for m, n in _CIFAR_ALLOWED_GLOBALS)
            raise ForbiddenGlobalError(
                f"{self._path}: refusing to load forbidden global {module}.{name}; "
                f"a CIFAR-10 batch only needs numpy arrays (allowed: {allowed}). "
                f"The file is not an original CIFAR-10 batch."
            )
        return factory()


def _get(batch: dict[Any, Any], key: str) -> Any:
    # Original batches are Python 2 pickles whose str keys load as bytes; accept the
    # str key too for batches re-saved from Python 3.
    if key.encode() in batch:
        return batch[key.encode()]
    return batch.get(key)


def _plain_array(value: Any, kinds: str) -> bool:
    """Whether ``value`` is a numpy array of a plain dtype of one of ``kinds``: the dtype a
    string builds (no fields, no subarray, no flags set through a pickle's state)."""
    if type(value) is not np.ndarray:
        return False
    dt = value.dtype
    return dt.kind in kinds and dt.__reduce__() == np.dtype(dt.str).__reduce__()


def _load_cifar_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    with path.open("rb") as fh:
        try:
            batch = _ArrayOnlyUnpickler(fh, path=path).load()
        except ForbiddenGlobalError as exc:
            if str(path) in str(exc):
                raise
            raise ForbiddenGlobalError(f"{path}: {exc}") from exc
        except (
            pickle.UnpicklingError,
            EOFError,
            ValueError,
            TypeError,
            IndexError,
            KeyError,
            AttributeError,
            OverflowError,  # a corrupt frame length
            MemoryError,  # a corrupt length that asks for more than there is
        ) as exc:
            # Corrupt or truncated, not hostile: the forbidden-global check above is
            # the security boundary; this is an ordinary bad-file error.
            raise ValueError(f"{path} is not a valid CIFAR-10 batch: {exc!r}") from exc
    if not isinstance(batch, dict):
        raise ValueError(f"{path} must hold a dict, got {type(batch).__name__}")
    data, labels = _get(batch, "data"), _get(batch, "labels")
    if data is None or labels is None:
        raise ValueError(
            f"{path} must hold keys b'data' and b'labels', got {list(batch)}"
        )
    # Before any element is read: a dtype a pickle builds through its state can hold
    # object fields (pointers of the file's choosing) and still compare equal to uint8.
    if not _plain_array(data, "u") or data.dtype != np.uint8:
        raise ValueError(f"{path}: b'data' must be a plain uint8 numpy array")
    if not (_plain_array(labels, "iu") or isinstance(labels, list) and all(type(v) is int for v in labels)):
        raise ValueError(f"{path}: b'labels' must be a list of ints or a plain integer numpy array")
    if data.ndim != 2 or data.shape[1] != 3 * 32 * 32:
        raise ValueError(f"{path}: b'data' must be N x 3072, got {data.shape}")
    try:
        y = np.asarray(labels, dtype=np.int64)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{path}: b'labels' must be a list of ints") from exc
    if y.ndim != 1 or y.shape[0] != data.shape[0]:
        raise ValueError(
            f"{path} has {data.shape[0]} images but {y.size} labels; counts must match"
        )
    if y.size and (y.min() < 0 or y.max() >= 10):
        raise ValueError(f"{path}: labels must be 0..9, got [{y.min()}, {y.max()}]")
    # Each row is the red 32x32 plane, then green, then blue, each row-major.
    return data.reshape(-1, 3, 32, 32), y


def _load_cifar10(data_dir: Path) -> Dataset:
    names = (*CIFAR10_TRAIN_FILES, CIFAR10_TEST_FILE)
    roots = (data_dir, data_dir / CIFAR10_SUBDIR)
    root = next((r for r in roots if all((r / n).is_file() for n in names)), None)
    if root is None:
        missing = [n for n in names if not (data_dir / n).is_file()]
        sub = data_dir / CIFAR10_SUBDIR
        missing_sub = [n for n in names if not (sub / n).is_file()]
        raise ValueError(
            f"CIFAR-10 batches not found: expected {', '.join(names)} (the 'python "
            f"version' of CIFAR-10) in {str(data_dir)!r} or in "
            f"{str(data_dir / CIFAR10_SUBDIR)!r}; missing there: {missing} and "
            f"{missing_sub}"
        )
    train = [_load_cifar_batch(root / n) for n in CIFAR10_TRAIN_FILES]
    x_test, y_test = _load_cifar_batch(root / CIFAR10_TEST_FILE)
    x_train = np.concatenate([x for x, _ in train])
    y_train = np.concatenate([y for _, y in train])

    mean = np.asarray(CIFAR10_MEAN, dtype=np.float32)[None, :, None, None]
    std = np.asarray(CIFAR10_STD, dtype=np.float32)[None, :, None, None]

    def norm(x: np.ndarray) -> np.ndarray:
        out = x.astype(np.float32)
        out /= 255.0  # in place: the train set is ~600 MB as float32
        out -= mean
        out /= std
        return out

    return _as_dataset("cifar10", norm(x_train), y_train, norm(x_test), y_test, 10)
