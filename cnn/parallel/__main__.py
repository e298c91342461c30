"""``mpiexec -n 4 python -m mpi4py -m cnn.parallel --strategy NAME [options]``."""

import os
import sys

# The ranks are the parallelism: one BLAS thread per rank unless the user asks for more
# (four ranks with two BLAS threads each on a two-core machine run several times slower).
for _variable in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_variable, "1")

from cnn.parallel.cli import main  # noqa: E402  (after the thread settings, before numpy loads)

FINALIZE_PATIENCE_S = 60.0     # MPI_Finalize takes well under a second; past this it waits for a dead peer

_code = main()
if "mpi4py.MPI" in sys.modules:
    # Finalize here rather than at interpreter exit: a handled failure then ends with its own exit
    # code, not with the MPI_Abort that `python -m mpi4py` reserves for unhandled exceptions; and
    # under a watchdog, which a rank that never learnt of a lost peer may need.
    from cnn.parallel.world import finalize_within

    finalize_within(FINALIZE_PATIENCE_S, _code)
raise SystemExit(_code)
