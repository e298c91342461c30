"""Run the tutorial notebooks top to bottom — a full run, not the fast mode — and store their outputs in them.

    python notebooks/execute.py            # every tutorial notebook, 00 to 14 (make notebooks)
    python notebooks/execute.py 04 08      # only the notebooks whose names start so

Each notebook's links and set-up cells are brought up to date first (``navigation.py``), so the stored
run is of the notebook as it is committed. The committed tutorial notebooks carry the outputs of such a run, so that a reader on GitHub sees the
tables, the plots and what was measured. Each notebook runs in a fresh "python3" kernel of this
interpreter, from this folder, with ``CNN_FAST`` unset (a set ``CNN_FAST`` is refused: the stored
outputs must come from a full run). On a machine without a GPU the CUDA notebooks switch Numba's
simulator on themselves and say so in their output; the distributed ones start ``mpiexec`` (as root,
Open MPI wants ``OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1``).

Streamed text is stored as a screen shows it (a progress bar's last state, not its every redraw).
What is stored besides the outputs: ``metadata["course"]`` = {"fast_mode": false, "seconds": how long
the notebook ran, "python": version, "gpu": whether an NVIDIA GPU ran the CUDA cells}; no per-cell timing. A notebook whose run
fails is written with the error in place, and the script names it and exits 1. The assignment
notebooks are not touched: they stay blank (``strip_outputs.py``).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

import nbformat

FOLDER = Path(__file__).resolve().parent
CELL_TIMEOUT = 3600
LARGEST_NOTEBOOK = 3 * 2**20          # bytes: keep what GitHub has to render reasonable


def tutorial_notebooks(prefixes=()) -> list[Path]:
    paths = sorted(FOLDER.glob("[0-9][0-9]_*.ipynb"))
    return [path for path in paths if not prefixes or path.name.startswith(tuple(prefixes))]


def execute(path: Path) -> tuple[nbformat.NotebookNode, float, str | None]:
    """Run ``path`` in a fresh kernel; (the notebook with its outputs, seconds, the error or None)."""
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    notebook = nbformat.read(path, as_version=4)
    client = NotebookClient(notebook, kernel_name="python3", timeout=CELL_TIMEOUT, record_timing=False,
                            resources={"metadata": {"path": str(path.parent)}})
    started = time.perf_counter()
    try:                                     # JPY_SESSION_NAME: the results files a cell writes name the notebook,
        client.execute(env={**os.environ, "JPY_SESSION_NAME": str(path)})       # as under Jupyter's server
        error = None
    except CellExecutionError as err:
        error = str(err).strip().splitlines()[-1]
    return notebook, time.perf_counter() - started, error


def tidy_outputs(notebook) -> None:
    """Store streamed text as a screen shows it. A progress bar redraws its line hundreds of times, each
    redraw a message of its own that begins as the unfinished line began ("epoch 1: …"): of those only
    the last is kept, and the consecutive pieces of one stream are joined into one output."""
    for cell in notebook.cells:
        merged = []
        for output in cell.get("outputs", []):
            previous = merged[-1] if merged else None
            if not (output.output_type == "stream" and previous is not None and previous.output_type == "stream"
                    and previous.name == output.name):
                merged.append(output)
                continue
            unfinished = previous.text[previous.text.rfind("\n") + 1:]
            if unfinished and output.text.startswith(unfinished[:8]):       # a redraw of the unfinished line
                previous.text = previous.text[:len(previous.text) - len(unfinished)]
            previous.text += output.text
        if "outputs" in cell:
            cell.outputs = merged


def gpu_present() -> bool:
    sys.path.insert(0, str(FOLDER.parent))
    from cnn.machine import nvidia_gpu_present

    return nvidia_gpu_present()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("prefixes", nargs="*", help="run only the notebooks whose names start with these (04, 08_)")
    args = parser.parse_args(argv)
    if os.environ.get("CNN_FAST", "0") not in ("", "0"):
        print("execute.py: CNN_FAST is set; the stored outputs must be a full run (unset it)", file=sys.stderr)
        return 2
    paths = tutorial_notebooks(args.prefixes)
    if not paths:
        print(f"execute.py: no tutorial notebook starts with {' or '.join(args.prefixes)}", file=sys.stderr)
        return 2
    from navigation import apply as write_navigation

    write_navigation(paths)
    failed, total = [], time.perf_counter()
    for path in paths:
        print(f"{path.name} ...", end=" ", flush=True)
        notebook, seconds, error = execute(path)
        tidy_outputs(notebook)
        notebook.metadata["course"] = {"fast_mode": False, "seconds": round(seconds), "gpu": gpu_present(),
                                       "python": platform.python_version()}
        nbformat.write(notebook, path)
        size = path.stat().st_size
        print(f"{seconds:.0f} s, {size / 2**20:.1f} MiB" + (f"  FAILED: {error}" if error else ""))
        if error:
            failed.append(path.name)
        elif size > LARGEST_NOTEBOOK:
            failed.append(f"{path.name} (larger than {LARGEST_NOTEBOOK / 2**20:.0f} MiB)")
    print(f"{len(paths)} notebooks in {(time.perf_counter() - total) / 60:.1f} min")
    if failed:
        print(f"execute.py: failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
