"""``mpiexec -n 4 python -m mpi4py -m cnn.parallel --strategy NAME [options]``."""

import os
import sys

# The ranks are the parallelism: one BLAS thread per rank unless the user asks for more
# (four ranks with two BLAS threads each on a two-core machine run several times slower).
for _variable in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_variable, "1")

from cnn.parallel.cli import main  # noqa: E402  (after the thread settings, before numpy loads)

FINALIZE_PATIENCE_S = 60.0     # MPI_Finalize takes well under a second; past this it waits for a dead peer


def _leave_without_finalize(code: int) -> None:
    print(f"MPI_Finalize did not return in {FINALIZE_PATIENCE_S:.0f} s (a peer lost without this rank "
          "knowing it?): leaving without it", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(code)


_code = main()
if "mpi4py.MPI" in sys.modules:
    # Finalize here rather than at interpreter exit: a handled failure then ends with its own exit
    # code, not with the MPI_Abort that `python -m mpi4py` reserves for unhandled exceptions, and
    # the watchdog World.leave arms after a lost peer is still running (Python's shutdown stops it).
    # A rank that never learnt of a lost peer finalizes like any other, and MPI_Finalize can wait for
    # the dead one for ever (seen once in CI: sandblaster's workers after a killed worker): a timer
    # ends the process with its code instead.
    import threading

    from mpi4py import MPI

    if MPI.Is_initialized() and not MPI.Is_finalized():
        watchdog = threading.Timer(FINALIZE_PATIENCE_S, _leave_without_finalize, args=(_code,))
        watchdog.daemon = True
        watchdog.start()
        MPI.Finalize()
        watchdog.cancel()
raise SystemExit(_code)
