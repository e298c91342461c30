"""The tests of the course's assignments, one module per assignment (``assignments/source/<name>``).

Each module's ``FAMILIES`` maps a test cell's ``grade_id`` to its ``Family`` (``cnn.grading.family``):
the cases the referee draws and judges, and how the kernel runs the student's answer on them. The
notebook's test cell is one line, ``grade("<grade_id>", <the answer>)``. Read a module to see every
case a test cell checks, the reference it is compared with and the tolerance.
"""
