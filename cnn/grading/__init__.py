"""What the course's autograded assignments (``assignments/source/``) use to grade a student's code.

Three modules, one idea each:

- ``checks``: compare with the library's reference and print the relative error the way cs231n
  does (``check``), and refuse a function that calls the library instead of doing the work
  (``written_by_you``).
- ``traffic``: count the memory traffic of a kernel — every element it reads or writes, per
  array — by running its Python source on arrays that count their accesses. This grades a
  kernel's *speed* on a laptop without a GPU: a tiled kernel reads global memory T times less
  often than an untiled one, and the count says so exactly, where a clock would say nothing.
- ``ranks``: P MPI ranks simulated as threads in one process, with mpi4py's names for the
  point-to-point calls, counting the numbers every link carries — so a collective such as a ring
  allreduce is graded without ``mpiexec``, on its result and on its traffic.

docs/instructor-guide.md ("Grading speed without a GPU") says how the counts grade performance and
what they cannot catch.
"""
