"""How the benchmark's numbers and names are written, for its tables (``cnn.bench``) and its pictures (``cnn.plots``).

Both take these from here, so neither imports the other: the phases of a training step and
their labels, times in ms with as many digits as they deserve, speed factors, sizes in MiB,
the spread of a set of samples, the label of a results file, and ``markdown``: a Markdown table.

The numbers are written by hand (what a figure deserves is the course's call); the tables are laid
out by ``tabulate`` (the library the Python world uses to print tables): every column padded to its
widest cell, so a table reads as a table in the raw file and in a terminal too, with no width
arithmetic of our own to get wrong.
"""

from __future__ import annotations

from tabulate import tabulate

PHASES = ("load_batch", "forward", "backward", "update", "fetch_loss")
PHASE_LABELS = {"load_batch": "host→device", "forward": "forward", "backward": "backward",
                "update": "update", "fetch_loss": "device→host"}


def fmt_ms(ms: float | None) -> str:
    """Milliseconds with at least three significant digits ('1,234', '12.3', '1.23', '0.123'); '—' for None."""
    if ms is None:
        return "—"
    for limit, digits in ((100, 0), (10, 1), (1, 2)):
        if ms >= limit:
            return f"{ms:,.{digits}f}"
    return f"{ms:.3f}"


def fmt_factor(factor: float | None, times_first: bool = False) -> str:
    """'12.3×' (tables) or '×12.3' (``times_first``, the pictures' labels); '—' for None."""
    if factor is None:
        return "—"
    number = f"{factor:,.0f}" if factor >= 100 else (f"{factor:.1f}" if factor >= 10 else f"{factor:.2f}")
    return f"×{number}" if times_first else f"{number}×"


def fmt_mib(size: int | None) -> str:
    return "—" if size is None else f"{size / 2**20:,.0f}"


def spread(stats: dict) -> str:
    """Half the interquartile range, as a percentage of the median."""
    return f"±{50 * (stats['q3'] - stats['q1']) / stats['median']:.0f}%" if stats["median"] else ""


def compare_label(result: dict) -> str:
    """A results file named by its machine: the GPU, or the CPU without one, and the date."""
    gpu = result["machine"].get("gpu")
    return f"{gpu['name'] if gpu else result['machine']['cpu']} ({result['created'][:10]})"


def markdown(header: list[str], cells: list[list[str]]) -> str:
    """A Markdown table (GitHub's pipe tables), its columns padded to their widest cell; cells are shown as
    written (``disable_numparse``: "1,830" and "9.34 ±4%" stay text, and no column is re-aligned as numbers)."""
    return tabulate(cells, headers=header, tablefmt="github", disable_numparse=True)
