"""Files that appear whole or not at all: every file the project writes goes through ``replaced_on_success``.

``replaced_on_success(path)`` yields a temporary file beside ``path`` and, when the block succeeds::

    fsync the temporary      its bytes are on the disk, not only in the page cache
    os.replace onto path     atomic within one directory: a reader opens the old file or the new
                             one, never half of one
    fsync the directory      the rename itself survives a power cut

``path`` is first resolved to its real path: writing through a symlink replaces the file it points
to and leaves the link a link.

The temporary has a name of its own (``tempfile.mkstemp``: ``.NAME.<random>.tmp``), so two writers of
one file never write into the same temporary. On any failure — an exception, a full disk, Ctrl-C —
the temporary is removed and ``path`` keeps its old content. Only kill -9 or a power cut can leave a
temporary behind; ``stale_temporaries(path)`` finds them for the next writer to remove. The file
gets the mode any new file gets (0644 under the usual umask 022), not mkstemp's private 0600.
"""

from __future__ import annotations

import contextlib
import glob
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def replaced_on_success(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside ``path`` to write; rename it onto ``path`` if the block succeeds."""
    path = real_path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(handle)
    temporary = Path(name)
    try:
        yield temporary
        os.chmod(temporary, new_file_mode())
        _fsync(temporary)
        os.replace(temporary, path)
        _fsync_directory(path.parent)
    finally:
        temporary.unlink(missing_ok=True)       # already gone after a successful rename


def real_path(path: str | os.PathLike) -> Path:
    """``path`` with every symlink on the way resolved (a path that does not exist yet is kept as it is)."""
    return Path(os.path.realpath(path))


def stale_temporaries(path: str | os.PathLike) -> list[Path]:
    """Temporaries of ``path`` left by writers that were killed (call only while no writer is live)."""
    path = Path(path)
    return sorted(path.parent.glob(f".{glob.escape(path.name)}.*.tmp"))


def new_file_mode() -> int:
    """The mode ``open()`` gives a new file: 0o666 less the process's umask (0644 under umask 022)."""
    umask = os.umask(0)         # reading the umask means setting it: put it straight back
    os.umask(umask)
    return 0o666 & ~umask


def _fsync(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _fsync_directory(directory: Path) -> None:
    # Some file systems cannot fsync a directory; the rename has happened all the same.
    with contextlib.suppress(OSError):
        _fsync(directory)
