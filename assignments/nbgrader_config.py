"""nbgrader's configuration for the course's assignments: this folder is the nbgrader course directory.

    source/<assignment>/   the instructor's notebooks, solutions and autograder tests (committed)
    release/<assignment>/  the student version, made by `make assignments` (not committed)
    submitted/, autograded/, feedback/, gradebook.db   made while grading (not committed)

See docs/instructor-guide.md for releasing, collecting and grading.
"""

c = get_config()  # noqa: F821  (nbgrader provides it when it reads this file)

c.CourseDirectory.course_id = "cnn-from-scratch"
# Every test cell launches kernels; in Numba's CUDA simulator (no GPU) a cell can take several seconds.
c.Execute.timeout = 300
c.ClearSolutions.code_stub = {"python": "# YOUR CODE HERE\nraise NotImplementedError()"}
