"""Where datasets are looked for when no directory is given: ``$CNN_DATA_DIR``, then the repository's ``data/``.

The repository's ``data/`` is the folder ``data/`` at the top of the checkout, beside ``cnn/``,
``notebooks/`` and ``pyproject.toml`` (git-ignored: ``python -m cnn data --download`` and ``make demo``
fetch MNIST into ``data/mnist/`` there). This file is ``cnn/data/locations.py``, so the checkout is
three levels up from it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from cnn.data.dataset import DataError, PathLike


def _repository_root() -> Path:
    """The checkout holding this package (``<root>/cnn/data/locations.py``); the current directory when
    the package was installed without its checkout (a wheel in site-packages has no pyproject.toml beside it)."""
    root = Path(__file__).resolve().parents[2]
    return root if (root / "pyproject.toml").is_file() else Path.cwd()


#: The repository root. MNIST is looked for in, and downloaded into, its ``data/mnist/``. Tests point this elsewhere.
REPO_ROOT = _repository_root()


def repository_data_dir() -> Path:
    """``<repository>/data``: where datasets are fetched to when no directory is given."""
    return REPO_ROOT / "data"


def default_data_dirs() -> list[tuple[Path, str]]:
    """Where datasets are looked for when no directory is given, in order."""
    places = []
    if env_dir := os.environ.get("CNN_DATA_DIR"):
        places.append((Path(env_dir), "$CNN_DATA_DIR"))
    places.append((repository_data_dir(), "the repository's data/"))
    return places


def find_dataset_dir(data_dir: PathLike | None, subdir: str,
                     holds: Callable[[Path], bool]) -> tuple[Path, str] | None:
    """The first place holding a dataset, and how it was found; None if none does.

    Each place is `data_dir` if given, else the defaults; a place holds the
    dataset itself or in a subfolder named `subdir` (like `mnist/`).
    """
    places = [(Path(data_dir), "--data-dir")] if data_dir is not None else default_data_dirs()
    for base, how in places:
        for directory in (base, base / subdir):
            if holds(directory):
                return directory, how
    return None


def check_given_dir(data_dir: PathLike) -> None:
    """Raise DataError unless ``data_dir`` (given by the user) is an existing directory."""
    if Path(data_dir).is_dir():
        return
    if Path(data_dir).exists():
        raise DataError(f"{data_dir}: is a file, not a directory; --data-dir names the directory "
                        "holding the dataset's files")
    raise DataError(f"{data_dir}: no such directory")


def places_looked() -> str:
    return ", ".join(f"{base} ({how})" for base, how in default_data_dirs())
