"""What a training run is configured with, and the values each setting may take.

``TrainConfig`` is built from the command line (``cnn/cli.py``, ``python -m cnn.parallel``), from a
checkpoint's saved configuration (``cnn.checkpoint``: a file a classmate sent) or by hand in a
notebook; ``check()`` holds every one of them to the same rules — the numeric ones are the rules the
command-line flags parse with (``cnn.argtypes``), so ``--gamma nan`` on the command line and
``"gamma": NaN`` in a checkpoint are refused alike, each in one line naming the setting.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from cnn import argtypes
from cnn.model import INIT_SCHEMES, NETWORKS

SCHEDULES = ("constant", "step", "warmup")
DTYPES = ("float32", "float64")

#: the rule each numeric setting obeys (``None`` is allowed too for those in OPTIONAL)
NUMBER_RULES = {"epochs": argtypes.positive_int, "batch_size": argtypes.positive_int, "lr": argtypes.positive_float,
                "momentum": argtypes.momentum, "weight_decay": argtypes.non_negative_float,
                "step_epochs": argtypes.positive_int, "gamma": argtypes.decay_factor,
                "lr_scale": argtypes.positive_float, "warmup_epochs": argtypes.non_negative_float,
                "seed": argtypes.seed, "limit_train": argtypes.positive_int, "limit_test": argtypes.positive_int,
                "eval_every": argtypes.count, "eval_subset": argtypes.positive_int,
                "checkpoint_every": argtypes.count}
OPTIONAL = ("limit_train", "limit_test", "data_dir", "checkpoint")
SWITCHES = ("resume", "progress")


def choices() -> dict[str, tuple[str, ...]]:
    """The settings that name one of a list: {setting: the names it may take}."""
    from cnn.stages import stage_names

    return {"model": tuple(NETWORKS), "stage": tuple(stage_names()), "schedule": SCHEDULES,
            "init": tuple(INIT_SCHEMES), "dtype": DTYPES}


@dataclass
class TrainConfig:
    model: str = "lenet5"
    stage: str = "numpy"
    epochs: int = 10
    batch_size: int = 64
    lr: float = 0.02
    momentum: float = 0.9
    weight_decay: float = 5e-4
    schedule: str = "step"
    step_epochs: int = 6          # "step": decay every this many epochs
    gamma: float = 0.1            # "step": decay factor
    lr_scale: float = 1.0         # "warmup": target rate = lr_scale · lr
    warmup_epochs: float = 1.0    # "warmup": length of the linear ramp
    init: str = "he"
    seed: int = 0
    dtype: str = "float32"
    data_dir: str | None = None
    limit_train: int | None = None   # use only the first N training images (quick runs, tests)
    limit_test: int | None = None
    eval_every: int = 0           # also evaluate on `eval_subset` test images every N steps (learning curves)
    eval_subset: int = 1000
    checkpoint: str | None = None
    checkpoint_every: int = 0     # steps between checkpoints; 0 = at the end of each epoch only
    resume: bool = False
    progress: bool = True

    def check(self) -> "TrainConfig":
        """Raise ValueError with one line naming the first impossible setting (its flag's name)."""
        named = choices()
        for field in fields(self):
            name, value = field.name.replace("_", "-"), getattr(self, field.name)
            if value is None and field.name in OPTIONAL:
                continue
            if field.name in NUMBER_RULES:
                NUMBER_RULES[field.name].check(value, name)
            elif field.name in named and (not isinstance(value, str) or value not in named[field.name]):
                raise ValueError(f"unknown {name} {value!r}; choose one of {', '.join(named[field.name])}")
            elif field.name in SWITCHES and not isinstance(value, bool):
                raise ValueError(f"{name} must be true or false, got {value!r}")
            elif field.name in OPTIONAL and not isinstance(value, str):
                raise ValueError(f"{name} must be a path (text), got {value!r}")
        if self.resume and not self.checkpoint:
            raise ValueError("resume needs a checkpoint path (--checkpoint)")
        return self
