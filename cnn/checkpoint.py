"""What a training run writes, written so that no work is lost: its checkpoint and its history.

Four rules, each against one way work gets lost:

- **Check before working.** ``check_writable`` runs before training starts, for every file the run
  will write (``--checkpoint``, ``--out``): a read-only file system, a full disk, a folder that is
  really a file — each is one line and exit 2 *before* an epoch is spent, not a traceback after it.
- **Whole or not at all.** ``save_checkpoint`` writes through ``cnn.atomic.replaced_on_success``:
  a temporary file of its own beside the checkpoint, fsync, ``os.replace``. kill -9 at any moment
  leaves the previous checkpoint or the new one, never half of one; a failed write (disk full)
  leaves the previous one and no temporary.
- **One writer.** ``CheckpointLock`` lets one live run write a given checkpoint; a second is refused
  in one line. The lock is ``fcntl.flock`` on ``PATH.lock``, which the kernel releases when its
  process ends however it ends, so the lock of a run that was killed never blocks the next one.
- **The history survives.** ``save_history`` writes the history where asked or, if that fails,
  to the temporary directory, and says where.

(Only sound parameters are written: that is the trainer's check, ``cnn.train``, since it needs the
loss at the parameters.)
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import tempfile
import zipfile
from dataclasses import asdict
from pathlib import Path

import numpy as np

from cnn.atomic import replaced_on_success, stale_temporaries

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
    """The checkpoint's contents; a missing or damaged file is one ValueError line naming it.

    ``parallel`` is None unless a distributed run (``cnn.parallel.checkpoint``) wrote the file: then
    its ``batch`` counts that run's global batches, and ``parallel["images_into_epoch"]`` is the
    position that carries over to another batch size."""
    path = Path(path)
    try:
        with np.load(path, allow_pickle=False) as archive:
            return {"params": archive["params"], "momentum": archive["momentum"],
                    "epoch": int(archive["epoch"]), "batch": int(archive["batch"]),
                    "parallel": json.loads(str(archive["parallel"])) if "parallel" in archive.files else None,
                    "rng_state": json.loads(str(archive["rng_state"])),
                    "config": json.loads(str(archive["config"])),
                    "history": json.loads(str(archive["history"]))}
    except FileNotFoundError:
        raise ValueError(f"{path}: no such checkpoint") from None
    except (OSError, KeyError, ValueError, EOFError, zipfile.BadZipFile) as err:
        raise ValueError(f"{path}: not a valid checkpoint ({err})") from None


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
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{what} {path}: is a directory; give a file name")
    existing = next(folder for folder in (path.parent, *path.parent.parents) if folder.exists())
    if not existing.is_dir():
        raise ValueError(f"{what} {path}: {existing} is a file, not a directory")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        _write_probe(path)
    except OSError as err:
        raise ValueError(f"{what} {path}: cannot write in {path.parent} ({err.strerror or err})") from None
    free = shutil.disk_usage(path.parent).free
    if free < needed_bytes:
        raise ValueError(f"{what} {path}: {_size(free)} free on its file system, it needs about {_size(needed_bytes)}")


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
    """``with CheckpointLock(path):`` — this process is the one live run writing checkpoint ``path``.

    Taking it: open (or create) ``PATH.lock``, ``flock`` it without waiting; if another process
    holds it, ValueError naming that process (its pid is in the file). Once held, temporaries left
    by killed writers of ``path`` are removed (no live writer can own them now). Releasing it
    removes the file, then lets go; a run that took the lock on the file just removed sees that
    the path no longer leads to its file and takes the lock again on a new one.
    """

    def __init__(self, path: str | Path):
        self.checkpoint = Path(path)
        self.path = Path(f"{path}.lock")
        self.descriptor = None

    def __enter__(self) -> "CheckpointLock":
        while self.descriptor is None:
            descriptor = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(descriptor, 32, 0).decode(errors="replace").strip() or "?"
                os.close(descriptor)
                raise ValueError(f"{self.checkpoint}: another run (pid {holder}) is writing this checkpoint; "
                                 "wait for it to end, or give this run another --checkpoint") from None
            if self._still_named(descriptor):
                self.descriptor = descriptor
            else:
                os.close(descriptor)
        os.ftruncate(self.descriptor, 0)
        os.pwrite(self.descriptor, f"{os.getpid()}\n".encode(), 0)
        for temporary in stale_temporaries(self.checkpoint):
            temporary.unlink(missing_ok=True)
        return self

    def _still_named(self, descriptor: int) -> bool:
        try:
            return os.path.samestat(os.fstat(descriptor), os.stat(self.path))
        except FileNotFoundError:
            return False

    def __exit__(self, *exc_info) -> None:
        self.path.unlink(missing_ok=True)
        os.close(self.descriptor)
        self.descriptor = None


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
