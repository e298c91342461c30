"""nbgrader's configuration for the course's assignments: this folder is the nbgrader course directory.

    source/<assignment>/   the instructor's notebooks, solutions and autograder tests (committed)
    release/<assignment>/  the student version, made by `make assignments` (not committed)
    submitted/, autograded/, feedback/, gradebook.db, grades.csv   made while grading (not committed)

Autograding runs the student's notebook, whose code could change anything in its kernel, so the tests'
verdicts come from outside it: ``StartReferee`` starts the referee (cnn.grading.referee) in a process of
its own before the kernel, and ``CheckSeals`` gives no points to a test cell that does not show the
referee's seal for it. Keep them around ``Execute`` if you change these lists; with another course
configuration, copy the ``autograde_preprocessors`` line. See docs/instructor-guide.md.
"""

from nbconvert.preprocessors import ClearMetadataPreprocessor
from nbgrader.preprocessors import (AssignLatePenalties, CheckCellMetadata, Execute, IgnorePattern, LimitOutput,
                                    SaveAutoGrades)

from cnn.grading.nbgrader_plugin import CheckSeals, StartReferee

c = get_config()  # noqa: F821  (nbgrader provides it when it reads this file)

c.CourseDirectory.course_id = "cnn-from-scratch"
# Every test cell launches kernels; in Numba's CUDA simulator (no GPU) a cell can take several seconds.
c.Execute.timeout = 300
c.ClearSolutions.code_stub = {"python": "# YOUR CODE HERE\nraise NotImplementedError()"}
# nbgrader's own list, with the referee started before the kernel runs and the seals checked after it.
c.Autograde.autograde_preprocessors = [StartReferee, Execute, CheckSeals, IgnorePattern, ClearMetadataPreprocessor,
                                       LimitOutput, SaveAutoGrades, AssignLatePenalties, CheckCellMetadata]
