"""Tests of the dataset loaders: the bundled digits, real (Fashion-)MNIST when present, and every file format
on tiny files written in the official layouts."""

from __future__ import annotations

import collections
import gzip
import io
import pickle
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch

from decentdp.data import datasets
from decentdp.data.datasets import DATASETS, Dataset, load_dataset
from decentdp.errors import ConfigError, DataError

from conftest import SHARED_DATA, cifar_batch

CIFAR10_MEAN, CIFAR10_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
CIFAR100_MEAN, CIFAR100_STD = (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)


def check_layout(ds: Dataset, shape: tuple[int, int, int], n_train: int, n_test: int, n_classes: int) -> None:
    assert ds.x_train.dtype == torch.float32 and ds.x_test.dtype == torch.float32
    assert ds.y_train.dtype == torch.int64 and ds.y_test.dtype == torch.int64
    assert ds.x_train.shape == (n_train, *shape) and ds.x_test.shape == (n_test, *shape)
    assert ds.y_train.shape == (n_train,) and ds.y_test.shape == (n_test,)
    assert ds.input_shape == shape
    assert ds.num_classes == n_classes


# ----------------------------------------------------------------------------- digits


def test_digits_shapes_and_standardization() -> None:
    ds = load_dataset("digits")
    check_layout(ds, (1, 8, 8), 1437, 360, 10)
    # Fixed public constants (not the pooled training statistics), so only close to 0 and 1.
    assert abs(ds.x_train.mean().item()) < 1e-2
    assert abs(ds.x_train.std().item() - 1.0) < 1e-2
    # Stratified split: every class appears in the test set in proportion.
    assert torch.bincount(ds.y_test, minlength=10).min() >= 35


def test_digits_split_is_deterministic_and_ignores_data_dir(tmp_path: Path) -> None:
    a, b = load_dataset("digits"), load_dataset("digits", tmp_path / "nowhere")
    assert torch.equal(a.x_train, b.x_train) and torch.equal(a.y_test, b.y_test)


def test_digits_resize() -> None:
    ds = load_dataset("digits", image_size=16)
    check_layout(ds, (1, 16, 16), 1437, 360, 10)


# ----------------------------------------------------------------------------- real MNIST / Fashion-MNIST


@pytest.mark.parametrize("name", ["mnist", "fashion-mnist"])
def test_real_mnist_like(name: str) -> None:
    if not (SHARED_DATA / f"{name}.npz").is_file():
        pytest.skip(f"{SHARED_DATA / f'{name}.npz'} not present (set DECENTDP_DATA_DIR to run this test)")
    ds = load_dataset(name, SHARED_DATA)
    check_layout(ds, (1, 28, 28), 60000, 10000, 10)
    assert abs(ds.x_train.mean().item()) < 1e-3
    assert abs(ds.x_train.std().item() - 1.0) < 1e-3
    assert torch.bincount(ds.y_train, minlength=10).min() > 5000


def test_the_other_datasets_idx_files_are_refused_and_the_own_folder_comes_first(tmp_path: Path) -> None:
    """The four IDX files have the same names in MNIST and Fashion-MNIST (a helper's review: MNIST's files in the
    data directory made ``fashion-mnist`` train on MNIST).  The dataset's own folder is read first, and the other
    dataset's official images are refused, naming the file."""
    if not all((SHARED_DATA / f"{name}.npz").is_file() for name in ("mnist", "fashion-mnist")):
        pytest.skip(f"MNIST and Fashion-MNIST npz files not in {SHARED_DATA} (set DECENTDP_DATA_DIR)")
    for name in ("mnist", "fashion-mnist"):
        with np.load(SHARED_DATA / f"{name}.npz") as npz:
            write_idx(tmp_path / ("top" if name == "mnist" else "top/fashion-mnist"), dict(npz), gz=False)
    with pytest.raises(DataError, match="train-images-idx3-ubyte: these are fashion-mnist's official images"):
        load_dataset("mnist", tmp_path / "top" / "fashion-mnist")
    fashion = load_dataset("fashion-mnist", tmp_path / "top")  # its folder, not MNIST's files beside it
    assert abs(float(fashion.x_train.mean())) < 1e-3  # Fashion's own statistics centre it (MNIST's: -0.44)
    (tmp_path / "top" / "fashion-mnist").rename(tmp_path / "elsewhere")
    with pytest.raises(DataError, match="these are mnist's official images, not fashion-mnist's") as info:
        load_dataset("fashion-mnist", tmp_path / "top")
    # MNIST's files may sit in the data directory by right: the advice is Fashion-MNIST's own folder
    assert f"mnist's IDX files belong in {tmp_path / 'top' / 'mnist'}; put fashion-mnist's four IDX files in " \
           f"{tmp_path / 'top' / 'fashion-mnist'}" in str(info.value)
    (tmp_path / "elsewhere").rename(tmp_path / "top" / "mnist")  # and in MNIST's folder, replacing them is
    with pytest.raises(DataError, match="mnist/train-images-idx3-ubyte: these are fashion-mnist's official images, "
                                        "not mnist's; replace the file with mnist's"):
        load_dataset("mnist", tmp_path / "top")


def test_a_damaged_copy_of_the_official_files_is_refused_naming_the_file(tmp_path: Path) -> None:
    """Plain IDX files carry no checksum (a reviewer: one flipped label loaded silently): arrays of the official
    size are compared with the official content, labels as the uint8 the official files hold (so an npz copy
    with int64 labels passes)."""
    if not (SHARED_DATA / "mnist.npz").is_file():
        pytest.skip(f"{SHARED_DATA / 'mnist.npz'} not present (set DECENTDP_DATA_DIR to run this test)")
    with np.load(SHARED_DATA / "mnist.npz") as npz:
        official = dict(npz)
    write_idx(tmp_path, official, gz=False)
    assert torch.equal(load_dataset("mnist", tmp_path).y_test, torch.from_numpy(official["y_test"].astype(np.int64)))
    (tmp_path / "mnist").mkdir()
    np.savez(tmp_path / "mnist" / "mnist.npz", **official | {"y_train": official["y_train"].astype(np.int64)})
    assert len(load_dataset("mnist", tmp_path).y_train) == 60000
    (tmp_path / "mnist" / "mnist.npz").unlink()
    for key, stem in (("y_train", "train-labels-idx1-ubyte"), ("x_test", "t10k-images-idx3-ubyte")):
        damaged = dict(official)
        damaged[key] = official[key].copy()
        damaged[key].reshape(-1)[200] = (int(damaged[key].reshape(-1)[200]) + 1) % 10  # a label or pixel moved
        write_idx(tmp_path, damaged, gz=False)
        with pytest.raises(DataError, match=rf"{stem}: has the size of mnist's official release but not its "
                                            r"content: a damaged copy\? re-download it"):
            load_dataset("mnist", tmp_path)


def test_real_mnist_resized_to_32() -> None:
    if not (SHARED_DATA / "mnist.npz").is_file():
        pytest.skip(f"{SHARED_DATA / 'mnist.npz'} not present (set DECENTDP_DATA_DIR to run this test)")
    ds = load_dataset("mnist", str(SHARED_DATA), image_size=32)
    check_layout(ds, (1, 32, 32), 60000, 10000, 10)


# ----------------------------------------------------------------------------- IDX and npz files


def idx_bytes(array: np.ndarray, magic: int | None = None) -> bytes:
    """Encode a uint8 array in the IDX format (big-endian header: magic 0x0000 08 ndim, then the sizes)."""
    magic = 0x0800 | array.ndim if magic is None else magic
    header = magic.to_bytes(4, "big") + b"".join(int(d).to_bytes(4, "big") for d in array.shape)
    return header + array.astype(np.uint8).tobytes()


def tiny_mnist(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "x_train": rng.integers(0, 256, size=(7, 28, 28), dtype=np.uint8),
        "y_train": rng.integers(0, 10, size=7, dtype=np.uint8),
        "x_test": rng.integers(0, 256, size=(3, 28, 28), dtype=np.uint8),
        "y_test": rng.integers(0, 10, size=3, dtype=np.uint8),
    }


def write_idx(directory: Path, arrays: dict[str, np.ndarray], gz: bool) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    names = {
        "x_train": "train-images-idx3-ubyte",
        "y_train": "train-labels-idx1-ubyte",
        "x_test": "t10k-images-idx3-ubyte",
        "y_test": "t10k-labels-idx1-ubyte",
    }
    for key, stem in names.items():
        data = idx_bytes(arrays[key])
        if gz:
            (directory / f"{stem}.gz").write_bytes(gzip.compress(data))
        else:
            (directory / stem).write_bytes(data)


def check_mnist_values(ds: Dataset, arrays: dict[str, np.ndarray], mean: float, std: float) -> None:
    check_layout(ds, (1, 28, 28), 7, 3, 10)
    for split in ("train", "test"):
        x = (arrays[f"x_{split}"][:, None].astype(np.float32) / 255 - mean) / std
        np.testing.assert_allclose(getattr(ds, f"x_{split}").numpy(), x, rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(getattr(ds, f"y_{split}").numpy(), arrays[f"y_{split}"])


@pytest.mark.parametrize("gz", [False, True])
@pytest.mark.parametrize("subdir", [False, True])
@pytest.mark.parametrize(
    ("name", "mean", "std"), [("mnist", 0.1307, 0.3081), ("fashion-mnist", 0.2860, 0.3530)]
)
def test_idx_files(tmp_path: Path, gz: bool, subdir: bool, name: str, mean: float, std: float) -> None:
    arrays = tiny_mnist()
    write_idx(tmp_path / name if subdir else tmp_path, arrays, gz)
    check_mnist_values(load_dataset(name, tmp_path), arrays, mean, std)


def test_npz_file(tmp_path: Path) -> None:
    arrays = tiny_mnist(1)
    np.savez(tmp_path / "mnist.npz", **arrays)
    check_mnist_values(load_dataset("mnist", tmp_path), arrays, 0.1307, 0.3081)


def test_npz_missing_key(tmp_path: Path) -> None:
    arrays = tiny_mnist()
    del arrays["y_test"]
    np.savez(tmp_path / "mnist.npz", **arrays)
    with pytest.raises(DataError, match="y_test"):
        load_dataset("mnist", tmp_path)


@pytest.mark.parametrize("content", [b"", b"hello\n", b"truncated", b"single array"])
def test_npz_not_an_archive(tmp_path: Path, content: bytes) -> None:
    """An empty, garbage, truncated or single-array mnist.npz is a DataError naming the file (an empty file was
    numpy's EOFError, a text file 'contains pickled (object) data')."""
    path = tmp_path / "mnist.npz"
    if content == b"truncated":
        np.savez(path, **tiny_mnist())
        path.write_bytes(path.read_bytes()[:1000])
    elif content == b"single array":
        with path.open("wb") as file:
            np.save(file, tiny_mnist()["x_train"])
    else:
        path.write_bytes(content)
    with pytest.raises(DataError, match="mnist.npz: expected an npz .zip. archive") as info:
        load_dataset("mnist", tmp_path)
    assert "pickle" not in str(info.value)


def test_npz_labels_without_a_column_are_refused(tmp_path: Path) -> None:
    """Labels of shape (n, 0) passed the check (only a second axis above 1 was refused) and gave n images with no
    label: a whole run trained, reported accuracy nan and ended in a traceback."""
    arrays = tiny_mnist()
    arrays["y_test"] = np.zeros((3, 0), dtype=np.uint8)
    np.savez(tmp_path / "mnist.npz", **arrays)
    with pytest.raises(DataError, match=r"mnist.npz, array y_test: expected one label per image"):
        load_dataset("mnist", tmp_path)


def test_npz_with_a_damaged_compressed_member_is_one_message_naming_the_file(tmp_path: Path) -> None:
    """A damaged deflate stream inside a compressed npz raised zlib.error ('Error -3 while decompressing data'), or
    a damaged .npy header tokenize.TokenError, with no file name.  (Blank images compress, so the bytes flipped
    lie in a deflate stream; random ones would be stored and fail the CRC check, which was already caught.)"""
    arrays = tiny_mnist()
    arrays["x_train"][:] = 0
    arrays["x_test"][:] = 0
    path = tmp_path / "mnist.npz"
    np.savez_compressed(path, **arrays)
    original = path.read_bytes()
    for start in (60, 80, 120):
        damaged = bytearray(original)
        damaged[start:start + 20] = bytes(b ^ 0xFF for b in damaged[start:start + 20])
        path.write_bytes(bytes(damaged))
        with pytest.raises(DataError, match="mnist.npz: not a readable npz file"):
            load_dataset("mnist", tmp_path)


def test_npz_member_without_the_npy_suffix_is_named(tmp_path: Path) -> None:
    """numpy lists a zip member 'x_train' as key x_train, but the header check opened 'x_train.npy': KeyError."""
    import zipfile

    with zipfile.ZipFile(tmp_path / "mnist.npz", "w") as archive:
        for key, array in tiny_mnist().items():
            buffer = io.BytesIO()
            np.save(buffer, array)
            archive.writestr(key, buffer.getvalue())
    with pytest.raises(DataError, match="mnist.npz: array x_train is not stored as x_train.npy"):
        load_dataset("mnist", tmp_path)


def test_idx_bad_magic(tmp_path: Path) -> None:
    arrays = tiny_mnist()
    write_idx(tmp_path, arrays, gz=False)
    (tmp_path / "train-labels-idx1-ubyte").write_bytes(idx_bytes(arrays["y_train"], magic=0x0803))
    with pytest.raises(DataError, match="magic"):
        load_dataset("mnist", tmp_path)


def test_idx_truncated(tmp_path: Path) -> None:
    arrays = tiny_mnist()
    write_idx(tmp_path, arrays, gz=True)
    truncated = idx_bytes(arrays["x_test"])[:-10]
    (tmp_path / "t10k-images-idx3-ubyte.gz").write_bytes(gzip.compress(truncated))
    with pytest.raises(DataError, match="t10k-images"):
        load_dataset("mnist", tmp_path)


@pytest.mark.parametrize("sizes", [(-50, -28, 28), (-1, 28, 28), (7, -28, -28)])
def test_idx_negative_sizes_are_refused_naming_the_file(tmp_path: Path, sizes: tuple[int, int, int]) -> None:
    """Two negative sizes whose product matches the data passed the size check, and numpy's reshape raised
    'can only specify one unknown dimension' without naming the file (a reviewer)."""
    write_idx(tmp_path, tiny_mnist(), gz=False)
    header = (0x0803).to_bytes(4, "big") + b"".join(d.to_bytes(4, "big", signed=True) for d in sizes)
    (tmp_path / "train-images-idx3-ubyte").write_bytes(header + bytes(abs(sizes[0] * sizes[1] * sizes[2])))
    with pytest.raises(DataError, match=r"train-images-idx3-ubyte: IDX header announces shape .*negative size"):
        load_dataset("mnist", tmp_path)


def test_a_damaged_gzip_stream_is_one_message_naming_the_file(tmp_path: Path) -> None:
    """A flipped byte inside a .gz stream raises zlib.error, not OSError (a helper's review: a traceback); every
    position tried gives one DataError naming the file."""
    for position in range(10, 40):
        folder = tmp_path / str(position)
        write_idx(folder, tiny_mnist(), gz=True)
        path = folder / "train-images-idx3-ubyte.gz"
        raw = bytearray(path.read_bytes())
        raw[position] ^= 0xFF
        path.write_bytes(bytes(raw))
        with pytest.raises(DataError, match="train-images-idx3-ubyte.gz"):
            load_dataset("mnist", folder)


def test_a_damaged_cifar_tarball_is_one_message_naming_the_file(tmp_path: Path) -> None:
    write_cifar(tmp_path, "cifar10", as_tarball=True)
    good = (tmp_path / "cifar-10-python.tar.gz").read_bytes()
    for position in range(100, 3000, 7):  # (zlib.error at 276, 325, 920, ... before it was caught)
        raw = bytearray(good)
        raw[position] ^= 0xFF
        (tmp_path / "cifar-10-python.tar.gz").write_bytes(bytes(raw))
        try:
            load_dataset("cifar10", tmp_path)
        except DataError as error:
            assert "cifar-10-python.tar.gz" in str(error) and "\n" not in str(error)


def test_arrays_of_the_official_size_must_be_official(tmp_path: Path) -> None:
    """Images of the official release's size that are neither release's content are refused (here blank ones,
    without the real files); the tiny sets of the other tests show that other sizes load as they are."""
    arrays = {"x_train": np.zeros((60000, 28, 28), np.uint8), "y_train": np.zeros(60000, np.uint8),
              "x_test": np.zeros((3, 28, 28), np.uint8), "y_test": np.zeros(3, np.uint8)}
    write_idx(tmp_path / "fashion-mnist", arrays, gz=False)
    with pytest.raises(DataError, match="fashion-mnist/train-images-idx3-ubyte: has the size of fashion-mnist's "
                                        "official release but not its content"):
        load_dataset("fashion-mnist", tmp_path)


def test_a_folder_with_some_of_the_idx_files_is_refused_not_skipped(tmp_path: Path) -> None:
    """Three of Fashion-MNIST's four files in data_dir/fashion-mnist made the loader skip that folder and train on
    the (MNIST) files in data_dir under the name fashion-mnist (a reviewer); now the folder is named with its
    present and missing files."""
    write_idx(tmp_path, tiny_mnist(0), gz=True)
    write_idx(tmp_path / "fashion-mnist", tiny_mnist(1), gz=True)
    (tmp_path / "fashion-mnist" / "t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(DataError) as info:
        load_dataset("fashion-mnist", tmp_path)
    assert str(info.value) == (
        f"{tmp_path / 'fashion-mnist'}: holds train-images-idx3-ubyte.gz, train-labels-idx1-ubyte.gz, "
        "t10k-images-idx3-ubyte.gz but not t10k-labels-idx1-ubyte[.gz] of fashion-mnist's four IDX files; add the "
        f"missing file(s), from {datasets._SOURCES['fashion-mnist']}")


def test_mnist_missing_files(tmp_path: Path) -> None:
    write_idx(tmp_path, tiny_mnist(), gz=False)
    (tmp_path / "t10k-labels-idx1-ubyte").unlink()
    with pytest.raises(DataError) as info:
        load_dataset("mnist", tmp_path)
    message = str(info.value)
    assert "'mnist'" in message and str(tmp_path) in message
    assert "mnist.npz" in message and "t10k-labels-idx1-ubyte" in message
    # the missing file is named as missing, and the present ones as possibly the other dataset's
    assert "holds train-images-idx3-ubyte, train-labels-idx1-ubyte, t10k-images-idx3-ubyte but not " \
           "t10k-labels-idx1-ubyte[.gz]" in message and "may be either's" in message
    assert f"put mnist's four files in {tmp_path / 'mnist'}" in message


@pytest.mark.parametrize(("content", "said"), [(b"", "the file is empty"),
                                               (gzip.compress(b""), "the file decompresses to nothing")],
                         ids=["empty", "empty-stream"])
def test_an_empty_idx_file_is_called_empty(tmp_path: Path, content: bytes, said: str) -> None:
    """A 0-byte file was 'bad IDX magic number None ... (a gzip file without the .gz suffix?)'."""
    write_idx(tmp_path, tiny_mnist(), gz=True)
    (tmp_path / "t10k-labels-idx1-ubyte.gz").write_bytes(content)
    with pytest.raises(DataError, match=f"t10k-labels-idx1-ubyte.gz: {said}") as info:
        load_dataset("mnist", tmp_path)
    assert "magic" not in str(info.value)
    (tmp_path / "t10k-labels-idx1-ubyte.gz").unlink()
    (tmp_path / "t10k-labels-idx1-ubyte").write_bytes(b"")
    with pytest.raises(DataError, match="t10k-labels-idx1-ubyte: the file is empty"):
        load_dataset("mnist", tmp_path)


def test_missing_data_dir_argument() -> None:
    with pytest.raises(DataError, match="--data-dir / data.data_dir"):
        load_dataset("mnist")


def test_nonexistent_data_dir(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="nowhere"):
        load_dataset("fashion-mnist", tmp_path / "nowhere")


# ----------------------------------------------------------------------------- CIFAR


CIFAR_FORMATS = {
    "cifar10": ("cifar-10-batches-py", [f"data_batch_{i}" for i in range(1, 6)], "test_batch", b"labels", 10,
                "batches.meta", CIFAR10_MEAN, CIFAR10_STD),
    "cifar100": ("cifar-100-python", ["train"], "test", b"fine_labels", 100, "meta",
                 CIFAR100_MEAN, CIFAR100_STD),
}


def write_cifar(
    root: Path, name: str, as_tarball: bool, protocol: int = 2
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Write tiny CIFAR files (folder or .tar.gz) and return the raw train/test data and labels.

    Protocol 2 is what the official (Python 2) files use; newer protocols cover re-pickled copies.
    """
    folder, train_members, test_member, label_key, n_classes, meta, _, _ = CIFAR_FORMATS[name]
    rng = np.random.default_rng(5)
    files = {m: cifar_batch(2, rng, label_key, n_classes) for m in train_members}
    files[test_member] = cifar_batch(3, rng, label_key, n_classes)
    files[meta] = {b"label_names": [b"x"] * n_classes}
    blobs = {m: pickle.dumps(d, protocol=protocol) for m, d in files.items()}
    if as_tarball:
        tar_path = root / ("cifar-10-python.tar.gz" if name == "cifar10" else "cifar-100-python.tar.gz")
        with tarfile.open(tar_path, "w:gz") as tar:
            for member, blob in blobs.items():
                info = tarfile.TarInfo(f"{folder}/{member}")
                info.size = len(blob)
                tar.addfile(info, io.BytesIO(blob))
    else:
        (root / folder).mkdir()
        for member, blob in blobs.items():
            (root / folder / member).write_bytes(blob)

    def stack(members: list[str]) -> tuple[np.ndarray, np.ndarray]:
        x = np.concatenate([files[m][b"data"] for m in members])
        y = np.concatenate([np.asarray(files[m][label_key]) for m in members])
        return x, y

    return (*stack(train_members), *stack([test_member]))


@pytest.mark.parametrize("as_tarball", [False, True])
@pytest.mark.parametrize("name", ["cifar10", "cifar100"])
def test_cifar_formats(tmp_path: Path, name: str, as_tarball: bool) -> None:
    x_train, y_train, x_test, y_test = write_cifar(tmp_path, name, as_tarball)
    _, train_members, _, _, n_classes, _, mean, std = CIFAR_FORMATS[name]
    ds = load_dataset(name, tmp_path)
    check_layout(ds, (3, 32, 32), 2 * len(train_members), 3, n_classes)
    np.testing.assert_array_equal(ds.y_train.numpy(), y_train)
    np.testing.assert_array_equal(ds.y_test.numpy(), y_test)
    # Row layout: 1024 red values, then green, then blue, each plane row-major.
    for x_raw, x in ((x_train, ds.x_train), (x_test, ds.x_test)):
        for c in range(3):
            for (row, col) in ((0, 0), (0, 31), (5, 7), (31, 0)):
                raw = x_raw[:, c * 1024 + row * 32 + col].astype(np.float32)
                expected = (raw / 255 - mean[c]) / std[c]
                np.testing.assert_allclose(x[:, c, row, col].numpy(), expected, rtol=1e-5)


def test_cifar_channel_order(tmp_path: Path) -> None:
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    data = np.zeros((1, 3072), dtype=np.uint8)
    data[0, :1024] = 255  # pure red image
    for member in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        (folder / member).write_bytes(pickle.dumps({b"data": data, b"labels": [3]}, protocol=2))
    x = load_dataset("cifar10", tmp_path).x_test[0]
    for c, expected in enumerate((1.0, 0.0, 0.0)):
        assert torch.allclose(x[c], torch.full((32, 32), (expected - CIFAR10_MEAN[c]) / CIFAR10_STD[c]))


@pytest.mark.parametrize("protocol", [3, pickle.HIGHEST_PROTOCOL])
def test_cifar_python3_pickles(tmp_path: Path, protocol: int) -> None:
    _, y_train, x_test, _ = write_cifar(tmp_path, "cifar100", as_tarball=False, protocol=protocol)
    ds = load_dataset("cifar100", tmp_path)
    np.testing.assert_array_equal(ds.y_train.numpy(), y_train)
    expected = (x_test[:, :1024].reshape(-1, 32, 32) / 255 - CIFAR100_MEAN[0]) / CIFAR100_STD[0]
    np.testing.assert_allclose(ds.x_test[:, 0].numpy(), expected, rtol=1e-5, atol=1e-6)


def test_cifar_resize(tmp_path: Path) -> None:
    write_cifar(tmp_path, "cifar10", as_tarball=False)
    assert load_dataset("cifar10", tmp_path, image_size=24).input_shape == (3, 24, 24)


@pytest.mark.parametrize("name", ["cifar10", "cifar100"])
def test_cifar_missing(tmp_path: Path, name: str) -> None:
    with pytest.raises(DataError) as info:
        load_dataset(name, tmp_path)
    message = str(info.value)
    assert repr(name) in message and str(tmp_path) in message and ".tar.gz" in message


def test_cifar_missing_member(tmp_path: Path) -> None:
    write_cifar(tmp_path, "cifar10", as_tarball=False)
    (tmp_path / "cifar-10-batches-py" / "data_batch_3").unlink()
    with pytest.raises(DataError, match="data_batch_3"):
        load_dataset("cifar10", tmp_path)


def test_cifar_tarball_missing_member(tmp_path: Path) -> None:
    with tarfile.open(tmp_path / "cifar-100-python.tar.gz", "w:gz") as tar:
        blob = pickle.dumps({b"data": np.zeros((1, 3072), np.uint8), b"fine_labels": [0]}, protocol=2)
        info = tarfile.TarInfo("cifar-100-python/train")
        info.size = len(blob)
        tar.addfile(info, io.BytesIO(blob))
    with pytest.raises(DataError, match="cifar-100-python/test"):
        load_dataset("cifar100", tmp_path)


def test_cifar_refuses_non_numpy_pickles(tmp_path: Path) -> None:
    write_cifar(tmp_path, "cifar10", as_tarball=False)
    evil = pickle.dumps(collections.OrderedDict(data=1), protocol=2)
    (tmp_path / "cifar-10-batches-py" / "test_batch").write_bytes(evil)
    with pytest.raises(DataError, match="refusing"):
        load_dataset("cifar10", tmp_path)


def test_cifar_unreadable_batch_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A decoder error over several lines (numpy's reconstructors can raise such) becomes one line naming the file."""
    write_cifar(tmp_path, "cifar10", as_tarball=False)

    def fail(_self: object) -> None:
        raise ValueError("first line of the reason\n  second line\n  third line")

    monkeypatch.setattr(datasets._NumpyOnlyUnpickler, "load", fail)
    with pytest.raises(DataError) as info:
        load_dataset("cifar10", tmp_path)
    assert "\n" not in str(info.value)
    assert "data_batch_1: not a readable CIFAR batch (first line of the reason)" in str(info.value)


def test_cifar_labels_out_of_range(tmp_path: Path) -> None:
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    for member in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = {b"data": np.zeros((1, 3072), np.uint8), b"labels": [10]}
        (folder / member).write_bytes(pickle.dumps(batch, protocol=2))
    with pytest.raises(DataError, match="labels"):
        load_dataset("cifar10", tmp_path)


@pytest.mark.parametrize("data", [np.full((1, 3072), 0.5), np.full((1, 3072), 300), "str"])
def test_cifar_data_not_uint8(tmp_path: Path, data: object) -> None:
    """Pixels that are not uint8 are refused, naming the batch file: they were cast (0.5 -> 0, 300 -> 44) or
    raised numpy's ValueError."""
    write_cifar(tmp_path, "cifar10", as_tarball=False)
    batch = {b"data": data, b"labels": [0]}
    (tmp_path / "cifar-10-batches-py" / "test_batch").write_bytes(pickle.dumps(batch, protocol=2))
    with pytest.raises(DataError, match="test_batch: expected uint8 data"):
        load_dataset("cifar10", tmp_path)


# ----------------------------------------------------------------------------- configuration errors


def test_unknown_dataset_lists_allowed() -> None:
    with pytest.raises(ConfigError) as info:
        load_dataset("imagenet")
    assert info.value.field == "data.dataset"
    assert all(name in str(info.value) for name in DATASETS)


@pytest.mark.parametrize("size", [0, -3, 2.5, True])
def test_bad_image_size(size: object) -> None:
    with pytest.raises(ConfigError) as info:
        load_dataset("digits", image_size=size)  # type: ignore[arg-type]
    assert info.value.field == "data.image_size"
