"""Image classification datasets, loaded once into normalized float32 tensors.

Every loader returns a :class:`Dataset` whose tensors are already in NCHW layout and normalized, so training
code indexes whole mini-batches (``x_train[idx]``) without per-sample Python transforms. Files are read from
a user-supplied data directory in the formats the datasets are officially distributed in; nothing is
downloaded and nothing is cached on disk. ``digits`` ships inside scikit-learn and needs no files.
"""

from __future__ import annotations

import gzip
import hashlib
import hmac
import io
import math
import pickle
import tarfile
import zipfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from decentdp.data.libsvm import A9A_SOURCE, load_a9a
from decentdp.errors import ConfigError, DataError

DATASETS: tuple[str, ...] = ("digits", "mnist", "fashion-mnist", "cifar10", "cifar100", "a9a")

# Per-channel (mean, std) of the training pixels scaled to [0, 1]; the values every paper normalizes with.
_MNIST_STATS = ((0.1307,), (0.3081,))
_FASHION_STATS = ((0.2860,), (0.3530,))
_CIFAR10_STATS = ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))
_CIFAR100_STATS = ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762))

#: How a keyed data fingerprint begins (:meth:`Dataset.fingerprint`); one without it is a plain SHA-256.
FINGERPRINT_PREFIX = "hmac-sha256:"

# Where each dataset can be obtained, quoted in "file not found" errors.
_SOURCES = {
    "mnist": "https://storage.googleapis.com/tensorflow/tf-keras-datasets/mnist.npz (npz) or "
    "https://ossci-datasets.s3.amazonaws.com/mnist/ (the four IDX .gz files)",
    "fashion-mnist": "https://github.com/zalandoresearch/fashion-mnist (the four IDX files in data/fashion/)",
    "cifar10": "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz",
    "cifar100": "https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz",
    "a9a": A9A_SOURCE,
}

# SHA-256 of the official releases' arrays (of ``np.ascontiguousarray(a)``: images uint8 ``(n, 28, 28)``, labels
# uint8 ``(n,)``, as the official files decode).  The IDX files of MNIST and Fashion-MNIST share their names, so a
# file of one found where the other was asked for is told apart by its content; and an array of an official
# release's shape is compared with that release's content, since plain IDX files carry no checksum of their own
# (a .gz or .npz file's CRC catches damage in transit, not a damaged copy that was compressed again).
_OFFICIAL_ARRAYS = {
    "mnist": {"x_train": "741c988805d008ac6e4c904b69001ba184c24b2c540a4ef403f4c71b676cf757",
              "y_train": "1feba77c54802fa5339a11837ea4b2866434b83314ec45192930f1df69120c13",
              "x_test": "6d87418db22cc8025d05968bec9bd5c3932904b23485740db143a061a2c9d161",
              "y_test": "ddeff807876a9661a1110d45c266c86239a3a1b7d37da0c3716a7a683c852ff5"},
    "fashion-mnist": {"x_train": "2e487a6c89124f78f2d7521542223cafe96f7123c3ca13d447772ac6ecbb3012",
                      "y_train": "657fbd221bfc9f4198cc14b5619cc33ec57c58dd0e47af4d99d6650759e869a7",
                      "x_test": "c867c93ff95360594e8ec3287995350b824dd110b11595c0e13d5423f621867a",
                      "y_test": "3d0e6c6ea990b53b6f8f500a41cac93881d981b315f84578b7d915342ade01e9"},
}
# The shape of each array in both official releases: only an array of this shape is compared with them, so
# subsets and one's own files of other sizes load as they are.
_OFFICIAL_SHAPES = {"x_train": (60000, 28, 28), "y_train": (60000,), "x_test": (10000, 28, 28), "y_test": (10000,)}

# IDX files of (Fashion-)MNIST: split -> (images file, labels file).
_IDX_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
_IDX_NAMES = ", ".join(name for pair in _IDX_FILES.values() for name in pair)
_IDX_MAGIC_IMAGES = 0x00000803  # unsigned bytes, 3 dimensions
_IDX_MAGIC_LABELS = 0x00000801  # unsigned bytes, 1 dimension


@dataclass(frozen=True, eq=False)
class Dataset:
    """Preloaded float32 tensors, normalized, in NCHW layout, ready for batched indexing.

    Attributes
    ----------
    name : str
        One of :data:`DATASETS`.
    x_train, x_test : torch.Tensor
        float32 images of shape ``(n, C, H, W)``, normalized with the dataset's channel mean and std.
    y_train, y_test : torch.Tensor
        int64 class labels in ``[0, num_classes)`` of shape ``(n,)``.
    num_classes : int
        Number of classes of the task.
    """

    name: str
    x_train: torch.Tensor = field(repr=False)
    y_train: torch.Tensor = field(repr=False)
    x_test: torch.Tensor = field(repr=False)
    y_test: torch.Tensor = field(repr=False)
    num_classes: int

    @property
    def input_shape(self) -> tuple[int, int, int]:
        """Shape ``(C, H, W)`` of one image, what a model's first layer is built for."""
        c, h, w = self.x_train.shape[1:]
        return (int(c), int(h), int(w))

    def fingerprint(self, key: bytes | None) -> str:
        """HMAC-SHA256 under ``key`` of every record (features and labels, both splits) as loaded, written
        ``hmac-sha256:<hex>``: what a resumed run checks, so that its noise, replayed from the seed or the keys,
        never continues on other records.  Keyed because a plain hash of private records is an uncharged
        release: whoever knows every record but one could test candidates for it.  ``key=None`` gives the plain
        SHA-256 hex that folders written before the key held."""
        digest = hashlib.sha256() if key is None else hmac.new(key, digestmod=hashlib.sha256)
        for tensor in (self.x_train, self.y_train, self.x_test, self.y_test):
            digest.update(tensor.detach().contiguous().cpu().numpy().data)  # (no copy for a CPU tensor)
        return digest.hexdigest() if key is None else f"{FINGERPRINT_PREFIX}{digest.hexdigest()}"

    def to(self, device: torch.device | str) -> Dataset:
        """The same dataset with its tensors on ``device`` (itself when they are already there)."""
        device = torch.device(device)
        if self.x_train.device == device:
            return self
        return replace(self, x_train=self.x_train.to(device), y_train=self.y_train.to(device),
                       x_test=self.x_test.to(device), y_test=self.y_test.to(device))


def load_dataset(name: str, data_dir: str | Path | None = None, *, image_size: int | None = None) -> Dataset:
    """Load a dataset into memory as normalized float32 NCHW tensors.

    Parameters
    ----------
    name : str
        One of :data:`DATASETS`.
    data_dir : str or Path, optional
        Directory holding the dataset's files (see the per-dataset formats below). Ignored for
        ``digits``; required for the others.
    image_size : int, optional
        Resize images to ``image_size x image_size`` once at load time (bilinear, antialiased when
        shrinking), e.g. 32 for models designed for 32x32 inputs fed 28x28 MNIST.

    Returns
    -------
    Dataset
        Train and test tensors with labels.

    Raises
    ------
    ConfigError
        ``data.dataset`` for an unknown name, ``data.image_size`` for a non-positive size.
    DataError
        When ``data_dir`` is missing for a dataset that needs files, or its files are absent or unreadable.

    Notes
    -----
    Accepted files:

    * ``digits``: bundled with scikit-learn; 1,437 train / 360 test images (fixed stratified split).
    * ``mnist`` / ``fashion-mnist``: ``mnist.npz`` / ``fashion-mnist.npz`` (keys ``x_train``, ``y_train``,
      ``x_test``, ``y_test``) or the four IDX files (``train-images-idx3-ubyte``, ``train-labels-idx1-ubyte``,
      ``t10k-images-idx3-ubyte``, ``t10k-labels-idx1-ubyte``, each optionally ``.gz``), in ``data_dir/mnist``
      (resp. ``data_dir/fashion-mnist``) or else in ``data_dir``; a folder holding some but not all four is
      refused, naming the missing ones.  An array of an official release's size (60,000 / 10,000 images of
      28x28, and their labels) must be that release's content (SHA-256): the other dataset's official images
      and damaged copies are refused, other sizes are read as they are.  An npz file's images are uint8
      ``(n, H, W)``, the
      same size in both splits, neither split empty; its labels one whole class index per image, ``(n,)`` or
      ``(n, 1)``, of an integer or float type (one-hot rows and fractional labels are refused, naming the array).
    * ``cifar10`` / ``cifar100``: the official python versions, either extracted (``cifar-10-batches-py/``,
      ``cifar-100-python/``) or as tarballs (``cifar-10-python.tar.gz``, ``cifar-100-python.tar.gz``) in
      ``data_dir``. CIFAR-100 uses the 100 fine labels.
    * ``a9a``: LIBSVM's ``a9a`` and ``a9a.t`` (or the DECOR authors' ``a9a.txt``, ``a9a_t.txt``) in ``data_dir`` or
      ``data_dir/a9a``, checked by SHA-256 (:mod:`decentdp.data.libsvm`); 123 binary features as ``(1, 1, 123)``.
    """
    if name not in DATASETS:
        raise ConfigError("data.dataset", f"unknown dataset {name!r}; expected one of {', '.join(DATASETS)}")
    if image_size is not None and (isinstance(image_size, bool) or not isinstance(image_size, int)
                                   or image_size < 1):
        raise ConfigError("data.image_size", f"must be a positive integer, got {image_size!r}")
    if image_size is not None and name == "a9a":  # (the schema refuses it too; this guards direct calls)
        raise ConfigError("data.image_size", "a9a holds feature vectors, not images: leave image_size unset")

    if name == "digits":
        dataset = _load_digits()
    else:
        directory = _require_dir(name, data_dir)
        if name in ("mnist", "fashion-mnist"):
            dataset = _load_mnist_like(name, directory)
        elif name == "a9a":
            x_train, y_train, x_test, y_test = load_a9a(directory)
            dataset = Dataset(name="a9a", x_train=x_train, y_train=y_train, x_test=x_test, y_test=y_test,
                              num_classes=2)
        else:
            dataset = _load_cifar(name, directory)

    if image_size is not None and dataset.input_shape[1:] != (image_size, image_size):
        dataset = Dataset(
            name=dataset.name,
            x_train=_resize(dataset.x_train, image_size),
            y_train=dataset.y_train,
            x_test=_resize(dataset.x_test, image_size),
            y_test=dataset.y_test,
            num_classes=dataset.num_classes,
        )
    return dataset


def _require_dir(name: str, data_dir: str | Path | None) -> Path:
    """Return ``data_dir`` as an existing directory, or explain how to provide one."""
    if data_dir is None:
        raise DataError(
            f"dataset {name!r} is read from files: pass their directory with --data-dir / data.data_dir "
            f"(get them from {_SOURCES[name]})"
        )
    directory = Path(data_dir).expanduser()
    if not directory.is_dir():
        raise DataError(f"data directory {directory} for dataset {name!r} is not an existing directory")
    return directory


def _normalize(images: np.ndarray, stats: tuple[tuple[float, ...], tuple[float, ...]]) -> torch.Tensor:
    """Turn uint8 NCHW images into float32 ``(x / 255 - mean) / std`` per channel, in place on one copy."""
    mean, std = stats
    x = torch.from_numpy(images.astype(np.float32))
    x.div_(255.0)
    x.sub_(torch.tensor(mean, dtype=torch.float32, device=x.device).view(1, -1, 1, 1))
    x.div_(torch.tensor(std, dtype=torch.float32, device=x.device).view(1, -1, 1, 1))
    return x


def _labels(labels: Any, num_classes: int, source: str) -> torch.Tensor:
    """Whole class indices in ``[0, num_classes)`` as int64, so that a wrong file fails before training.

    Labels of an integer type, or floats holding whole numbers (``3.0``), are accepted, one per image
    (shape ``(n,)``, or Keras' column ``(n, 1)``); a fractional label is refused, never truncated.
    """
    y = np.asarray(labels).reshape(-1)
    if y.dtype.kind not in "iuf":
        raise DataError(f"{source}: labels must be numbers (class indices 0..{num_classes - 1}), got dtype {y.dtype}")
    if y.dtype.kind == "f":
        bad = np.flatnonzero(~np.isfinite(y) | (y != np.round(y)))
        if len(bad):
            raise DataError(f"{source}: label {float(y[bad[0]])!r} at index {bad[0]} is not a whole class index "
                            f"({len(bad)} such label(s)); labels are classes 0..{num_classes - 1}, and a fractional "
                            "one is refused rather than truncated")
    outside = np.flatnonzero((y < 0) | (y >= num_classes))
    if len(outside):
        raise DataError(f"{source}: labels outside [0, {num_classes}) (found {y.min():g}..{y.max():g}; the first "
                        f"at index {outside[0]})")
    return torch.from_numpy(y.astype(np.int64))


def _resize(x: torch.Tensor, size: int) -> torch.Tensor:
    """Bilinearly resize NCHW images to ``size x size``; antialiasing only acts when shrinking."""
    return F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False, antialias=True)


_DIGITS_MEAN, _DIGITS_STD = 0.3053, 0.3760


def _load_digits() -> Dataset:
    """scikit-learn's 8x8 digits, scaled to [0, 1] and standardized with fixed constants.

    The constants (the whole set's pixel mean and std, like MNIST's 0.1307/0.3081) are public
    numbers: computing them from the agents' pooled records at run time would leak across agents.

    The split is stratified with a fixed seed so every run and every agent sees the same test set.
    """
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    bunch = load_digits()
    x = (bunch.data / 16.0).astype(np.float32).reshape(-1, 1, 8, 8)
    y = bunch.target.astype(np.int64)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=360, random_state=0, stratify=y)
    mean, std = _DIGITS_MEAN, _DIGITS_STD
    return Dataset(
        name="digits",
        x_train=torch.from_numpy(((x_tr - mean) / std).astype(np.float32)),
        y_train=torch.from_numpy(y_tr),
        x_test=torch.from_numpy(((x_te - mean) / std).astype(np.float32)),
        y_test=torch.from_numpy(y_te),
        num_classes=10,
    )


# ----------------------------------------------------------------------------- MNIST and Fashion-MNIST


def _load_mnist_like(name: str, data_dir: Path) -> Dataset:
    """Read (Fashion-)MNIST from an npz file or the four IDX files, whichever is found first.

    Looks in ``data_dir/<name>`` then ``data_dir`` (the IDX files of both datasets share their names, so the
    dataset's own folder comes first); within a directory the npz file wins.  A directory holding some but not
    all of the four IDX files is an error naming the present and the missing ones, never skipped for the files
    of another directory (a reviewer: three of Fashion-MNIST's four files in ``data_dir/fashion-mnist`` made it
    train on the MNIST files in ``data_dir``).  Shapes and dtypes are checked (an npz file's from its headers,
    before its arrays are read), then the labels' values, then each array of an official release's shape
    against that release (:func:`_check_official_content`), all before the images are converted to float32,
    and every error names the file and array.
    """
    stats = _MNIST_STATS if name == "mnist" else _FASHION_STATS
    for directory in (data_dir / name, data_dir):
        npz = directory / f"{name}.npz"
        shared_dir = None  # data_dir when the IDX files are read from it (it may hold the other dataset's by right)
        if npz.is_file():
            sources = {key: f"{npz}, array {key}" for key in _NPZ_KEYS}
            arrays = _read_npz(npz, sources)
            break
        idx_paths = _find_idx_files(name, directory, data_dir)
        if idx_paths is not None:
            arrays, sources = {}, {}
            for split, (images, labels) in idx_paths.items():
                arrays[f"x_{split}"] = _read_idx(images, _IDX_MAGIC_IMAGES)
                arrays[f"y_{split}"] = _read_idx(labels, _IDX_MAGIC_LABELS)
                sources[f"x_{split}"], sources[f"y_{split}"] = str(images), str(labels)
            shared_dir = directory if directory == data_dir else None
            _check_layout({key: (array.shape, array.dtype) for key, array in arrays.items()}, sources)
            break
    else:
        raise DataError(
            f"dataset {name!r} not found in data directory {data_dir}: looked for {data_dir / name / f'{name}.npz'} or "
            f"the four IDX files in {data_dir / name}, then {data_dir / f'{name}.npz'} or the four IDX files in "
            f"{data_dir} (the IDX files: {_IDX_NAMES}, each plain or .gz). Get it from {_SOURCES[name]}"
        )

    y_train = _labels(arrays["y_train"], 10, sources["y_train"])
    y_test = _labels(arrays["y_test"], 10, sources["y_test"])
    _check_official_content(name, {"x_train": arrays["x_train"], "y_train": y_train, "x_test": arrays["x_test"],
                                   "y_test": y_test}, sources, shared_dir)
    return Dataset(
        name=name,
        x_train=_normalize(arrays["x_train"][:, None], stats),
        y_train=y_train,
        x_test=_normalize(arrays["x_test"][:, None], stats),
        y_test=y_test,
        num_classes=10,
    )


def _check_official_content(name: str, arrays: dict[str, np.ndarray | torch.Tensor], sources: dict[str, str],
                            shared_dir: Path | None) -> None:
    """Compare each array of an official release's shape (:data:`_OFFICIAL_SHAPES`) with the official content,
    hashing it once: the other dataset's official images are refused (a helper's review: with MNIST's IDX files in
    ``data_dir``, ``fashion-mnist`` trained on MNIST without a word), and so is an array of the official size whose
    content is neither release's (a reviewer: a flipped label of a plain IDX file, which has no checksum, loaded
    silently).  Labels (already checked to lie in 0..9) are compared as the uint8 the official files hold, so an
    npz file's int64 or float copy of them passes.  Arrays of other shapes (subsets, one's own files) are read as
    they are.  Each array is hashed once, without a copy: about 0.08 s for the four official arrays on one core.

    ``shared_dir`` is ``data_dir`` when the IDX files were read from it (None when they came from ``<name>``'s own
    folder or from an npz file named for ``name``): that folder may hold the other dataset's files by right, so
    the advice is then to give ``name`` its own folder, not to replace the files."""
    other = "fashion-mnist" if name == "mnist" else "mnist"
    for key, shape in _OFFICIAL_SHAPES.items():
        array = np.asarray(arrays[key])
        if key.startswith("y"):
            array = array.reshape(-1).astype(np.uint8)
        if array.shape != shape:
            continue
        digest = hashlib.sha256(np.ascontiguousarray(array)).hexdigest()
        if digest == _OFFICIAL_ARRAYS[name][key]:
            continue
        if digest == _OFFICIAL_ARRAYS[other][key] and key.startswith("x"):
            if shared_dir is not None:
                advice = (f"{other}'s IDX files belong in {shared_dir / other}; put {name}'s four IDX files in "
                          f"{shared_dir / name}, where they are read first (or {name}.npz in {shared_dir})")
            else:
                advice = f"replace the file with {name}'s, from {_SOURCES[name]}"
            raise DataError(f"{sources[key]}: these are {other}'s official images, not {name}'s; {advice}")
        raise DataError(f"{sources[key]}: has the size of {name}'s official release but not its content: a damaged "
                        f"copy? re-download it from {_SOURCES[name]}")


_NPZ_KEYS = ("x_train", "y_train", "x_test", "y_test")
_Layout = tuple[tuple[int, ...], np.dtype]


def _check_layout(layout: dict[str, _Layout], sources: dict[str, str]) -> None:
    """Refuse arrays (given by shape and dtype, ``layout[key]``) that are not MNIST-like, naming the file and
    array (``sources[key]``): uint8 images ``(n, H, W)`` with ``n >= 1`` (an empty test split would train and
    then report no accuracy) and the train split's image size, and one numeric label per image, ``(n,)`` or
    ``(n, 1)`` (one-hot rows are refused with the conversion to use)."""
    for split in ("train", "test"):
        (shape, dtype), (label_shape, label_dtype) = layout[f"x_{split}"], layout[f"y_{split}"]
        images, labels = sources[f"x_{split}"], sources[f"y_{split}"]
        if dtype != np.uint8 or len(shape) != 3 or min(shape[1:], default=0) < 1:
            raise DataError(f"{images}: expected uint8 images of shape (n, H, W) with pixels 0..255, got "
                            f"{dtype} {shape}")
        n = shape[0]
        if n == 0:
            raise DataError(f"{images}: the {split} split holds no images; decentdp needs {split} images "
                            f"({'to measure accuracy' if split == 'test' else 'to train on'})")
        if split == "test" and shape[1:] != layout["x_train"][0][1:]:
            raise DataError(f"{images}: test images are {shape[1]}x{shape[2]} but training images "
                            f"{layout['x_train'][0][1]}x{layout['x_train'][0][2]}; both splits need one size")
        if len(label_shape) == 2 and label_shape[1] > 1:
            key = f"y_{split}"
            raise DataError(f"{labels}: labels of shape {label_shape} hold {label_shape[1]} values per image (one-hot "
                            f"rows?); decentdp reads one class index per image, shape ({label_shape[0]},): save "
                            f"{key}.argmax(axis=1) instead")
        if len(label_shape) not in (1, 2) or label_shape[0] != n or label_shape[1:] not in ((), (1,)):
            raise DataError(f"{labels}: expected one label per image, shape ({n},), got {label_shape}")
        if label_dtype.kind not in "iuf":
            raise DataError(f"{labels}: labels must be numbers (class indices), got dtype {label_dtype}")


def _read_npz(path: Path, sources: dict[str, str]) -> dict[str, np.ndarray]:
    """Read the four arrays of an MNIST-style npz file (the Keras layout), checking their shapes and dtypes
    from the arrays' headers before any array is read (:func:`_check_layout`)."""
    try:
        # (np.load would read a single .npy array, fail on an empty file, and blame pickles for anything else)
        if not zipfile.is_zipfile(path):
            raise DataError(f"{path}: expected an npz (zip) archive with keys {list(_NPZ_KEYS)}; this file is not "
                            "one (empty, truncated, or a single array?)")
        npz = np.load(path, allow_pickle=False)
        with npz:
            missing = [k for k in _NPZ_KEYS if k not in npz.files]
            if missing:
                raise DataError(f"{path}: missing arrays {missing}; expected keys {list(_NPZ_KEYS)}")
            _check_layout(_npz_layout(path), sources)
            return {k: npz[k] for k in _NPZ_KEYS}
    except DataError:
        raise
    except Exception as exc:  # a damaged member raises zlib.error, a damaged .npy header tokenize.TokenError, ...
        reason = next(iter(str(exc).splitlines()), "") or type(exc).__name__
        raise DataError(f"{path}: not a readable npz file ({reason})") from exc


def _npz_layout(path: Path) -> dict[str, _Layout]:
    """Shape and dtype of each of the four arrays of an npz file, from their ``.npy`` headers alone."""
    layout = {}
    with zipfile.ZipFile(path) as archive:
        names = set(archive.namelist())
        for key in _NPZ_KEYS:
            if f"{key}.npy" not in names:  # (np.load lists a member 'x_train' without the suffix as key x_train too)
                raise DataError(f"{path}: array {key} is not stored as {key}.npy (write the file with numpy.savez)")
            with archive.open(f"{key}.npy") as member:
                version = np.lib.format.read_magic(member)
                read = np.lib.format.read_array_header_1_0 if version == (1, 0) else \
                    np.lib.format.read_array_header_2_0
                shape, _, dtype = read(member)
            layout[key] = (shape, dtype)
    return layout


def _find_idx_files(name: str, directory: Path, data_dir: Path) -> dict[str, tuple[Path, Path]] | None:
    """The four IDX files in ``directory`` (plain preferred over ``.gz``), or None if it holds none of them.

    Some but not all of them is a :class:`DataError` naming the present and the missing files, rather than a
    reason to look elsewhere: the files of another directory would be another copy (or, in ``data_dir``, the
    other dataset's).  A partial set in ``data_dir`` itself is only looked at when ``data_dir/<name>`` holds
    nothing, so nothing is left to fall back on; since both datasets' files have the same names, the message
    says whose they may be and where ``name``'s belong.
    """
    found: dict[str, Path] = {}
    missing: list[str] = []
    for stem in (stem for pair in _IDX_FILES.values() for stem in pair):
        path = next((p for p in (directory / stem, directory / f"{stem}.gz") if p.is_file()), None)
        if path is None:
            missing.append(f"{stem}[.gz]")
        else:
            found[stem] = path
    if not found:
        return None
    if missing:
        present = ", ".join(path.name for path in found.values())
        if directory == data_dir:
            raise DataError(f"dataset {name!r}: nothing of it in {data_dir / name}, and {data_dir} holds {present} "
                            f"but not {', '.join(missing)} of the four IDX files (MNIST and Fashion-MNIST share "
                            f"their names, so these may be either's); put {name}'s four files in {data_dir / name} "
                            f"(or {name}.npz in {data_dir}), from {_SOURCES[name]}")
        raise DataError(f"{directory}: holds {present} but not {', '.join(missing)} of {name}'s four IDX files; add "
                        f"the missing file(s), from {_SOURCES[name]}")
    return {split: (found[images], found[labels]) for split, (images, labels) in _IDX_FILES.items()}


def _read_idx(path: Path, magic: int) -> np.ndarray:
    """Parse an IDX file of unsigned bytes (optionally gzipped) and check its magic number and size.

    The IDX header is a big-endian int32 magic (``0x0000 08 D``: unsigned bytes, D dimensions) followed by
    D big-endian int32 sizes; the data follows in row-major order.
    """
    try:
        opener: Callable[..., Any] = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rb") as f:
            raw = f.read()
    except (OSError, EOFError, zlib.error) as exc:  # (zlib.error: a damaged gzip stream)
        raise DataError(f"{path}: cannot read IDX file ({exc})") from exc
    if not raw:  # (not "bad magic number None", as an empty file was told)
        what = "decompresses to nothing" if path.suffix == ".gz" and path.stat().st_size else "is empty"
        raise DataError(f"{path}: the file {what} (an interrupted download or copy?); get it again")
    if len(raw) < 4:
        raise DataError(f"{path}: {len(raw)} byte(s), too short for an IDX header")
    if int.from_bytes(raw[:4], "big") != magic:
        raise DataError(
            f"{path}: bad IDX magic number {hex(int.from_bytes(raw[:4], 'big'))}, expected {hex(magic)} "
            "(wrong file, or a gzip file without the .gz suffix?)"
        )
    ndim = magic & 0xFF
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise DataError(f"{path}: truncated IDX header")
    shape = tuple(int(d) for d in np.frombuffer(raw, dtype=">i4", count=ndim, offset=4))
    if min(shape) < 0:  # numpy's reshape would take one as "unknown" and fail without naming the file
        raise DataError(f"{path}: IDX header announces shape {shape}, with a negative size")
    if len(raw) - header != math.prod(shape):  # exact, where np.prod could wrap around int64
        raise DataError(f"{path}: IDX header announces shape {shape} but holds {len(raw) - header} bytes")
    return np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(shape)


# ----------------------------------------------------------------------------- CIFAR-10 and CIFAR-100

_CIFAR_LAYOUT = {
    # name: (folder, tarball, train members, test member, label key, classes, stats)
    "cifar10": ("cifar-10-batches-py", "cifar-10-python.tar.gz",
                tuple(f"data_batch_{i}" for i in range(1, 6)), "test_batch", b"labels", 10, _CIFAR10_STATS),
    "cifar100": ("cifar-100-python", "cifar-100-python.tar.gz",
                 ("train",), "test", b"fine_labels", 100, _CIFAR100_STATS),
}


class _NumpyOnlyUnpickler(pickle.Unpickler):
    """Unpickler that only rebuilds numpy arrays, so a tampered data file cannot run code.

    The official CIFAR batches are Python 2 pickles of dicts holding one uint8 ndarray and lists of
    labels/names; those need nothing beyond numpy's array reconstructors. Re-pickled copies written by
    Python 3 with protocol 2 also encode bytes through ``_codecs.encode``, which is harmless.
    """

    _ALLOWED_NUMPY = frozenset({"_reconstruct", "ndarray", "dtype", "scalar", "_frombuffer"})

    def find_class(self, module: str, name: str) -> Any:
        numpy_ok = module.split(".")[0] == "numpy" and name in self._ALLOWED_NUMPY
        if numpy_ok or (module, name) == ("_codecs", "encode"):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} from a data file")


def _unpickle(data: bytes, source: str) -> dict[bytes, Any]:
    """Decode one CIFAR batch (``encoding="bytes"`` as the Python 2 pickles require)."""
    try:
        obj = _NumpyOnlyUnpickler(io.BytesIO(data), encoding="bytes").load()
    except Exception as exc:  # a corrupt pickle can raise almost anything, some of it over several lines
        reason = next(iter(str(exc).splitlines()), "") or type(exc).__name__
        raise DataError(f"{source}: not a readable CIFAR batch ({reason})") from exc
    if not isinstance(obj, dict):
        raise DataError(f"{source}: expected a pickled dict, got {type(obj).__name__}")
    return obj


def _load_cifar(name: str, data_dir: Path) -> Dataset:
    """Read CIFAR-10/100 from the extracted official folder, or else from the official tarball."""
    folder, tarball, train_members, test_member, label_key, num_classes, stats = _CIFAR_LAYOUT[name]
    members = (*train_members, test_member)
    if (data_dir / folder).is_dir():
        blobs = {}
        for member in members:
            path = data_dir / folder / member
            try:
                blobs[member] = (path.read_bytes(), str(path))
            except OSError as exc:
                raise DataError(f"{name}: cannot read {path} ({exc}); the folder {data_dir / folder} "
                                f"must hold {', '.join(members)}") from exc
    elif (data_dir / tarball).is_file():
        blobs = _read_tar_members(data_dir / tarball, folder, members)
    else:
        raise DataError(
            f"dataset {name!r} not found in data directory {data_dir}; looked for the folder "
            f"{data_dir / folder} and the archive {data_dir / tarball}. Get it from {_SOURCES[name]}"
        )

    def split(names: tuple[str, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        xs, ys, sources = [], [], []
        for member in names:
            data, source = blobs[member]
            batch = _unpickle(data, source)
            if b"data" not in batch or label_key not in batch:
                raise DataError(f"{source}: missing key b'data' or {label_key!r}")
            x = np.asarray(batch[b"data"])
            y = np.asarray(batch[label_key])
            if x.dtype != np.uint8:  # (a cast would wrap or truncate pixels silently, or fail with a traceback)
                raise DataError(f"{source}: expected uint8 data with pixels 0..255, got {x.dtype}")
            if x.ndim != 2 or x.shape[1] != 3 * 32 * 32 or y.ndim != 1 or len(x) != len(y):
                raise DataError(f"{source}: expected data (n, 3072) and n labels, got {x.shape}, {y.shape}")
            xs.append(x)
            ys.append(_labels(y, num_classes, f"{source}, {label_key.decode()}"))
            sources.append(source)
        if not sum(len(x) for x in xs):  # an empty test split would train and then report no accuracy
            raise DataError(f"{', '.join(sources)}: holds no images; decentdp needs images in every split")
        # Each row holds the R, G and B planes of a 32x32 image in turn: a plain reshape gives NCHW.
        images = np.concatenate(xs).reshape(-1, 3, 32, 32)
        return _normalize(images, stats), torch.cat(ys)

    x_train, y_train = split(train_members)
    x_test, y_test = split((test_member,))
    return Dataset(name=name, x_train=x_train, y_train=y_train, x_test=x_test, y_test=y_test,
                   num_classes=num_classes)


def _read_tar_members(path: Path, folder: str, members: tuple[str, ...]) -> dict[str, tuple[bytes, str]]:
    """Read ``folder/<member>`` for each member straight from a tarball, without extracting it to disk."""
    blobs = {}
    try:
        with tarfile.open(path, "r:*") as tar:
            for member in members:
                arcname = f"{folder}/{member}"
                try:
                    handle = tar.extractfile(arcname)
                except KeyError:
                    handle = None
                if handle is None:  # (a damaged stream ends the member listing early, so it may be there)
                    raise DataError(f"{path}: archive has no readable file {arcname} (missing, or the archive "
                                    "is damaged before it)")
                blobs[member] = (handle.read(), f"{path}:{arcname}")
    except (OSError, EOFError, tarfile.TarError, zlib.error) as exc:
        raise DataError(f"{path}: not a readable tar archive ({' '.join(str(exc).split())})") from exc
    return blobs
