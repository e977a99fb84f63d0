"""LIBSVM's ``a9a`` (UCI Adult, binarized: 123 binary features, income above 50K or not), DECOR's
logistic-regression task (Allouah et al., ICML 2024, Sec. 6), read with scikit-learn's svmlight parser.

The files are LIBSVM's ``a9a`` and ``a9a.t`` (https://www.csie.ntu.edu.tw/~cjlin/libsvmtools/datasets/binary.html),
which the DECOR authors ship as ``libsvm_data/a9a.txt`` and ``a9a_t.txt`` in ``elfirdoussilab1/DECOR``;
either name is accepted, in ``data_dir`` or ``data_dir/a9a``.  They are not redistributed here: each
is checked against the SHA-256 of the authors' copy before it is parsed, so a truncated download or
another file under the same name is refused instead of silently training on something else.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import torch

from decentdp.errors import DataError

#: Features of every a9a record (the test file's largest index is 122: the width is fixed, not inferred).
A9A_FEATURES = 123
#: Accepted names of each split, and the SHA-256 and record count of the authors' copy.
A9A_FILES = {
    "train": (("a9a", "a9a.txt"), "f5d5ffd8d865ff41328e7ee043e4b020816914ff6843ff15b98905ddbedce906", 32_561),
    "test": (("a9a.t", "a9a_t.txt"), "1f448a153f0320399a7e40836eb207655b0bde0f21fc941cc472193daa9f5de9", 16_281),
}
A9A_SOURCE = ("LIBSVM's binary datasets page (a9a, a9a.t) or the DECOR authors' repository "
              "(github.com/elfirdoussilab1/DECOR, libsvm_data/a9a.txt and a9a_t.txt)")


def find_a9a(data_dir: Path) -> dict[str, Path]:
    """Each split's file in ``data_dir`` or ``data_dir/a9a``, or a :class:`DataError` naming what is missing."""
    found: dict[str, Path] = {}
    for split, (names, _, _) in A9A_FILES.items():
        candidates = [folder / name for folder in (data_dir, data_dir / "a9a") for name in names]
        existing = [path for path in candidates if path.is_file()]
        if not existing:
            raise DataError(f"a9a: no {split} file ({' or '.join(names)}) in {data_dir} or {data_dir / 'a9a'}; "
                            f"get it from {A9A_SOURCE}")
        found[split] = existing[0]
    return found


def check_file(path: Path, expected_sha256: str) -> None:
    """Refuse a file whose SHA-256 is not the expected one (a partial download, another dataset)."""
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != expected_sha256:
        raise DataError(f"{path}: SHA-256 {digest} is not that of a9a's copy ({expected_sha256}); the file is "
                        f"damaged or another one: get it again from {A9A_SOURCE}")


def read_svmlight(path: Path, features: int, records: int) -> tuple[np.ndarray, np.ndarray]:
    """Dense float32 features ``(records, features)`` and labels in {0, 1} (LIBSVM's -1 / +1) of one file.

    Feature indices are 1-based, as LIBSVM's format defines them (a9a's run 1..123): index ``k`` is column
    ``k - 1``, and an index 0 is refused.  scikit-learn's default, ``zero_based="auto"``, instead reads the whole
    file as 0-based as soon as one index 0 appears anywhere in it, which moves every other feature one column
    along without a word; a file written 0-based is refused here at its index 0 (one whose feature 0 never occurs
    cannot be told from a 1-based one, and is read as the format says).  Every error is a :class:`DataError`
    naming the file (and the line, for an index too large for the parser's integers).
    """
    from sklearn.datasets import load_svmlight_file

    try:
        x, y = load_svmlight_file(str(path), n_features=features, zero_based=False)
    except ValueError as exc:
        raise DataError(f"{path}: not a LIBSVM file of {features} features (indices 1..{features}): {exc}") from None
    except OverflowError:  # (an index past the parser's C integers: 'Python int too large to convert to C long')
        where = _first_index_outside(path, features)
        raise DataError(f"{path}: not a LIBSVM file of {features} features (indices 1..{features}): "
                        + (f"line {where[0]} has feature index {where[1]}" if where else "a feature index is too "
                           "large to read")) from None
    labels = set(np.unique(y).tolist())
    if not labels <= {-1.0, 1.0} or x.shape[0] != records:
        raise DataError(f"{path}: expected {records} records labelled -1 / +1, found {x.shape[0]} labelled "
                        f"{sorted(labels)}")
    return np.asarray(x.todense(), dtype=np.float32), (y > 0).astype(np.int64)


def _first_index_outside(path: Path, features: int) -> tuple[int, str] | None:
    """The first line (numbered from 1) holding a feature index outside ``1..features``, and that index as written;
    None if there is none (qid fields and comments after ``#`` are not features)."""
    with path.open("rb") as file:
        for number, line in enumerate(file, start=1):
            for token in line.split(b"#", 1)[0].split()[1:]:
                index, _, _ = token.partition(b":")
                if index == b"qid":
                    continue
                try:
                    outside = not 1 <= int(index) <= features
                except ValueError:
                    continue
                if outside:
                    return number, index.decode("ascii", "replace")
    return None


def load_a9a(data_dir: Path) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """a9a's train and test splits as ``(x_train, y_train, x_test, y_test)``: features ``(n, 1, 1, 123)``
    float32 (0 / 1, unscaled as in the paper), labels int64 in {0, 1}."""
    arrays = []
    for split, path in find_a9a(data_dir).items():
        _, digest, records = A9A_FILES[split]
        check_file(path, digest)
        x, y = read_svmlight(path, A9A_FEATURES, records)
        arrays += [torch.from_numpy(x.reshape(-1, 1, 1, A9A_FEATURES)), torch.from_numpy(y)]
    x_train, y_train, x_test, y_test = arrays
    return x_train, y_train, x_test, y_test
