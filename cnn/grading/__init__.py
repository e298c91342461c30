"""What the course's autograded assignments (``assignments/source/``) use to grade a student's code.

A student's code runs in the notebook's kernel; the tests' other half runs where it cannot reach:

- ``referee``: a separate process that draws each test's inputs, computes the expected results with the
  library's reference, judges what the kernel sends back and *seals* a passed test (``seal``: an HMAC
  under a key the kernel never sees); ``protocol``: how they talk (JSON and numpy arrays, never pickle);
- ``client``: the kernel's side, ``grade(family, *answers)``; ``runners``: how it runs an answer on a
  case; ``family``: what a test family is, and the judges; ``assignments``: every assignment's families;
- ``nbgrader_plugin``: the preprocessors that start the referee for nbgrader's autograder and give no
  points to a test cell without its seal;
- ``authorship``: what an answer uses of the course library, followed through its globals, closures and
  helpers (``bytecode``), and recorded while it runs;
- ``traffic``: count a kernel's memory traffic by running its Python source on arrays that count
  their accesses — speed graded on a laptop without a GPU; ``ranks``: P MPI ranks simulated as threads,
  counting every link's traffic; ``atomics``: which writes of a kernel are atomic; ``checks``: Numba's
  parallel loops, and its warnings silenced.

docs/instructor-guide.md says how the assignments are graded, what the grader defends against and what
it cannot.
"""
