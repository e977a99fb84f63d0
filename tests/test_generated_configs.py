"""Every experiment folder's generator reproduces the files committed beside it: a config edited by hand, or a
generator changed without re-running it (so that an algorithm that landed since has no config), fails here.

Each generator runs in a fresh process (this one's registry holds the tests' own algorithms) on a copy of its
folder without the results, kept studies and audit chunks it does not write; every file of the copy must then
equal the committed one, and
none may be new."""

from __future__ import annotations

import filecmp
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
GENERATORS = sorted(path.parent.name for path in (REPO / "experiments").glob("*/generate.py"))
#: Folders a generator reads or keeps but does not write.
NOT_GENERATED = ("results", "studies", "full", "__pycache__")


def _files(root: Path) -> set[Path]:
    return {path.relative_to(root) for path in root.rglob("*")
            if path.is_file() and not set(path.relative_to(root).parts) & set(NOT_GENERATED)}


@pytest.mark.parametrize("folder", GENERATORS)
def test_each_generator_reproduces_its_committed_files(folder: str, tmp_path: Path) -> None:
    source = REPO / "experiments" / folder
    copy = tmp_path / "experiments" / folder
    shutil.copytree(source, copy, ignore=shutil.ignore_patterns(*NOT_GENERATED))
    shutil.copy(REPO / "experiments" / "run_jobs.py", tmp_path / "experiments")
    done = subprocess.run([sys.executable, str(copy / "generate.py")], cwd=tmp_path, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr
    before, after = _files(source), _files(copy)
    assert after == before, f"added {sorted(after - before)}, removed {sorted(before - after)}"
    changed = [str(name) for name in sorted(after) if not filecmp.cmp(source / name, copy / name, shallow=False)]
    assert not changed, f"python experiments/{folder}/generate.py rewrites {changed}: run it and commit the result"
