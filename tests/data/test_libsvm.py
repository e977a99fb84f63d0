"""LIBSVM's a9a (DECOR's logistic-regression task): file discovery, checksums and parsing, on small files written
here (a9a is not redistributed; the real files are read where ``$DECENTDP_DATA_DIR`` or ``../shared/data`` holds
them)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from tests.conftest import SHARED_DATA

from decentdp.data import libsvm
from decentdp.errors import DataError

LINES = ["-1 3:1 11:1 14:1 123:1", "+1 1:1 2:1", "-1 5:1 7:0.5"]


def _write(path: Path, lines: list[str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def test_parses_sparse_records_into_dense_rows_with_zero_one_labels(tmp_path: Path) -> None:
    x, y = libsvm.read_svmlight(_write(tmp_path / "a9a", LINES), libsvm.A9A_FEATURES, 3)
    assert x.shape == (3, 123) and x.dtype == np.float32
    assert x[0, [2, 10, 13, 122]].tolist() == [1.0, 1.0, 1.0, 1.0] and x[0].sum() == 4.0   # 1-based indices
    assert x[2, 6] == 0.5 and y.tolist() == [0, 1, 0]


def test_either_name_in_the_folder_or_its_a9a_subfolder(tmp_path: Path) -> None:
    _write(tmp_path / "a9a" / "a9a.txt", LINES)
    _write(tmp_path / "a9a.t", LINES)
    found = libsvm.find_a9a(tmp_path)
    assert found == {"train": tmp_path / "a9a" / "a9a.txt", "test": tmp_path / "a9a.t"}
    with pytest.raises(DataError, match=r"no test file \(a9a.t or a9a_t.txt\)"):
        libsvm.find_a9a(tmp_path / "a9a")


def test_a_file_that_is_not_the_authors_copy_is_refused_before_parsing(tmp_path: Path) -> None:
    _write(tmp_path / "a9a", LINES)
    _write(tmp_path / "a9a.t", LINES)
    with pytest.raises(DataError, match="SHA-256 .* is not that of a9a's copy"):
        libsvm.load_a9a(tmp_path)


@pytest.mark.parametrize(("lines", "message"), [
    (["2 1:1", "-1 2:1", "+1 3:1"], r"labelled \[-1.0, 1.0, 2.0\]"),
    (["-1 1:1", "+1 2:1"], "expected 3 records"),
    (["-1 1:x"], "not a LIBSVM file"),
])
def test_damaged_records_name_the_file(tmp_path: Path, lines: list[str], message: str) -> None:
    with pytest.raises(DataError, match=message):
        libsvm.read_svmlight(_write(tmp_path / "a9a", lines), libsvm.A9A_FEATURES, 3)


def test_an_index_too_large_for_the_parser_names_the_file_and_line(tmp_path: Path) -> None:
    """scikit-learn's parser raised an uncaught OverflowError ('Python int too large to convert to C long')."""
    path = _write(tmp_path / "a9a", ["-1 1:1", "+1 2:1 99999999999999999999:1", "-1 3:1"])
    with pytest.raises(DataError, match=r"a9a: not a LIBSVM file .*line 2 has feature index 99999999999999999999"):
        libsvm.read_svmlight(path, libsvm.A9A_FEATURES, 3)


def test_a_zero_based_file_is_refused_not_shifted(tmp_path: Path) -> None:
    """LIBSVM's indices start at 1; scikit-learn's zero_based="auto" read a file with an index 0 anywhere as
    0-based, so every other feature of it landed one column off from a9a's."""
    path = _write(tmp_path / "a9a", ["-1 0:1 3:1", "+1 1:1 2:1", "-1 5:1"])
    with pytest.raises(DataError, match=r"a9a: not a LIBSVM file of 123 features \(indices 1..123\): Invalid index 0"):
        libsvm.read_svmlight(path, libsvm.A9A_FEATURES, 3)


def test_the_real_files_load_with_their_known_sizes() -> None:
    try:
        libsvm.find_a9a(SHARED_DATA)
    except DataError as exc:
        pytest.skip(f"a9a is not in {SHARED_DATA} ({exc})")
    x_train, y_train, x_test, y_test = libsvm.load_a9a(SHARED_DATA)
    assert x_train.shape == (32_561, 1, 1, 123) and x_test.shape == (16_281, 1, 1, 123)
    assert set(y_train.unique().tolist()) == {0, 1} and 0.2 < float(y_train.double().mean()) < 0.3
