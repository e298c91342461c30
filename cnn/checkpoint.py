"""What a training run writes, written so that no work is lost: its checkpoint and its history.

Five rules, each against one way work gets lost:

- **Check before working.** ``check_writable`` runs before training starts, for every file the run
  will write (``--checkpoint``, ``--out``): a read-only file system, a full disk, a folder that is
  really a file — each is one line and exit 2 *before* an epoch is spent, not a traceback after it.
- **Whole or not at all.** ``save_checkpoint`` writes through ``cnn.atomic.replaced_on_success``:
  a temporary file of its own beside the checkpoint, fsync, ``os.replace``. kill -9 at any moment
  leaves the previous checkpoint or the new one, never half of one; a failed write (disk full)
  leaves the previous one and no temporary.
- **One writer.** ``CheckpointLock`` lets one live run write a given checkpoint; a second is refused
  in one line. The lock is the ``filelock`` library's (``flock`` on ``REAL.lock``), which the kernel
  releases when its process ends however it ends, so the lock of a run that was killed never blocks
  the next one. REAL is the checkpoint's real path: a symlink to a checkpoint is the same checkpoint,
  locked by the same lock, and written through (the atomic writer replaces the file the link points
  to, never the link).
- **Trust nothing read.** ``load_checkpoint`` checks every field of the file before it is used
  (``cnn.checkpoint_schema``): a checkpoint may come from anywhere.
- **The history survives.** ``save_history`` writes the history where asked or, if that fails,
  to the temporary directory, and says where.

(Only sound parameters are written: that is the guard's check, ``cnn.guard``, since it needs the
loss at the parameters.)
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from dataclasses import asdict
from pathlib import Path

import numpy as np
from filelock import FileLock, Timeout

from cnn.atomic import real_path, replaced_on_success, stale_temporaries
from cnn.checkpoint_schema import read_checkpoint

#: Room kept for a checkpoint's history and configuration when estimating its size
HISTORY_ALLOWANCE = 1 << 20


def save_checkpoint(path: str | Path, params: np.ndarray, momentum: np.ndarray, config, epoch: int, batch: int,
                    rng_state: dict, history: dict) -> None:
    """Write a checkpoint atomically (see the module's docstring); an OSError leaves the old one intact.

    It holds the parameters and momentum, the position (training resumes at ``batch`` of ``epoch``,
    both 0-based), the state of the shuffling generator at the start of that epoch, the
    configuration (a dataclass) and the history.
    """
    with replaced_on_success(path) as temporary, open(temporary, "wb") as handle:
        np.savez(handle, params=params, momentum=momentum, epoch=epoch, batch=batch,
                 rng_state=json.dumps(rng_state), config=json.dumps(asdict(config)), history=json.dumps(history))


def load_checkpoint(path: str | Path) -> dict:
    """The checkpoint's contents, every field checked (``cnn.checkpoint_schema.read_checkpoint``); a
    missing, damaged or malformed file is one ValueError line naming the file and the field.

    ``parallel`` is None unless a distributed run (``cnn.parallel.checkpoint``) wrote the file: then
    its ``batch`` counts that run's global batches, and ``parallel["images_into_epoch"]`` is the
    position that carries over to another batch size; ``rows`` holds that run's per-worker arrays."""
    return read_checkpoint(path)


def checkpoint_bytes(num_params: int, dtype) -> int:
    """About how large a checkpoint is: parameters and momentum, plus room for history and configuration."""
    return 2 * num_params * np.dtype(dtype).itemsize + HISTORY_ALLOWANCE


# -- before training ---------------------------------------------------------------------------

def check_writable(path: str | Path, what: str, needed_bytes: int = 0) -> None:
    """Raise ValueError (one line) unless a file of ``needed_bytes`` can be written at ``path`` now.

    ``what`` names the path for the user (``--checkpoint``). Checked: ``path`` is not a directory;
    the nearest existing folder on its way is a folder; a file can be created, written and synced
    in its folder (created if missing: the run would create it anyway), which a read-only file
    system, missing permission or a full disk refuses; its file system has ``needed_bytes`` free.
    """
    shown, path = path, real_path(path)
    if path.is_dir():
        raise ValueError(f"{what} {shown}: is a directory; give a file name")
    existing = next(folder for folder in (path.parent, *path.parent.parents) if folder.exists())
    if not existing.is_dir():
        raise ValueError(f"{what} {shown}: {existing} is a file, not a directory")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        _write_probe(path)
    except OSError as err:
        raise ValueError(f"{what} {shown}: cannot write in {path.parent} ({err.strerror or err})") from None
    free = shutil.disk_usage(path.parent).free
    if free < needed_bytes:
        raise ValueError(f"{what} {shown}: {_size(free)} free on its file system, it needs about {_size(needed_bytes)}")


def _write_probe(path: Path) -> None:
    """Create, write and sync a small file beside ``path``, then remove it. (Not named like the
    temporaries of ``path``: the run holding its lock would take it for a killed writer's.)"""
    descriptor, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".probe")
    try:
        os.write(descriptor, bytes(4096))
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
        Path(name).unlink(missing_ok=True)


def _size(count: int) -> str:
    return f"{count / 2**20:.1f} MiB" if count >= 2**20 else f"{count / 2**10:.0f} KiB"


class CheckpointLock:
    """``with CheckpointLock(path) as lock:`` — this process is the one live run writing checkpoint ``path``.

    Taking it: ``filelock`` locks ``REAL.lock`` (REAL: the checkpoint's real path, symlinks
    resolved), waiting at most ``WAIT`` seconds; if another process holds it, ValueError naming that
    process (its pid is in the file). Once held, temporaries left by killed writers of the checkpoint
    are removed (no live writer can own them now). ``lock.holds()`` says whether REAL.lock is still
    the file this run locked — not once its folder was removed or replaced during the run.
    Releasing it removes the file while still holding it, then lets go (filelock's next taker sees a
    removed file and opens a new one); where the folder went read-only or away, nothing is removed
    and nothing is raised.
    """

    WAIT = 0.25         # seconds: covers a previous holder caught between removing its file and letting go

    def __init__(self, path: str | Path):
        self.checkpoint = Path(path)
        self.path = Path(f"{real_path(path)}.lock")
        self.identity = None            # (device, inode) of the file this run locked
        self.lock = FileLock(self.path, timeout=self.WAIT, on_acquired=self._acquired)

    def _acquired(self, descriptor: int) -> None:
        """filelock's hook, with the lock held: write this process's pid, remember which file it is."""
        os.ftruncate(descriptor, 0)
        os.pwrite(descriptor, f"{os.getpid()}\n".encode(), 0)
        status = os.fstat(descriptor)
        self.identity = (status.st_dev, status.st_ino)

    def __enter__(self) -> "CheckpointLock":
        try:
            self.lock.acquire()
        except Timeout:
            raise ValueError(f"{self.checkpoint}: another run (pid {self._holder()}) is writing this checkpoint; "
                             "wait for it to end, or give this run another --checkpoint") from None
        except OSError as err:
            raise ValueError(f"{self.checkpoint}: cannot lock {self.path} ({err.strerror or err})") from None
        for temporary in stale_temporaries(real_path(self.checkpoint)):
            temporary.unlink(missing_ok=True)
        return self

    def _holder(self) -> str:
        try:
            return self.path.read_text(errors="replace").strip()[:20] or "?"
        except OSError:
            return "?"

    def holds(self) -> bool:
        """Whether ``PATH.lock`` is still the file this run locked."""
        try:
            status = os.stat(self.path)
        except OSError:
            return False
        return (status.st_dev, status.st_ino) == self.identity

    def __exit__(self, *exc_info) -> None:
        if self.holds():
            with contextlib.suppress(OSError):          # a folder gone read-only keeps its lock file
                self.path.unlink()
        with contextlib.suppress(OSError):
            self.lock.release()
        self.identity = None


# -- the history -------------------------------------------------------------------------------

def save_history(history: dict, out: str | Path) -> tuple[Path | None, str]:
    """Write ``history`` as JSON to ``out`` atomically or, if that fails, to the temporary directory.

    Returns (where it went or None, one phrase for the user saying where it went, and why ``out``
    could not hold it if it could not).
    """
    out = Path(out)
    text = json.dumps(history, indent=1)
    fallback = Path(tempfile.gettempdir()) / f"{out.stem}-{os.getpid()}.json"
    problem = None
    for place in (out, fallback):
        try:
            with replaced_on_success(place) as temporary:
                temporary.write_text(text)
        except OSError as err:
            problem = problem or (err.strerror or str(err))
            continue
        return place, (f"history in {place}" if place == out
                       else f"could not write {out} ({problem}): the history is in {place}")
    return None, f"the history could not be saved ({problem})"
