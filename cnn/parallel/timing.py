"""Where each step's time goes, per rank: a breakdown like seed 000's log, and a Chrome-trace timeline.

Seed 000 timed the five phases of a parameter-server step::

    Gradient Fetch Time = 0.013477        the server receives every worker's gradient
    Gradient Avg time = 0.003210          ... averages them
    Weight Update time = 0.000320         ... takes the SGD step
    Weight distribution time = 0.010717   ... and sends the new weights back
    (compute: forward and backward on the worker)

Every strategy wraps its phases in ``timer.phase(NAME)``; phases a strategy does not have stay at
zero, and strategies with other phases (waiting for a turn, sending activations) add their own
names. With ``--timeline FILE`` every phase is also an event in a Chrome trace (open it at
chrome://tracing or https://ui.perfetto.dev): one row per rank, as in Horovod's timeline.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

COMPUTE = "compute"
FETCH = "gradient fetch"
AVERAGE = "gradient averaging"
UPDATE = "weight update"
DISTRIBUTE = "weight distribution"
SEED_PHASES = (FETCH, AVERAGE, UPDATE, DISTRIBUTE, COMPUTE)


class PhaseTimer:
    """Seconds per phase for each step of one rank, and the timeline events if asked for."""

    def __init__(self, rank: int, timeline: bool = False, origin: float | None = None):
        self.rank = rank
        self.record_events = timeline
        self.origin = time.time() if origin is None else origin   # shared t = 0 of the timeline
        self.steps: list[dict[str, float]] = []
        self.current: dict[str, float] = defaultdict(float)
        self.events: list[dict] = []
        self.step_started = time.perf_counter()

    @contextmanager
    def phase(self, name: str, label: str | None = None):
        """Time the block as phase ``name`` (``label``, if given, names the timeline event)."""
        started_wall, started = time.time(), time.perf_counter()
        try:
            yield
        finally:
            seconds = time.perf_counter() - started
            self.current[name] += seconds
            if self.record_events:
                self.events.append({"name": label or name, "cat": name, "ph": "X", "pid": self.rank, "tid": 0,
                                    "ts": round((started_wall - self.origin) * 1e6, 1),
                                    "dur": round(seconds * 1e6, 1), "args": {"step": len(self.steps)}})

    def end_step(self) -> dict[str, float]:
        """Close the current step; returns its phases plus ``step`` (wall time of the whole step)."""
        now = time.perf_counter()
        record = dict(self.current, step=now - self.step_started)
        self.steps.append(record)
        self.current, self.step_started = defaultdict(float), now
        return record

    def mean(self, skip_first: int = 1) -> dict[str, float]:
        """Mean seconds per step of every phase (the first step, with its warm-up, left out)."""
        steps = self.steps[skip_first:] or self.steps
        names = {name for record in steps for name in record}
        return {name: sum(record.get(name, 0.0) for record in steps) / max(1, len(steps)) for name in sorted(names)}


def format_step(step: int, total: int, record: dict[str, float], lr: float | None, loss: float | None,
                workers: int | None = None) -> str:
    """One log line per logged step, with seed 000's phases in seed 000's order."""
    parts = [f"step {step + 1}/{total}"]
    if lr is not None:
        parts.append(f"lr {lr:.4f}")
    if loss is not None:
        parts.append(f"loss {loss:.4f}")
    if workers is not None:
        parts.append(f"#worker gradients {workers}")
    phases = [name for name in SEED_PHASES if record.get(name)] + sorted(
        name for name in record if name not in SEED_PHASES and name != "step")
    timing = "  ".join(f"{name} {record[name] * 1e3:.2f} ms" for name in phases)
    return f"{'  '.join(parts)} | {timing} | step {record['step'] * 1e3:.2f} ms"


def format_breakdown(mean: dict[str, float], title: str) -> str:
    """The mean step as a small table: phase, ms per step, share of the step."""
    step = mean.get("step", 0.0) or 1e-12
    names = [name for name in SEED_PHASES if name in mean] + sorted(
        name for name in mean if name not in SEED_PHASES and name != "step")
    lines = [title, f"  {'phase':<22}{'ms/step':>10}{'share':>8}"]
    for name in names:
        lines.append(f"  {name:<22}{mean[name] * 1e3:>10.3f}{mean[name] / step:>8.1%}")
    accounted = sum(mean[name] for name in names)
    lines.append(f"  {'(other)':<22}{(step - accounted) * 1e3:>10.3f}{(step - accounted) / step:>8.1%}")
    lines.append(f"  {'step':<22}{step * 1e3:>10.3f}")
    return "\n".join(lines)


def write_timeline(path: str | Path, events_by_rank: dict[int, list[dict]], roles: dict[int, str]) -> None:
    """A Chrome-trace JSON file: one process row per rank, named by its role."""
    events = []
    for rank in sorted(events_by_rank):
        events.append({"name": "process_name", "ph": "M", "pid": rank, "tid": 0,
                       "args": {"name": f"rank {rank} ({roles.get(rank, 'worker')})"}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0, "args": {"sort_index": rank}})
        events.extend(events_by_rank[rank])
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
