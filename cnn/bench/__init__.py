"""``python -m cnn bench``: every stage timed on the same network and data, phase by phase, and more.

One module per job; the command line (``command.py``) hands each mode to its module::

    (default)              step_timing   every stage's training step, phase by phase; PyTorch reference rows
    --op conv-forward      ops           every stage's version of one operation, checked against stage loops, timed
    --memory               transfers     host↔device copy latency and bandwidth against size (host memcpy without a GPU)
    --profile STAGE        profiling     host profile (cProfile, or pyinstrument) and per-kernel device times on a GPU
    --compare A.json B..   compare       several results files side by side (e.g. a laptop CPU and a GPU)
    --curves H.json ..     compare       learning curves of several training histories in one picture
    --update-readme [J..]  readme        rewrite README.md's bench tables and GPU findings from the results files
    --update-docs          docs          rewrite the measured blocks of docs/profiling.md and the stage docstrings
    --demo                 demo          the ``make demo`` job: benchmark, train the fastest stage, draw the pictures
    --census [--reduced]   census        launches, copies, allocations per step of stages 6 and 7 (simulator too)
    --ablation             ablation      stage 7's fixes timed one at a time against stage 6 (GPU only)
    --timeline             timeline      how much of stage 6's gradient copies hides under compute (GPU only)

and what they share::

    results    the results files: their header, names, writing and reading
    measure    clocks (perf_counter, CUDA events), statistics, time budgets, memory high-water marks
    workload   the batches and hyperparameters every benchmark trains with
    tables     Markdown tables of the results (their number formats: ``cnn/formatting.py``, shared with
               the pictures of ``cnn/plots.py``)
    recorded   the committed results found by what they hold (the newest GPU run that timed stage X, …)
    nsight     Nsight Compute's CSV read into kernel time per training step, by role
    findings   what the GPU files say, as sentences whose figures (and wording) come from the files

Under Numba's CUDA simulator every timing mode refuses to run: simulated kernels are Python
threads, and their times mean nothing. Each results file's schema is in the docstring of the
module that writes it; all start with ``results.results_header``.

The names below are the benchmark's public API (notebooks and other commands use them).
"""

from cnn.bench.command import add_arguments, run
from cnn.bench.demo import class_probabilities, grid_indices, train_with_snapshots
from cnn.bench.measure import SIMULATOR_REFUSAL, HostClock, simulator_on, summarize
from cnn.bench.readme import table_title
from cnn.bench.results import (RESULTS_DIR, SCHEMA, command_line, load_results, machine_record, newest_results,
                               results_header, results_stem, write_json, write_results)
from cnn.bench.step_timing import benchmark, save_benchmark
from cnn.bench.tables import markdown_table
from cnn.bench.workload import benchmark_batches, course_hyperparameters
from cnn.formatting import PHASES

__all__ = ["add_arguments", "run", "class_probabilities", "grid_indices", "train_with_snapshots", "SIMULATOR_REFUSAL",
           "HostClock", "simulator_on", "summarize", "table_title", "RESULTS_DIR", "SCHEMA", "command_line",
           "load_results", "machine_record", "newest_results", "results_header", "results_stem", "write_json",
           "write_results", "benchmark", "save_benchmark", "markdown_table", "benchmark_batches",
           "course_hyperparameters", "PHASES"]
