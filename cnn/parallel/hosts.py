"""Every host of a job has what a rank needs: the same interpreter, the same ``cnn`` package, the same
dataset — checked before training, each missing piece one line naming the host.

On one machine every rank shares the launcher's interpreter, checkout, data and environment. Across
machines none of that is given: ``mpiexec`` starts the remote ranks through ssh (or the cluster's
launcher) with the absolute path of the interpreter it was given, in a fresh login environment —
without ``CNN_DATA_DIR`` or the thread counts unless they are forwarded (``-x NAME`` in Open MPI;
``cnn.parallel.launch`` adds them: ``forwarded``). A remote rank that finds no MNIST would fetch
its own copy (a compute node without internet fails there; one with it trains on a copy nobody
checked), and one that runs another checkout trains another program. So:

- every rank reports its host, interpreter, Python version, the digest of its ``cnn`` package and
  of the dataset it finds — without downloading (``host_report``);
- rank 0 compares every host with its own and names each difference in one line (``problems``);
  the run stops with exit 2 before anything is trained (``check_job``: inside the job, so plain
  ``mpiexec`` and ``srun`` get it too);
- ``python -m cnn.parallel.launch --hostfile FILE`` first starts one tiny process per host through
  ``/bin/sh``, so that a host without the interpreter is one line too (``preflight_command``),
  where mpiexec would print a screenful.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import socket
import sys
from pathlib import Path

FORWARDED_PREFIXES = ("CNN_", "NUMBA_")
FORWARDED_NAMES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "PYTHONPATH")
PACKAGE = Path(__file__).resolve().parent.parent          # the cnn package this process runs
SAMPLE_BYTES = 1 << 20                                    # a dataset file's digest reads its first and last MiB


def forwarded(env: dict) -> list[str]:
    """The variables a remote rank needs from the launcher's environment: the project's (``CNN_*``,
    ``NUMBA_*``), the thread counts and ``PYTHONPATH`` — those set in ``env``."""
    return sorted(name for name in env if name.startswith(FORWARDED_PREFIXES) or name in FORWARDED_NAMES)


def package_digest(package: Path = PACKAGE) -> str:
    """SHA-256 of every ``.py`` file of the package, with its path: equal digests, the same code."""
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        digest.update(str(path.relative_to(package)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def files_digest(directory: Path) -> str:
    """SHA-256 of the names, sizes and first and last MiB of the files in ``directory`` (a dataset)."""
    digest = hashlib.sha256()
    for path in sorted(p for p in directory.iterdir() if p.is_file()):
        size = path.stat().st_size
        digest.update(f"{path.name}\0{size}\0".encode())
        with open(path, "rb") as handle:
            digest.update(handle.read(SAMPLE_BYTES))
            if size > 2 * SAMPLE_BYTES:
                handle.seek(size - SAMPLE_BYTES)
                digest.update(handle.read())
    return digest.hexdigest()[:16]


def locate_dataset(data_dir: str | None, model: str) -> Path:
    """The directory holding the model's dataset on this host, never downloading; DataError if none."""
    from cnn.data.cifar10 import _find_cifar10
    from cnn.data.mnist import find_mnist
    from cnn.train import DATASET_OF_MODEL

    if DATASET_OF_MODEL[model] == "mnist":
        return Path(find_mnist(data_dir, download=False))
    return Path(_find_cifar10(data_dir))


def host_report(data_dir: str | None, model: str) -> dict:
    """What this process runs with: host, interpreter, package, dataset, the forwarded variables."""
    from cnn.data import DataError

    report = {"host": socket.gethostname(), "python": sys.executable, "python_version": platform.python_version(),
              "package": str(PACKAGE), "package_digest": package_digest(),
              "env": {name: os.environ[name] for name in forwarded(os.environ)}}
    try:
        directory = locate_dataset(data_dir, model)
        report["data"] = {"directory": str(directory), "digest": files_digest(directory)}
    except (DataError, OSError) as err:
        report["data"] = {"problem": str(err)}
    return report


def problems(reports: dict, reference: dict | None = None) -> list[str]:
    """One line per host that differs from ``reference`` (default: the first report, rank 0's), naming
    the host and its ranks. ``reports``: {rank or name: host_report}."""
    keys = sorted(reports)
    reference = reference or reports[keys[0]]
    by_host: dict[str, list] = {}
    for key in keys:
        by_host.setdefault(reports[key]["host"], []).append(key)
    lines = []
    for host, ranks in by_host.items():
        where = f"host {host}"
        if isinstance(ranks[0], int):
            where += f" (rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))})"
        lines += [f"{where}: {difference}" for difference in differences(reports[ranks[0]], reference)]
    return lines


def differences(report: dict, reference: dict) -> list[str]:
    """What ``report`` lacks or has otherwise than ``reference``, one phrase each."""
    found = []
    if report.get("missing"):
        return [report["missing"]]
    if report["python_version"] != reference["python_version"]:
        found.append(f"Python {report['python_version']} at {report['python']}, rank 0 runs "
                     f"{reference['python_version']}: install the same environment on every host")
    if report["package_digest"] != reference["package_digest"]:
        found.append(f"another cnn package ({report['package']}, digest {report['package_digest']}) than rank 0's "
                     f"({reference['package']}, {reference['package_digest']}): every host needs the same checkout "
                     f"(a shared filesystem, or the same commit at the same path)")
    data, expected = report["data"], reference["data"]
    hint = missing_variable_hint(report, reference)
    if "digest" not in expected:           # nothing to compare with (the launcher's host has none yet)
        return found
    if "problem" in data:
        found.append(f"no dataset: {data['problem']}{hint}")
    elif data["digest"] != expected["digest"]:
        found.append(f"the dataset in {data['directory']} differs from rank 0's in {expected['directory']}{hint}")
    return found


def missing_variable_hint(report: dict, reference: dict) -> str:
    """Why a remote host may look elsewhere for the data: a variable rank 0 has and it lacks."""
    lacking = [name for name in ("CNN_DATA_DIR",) if name in reference["env"] and name not in report["env"]]
    if not lacking:
        return ""
    return (f" ({', '.join(lacking)} is set for rank 0, not there: forward it — python -m cnn.parallel.launch "
            f"does, with plain mpiexec add -x {' -x '.join(lacking)})")


class HostMismatch(ValueError):
    """Some host lacks what rank 0 has: ``lines``, one per problem, each naming the host."""

    def __init__(self, lines: list[str]):
        super().__init__("\n".join(lines))
        self.lines = lines


def check_job(world, config) -> None:
    """Inside the job, before training: rank 0 makes sure its dataset is on disk (fetching it if it
    is nowhere, as one process would), every rank reports, rank 0 compares; a HostMismatch on every
    rank if any host differs."""
    if world.rank == 0:
        ensure_dataset(config)
    everyone = world.gather_objects(host_report(config.data_dir, config.model), patience=10.0)
    lines = problems(everyone) if world.rank == 0 else None
    lines = world.broadcast_object(lines, "the host check", patience=10.0)
    if lines:
        raise HostMismatch(lines)


def ensure_dataset(config) -> None:
    """Rank 0 fetches MNIST where it is nowhere (a laptop's first run); the other ranks never do."""
    from cnn.data import find_mnist
    from cnn.train import DATASET_OF_MODEL

    if DATASET_OF_MODEL[config.model] == "mnist":
        find_mnist(config.data_dir, download=True)


# -- before the job: one process per host, through /bin/sh -------------------------------------

REPORT_SCRIPT = ("import json, sys; from cnn.parallel.hosts import host_report; "
                 "print('CNN-HOST ' + json.dumps(host_report(sys.argv[1] or None, sys.argv[2])), flush=True)")


def preflight_shell(python: str, data_dir: str | None, model: str) -> str:
    """The ``/bin/sh -c`` script one process per host runs: a ``CNN-HOST`` line with its report, or a
    ``CNN-MISSING`` line when the interpreter is not there or cannot import cnn."""
    import shlex

    report = shlex.join([python, "-c", REPORT_SCRIPT, data_dir or "", model])
    return (f'if [ ! -x {shlex.quote(python)} ]; then echo "CNN-MISSING $(hostname) interpreter"; '
            f'elif ! {report} 2>/dev/null; then echo "CNN-MISSING $(hostname) package"; fi')


def parse_preflight(output: str, python: str) -> dict[str, dict]:
    """{host: report} from the preflight's output (a host that lacks something: {"missing": why})."""
    why = {"interpreter": f"no interpreter {python}: the launcher's Python must exist at the same path on every "
                          f"host (a shared filesystem, or the same virtual environment at the same path)",
           "package": f"{python} cannot import cnn there: install the project in that environment "
                      f"(pip install -e . in the same checkout)"}
    reports = {}
    for line in output.splitlines():
        if line.startswith("CNN-HOST "):
            report = json.loads(line[len("CNN-HOST "):])
            reports[report["host"]] = report
        elif line.startswith("CNN-MISSING "):
            _, host, what = line.split()
            reports[host] = {"host": host, "missing": why[what]}
    return reports
