"""Nsight Compute's per-kernel CSV (``ncu --csv``), read into a table of kernel times per training step.

``benchmarks/gpu_session.sh`` runs ``ncu --csv --metrics gpu__time_duration.sum,
sm__throughput.avg.pct_of_peak_sustained_elapsed,launch__grid_size,launch__block_size`` over a
few training steps of ``cuda-tuned`` (``python -m cnn bench --profile``). The file has one row a
(launch, metric), after a few ``==PROF==`` / ``==WARNING==`` lines of ncu's own, which are skipped.

Steps: every training step ends with exactly one SGD launch (``sgd_momentum_kernel``), so the
profiled steps are counted as its launches. Each kernel's *role* — what part of the step it
computes — comes from its name (``KERNEL_ROLES``); the roles starting with "conv backward" add up
to the share the convolution's backward pass takes, those starting with "fused step" to stage 8's
(which computes every layer in one kernel, so its time is not split by layer).
"""

from __future__ import annotations

import csv
import re
from pathlib import Path

#: kernel (the Python name Numba gives it) -> the part of a training step it computes
KERNEL_ROLES = {
    "conv_relu_pool_forward_smem_kernel": "conv forward (direct, fused bias + ReLU + pool)",
    "conv_relu_pool_backward_smem_kernel": "conv backward (push: dX, dW, db by atomics)",
    "gemm_bias_relu_pool_store": "conv forward (tiled product + bias, ReLU, pool)",
    "relu_pool_backward_kernel": "conv backward (pool switches, ReLU mask)",
    "gemm_store_partial": "conv backward dW (split-K partial products)",
    "sum_splits_kernel": "conv backward dW (sum of the splits)",
    "gemm_pixel_store": "conv backward dX (tiled product, pulled)",
    "tiled_epilogue_kernel": "dense layers (tiled products, forward and backward)",
    "gemm_bias_relu_store": "dense forward (tiled product + bias, ReLU)",
    "gemm_weight_grad_store": "dense backward dW, db",
    "gemm_masked_store": "dense backward dX (ReLU mask)",
    "dense_softmax_xent_kernel": "last dense + softmax + loss",
    "zero_pair_kernel": "zeroing the gradient buffers",
    "sgd_momentum_kernel": "SGD update",
    "fused_net_step_kernel": "fused step: every layer forward, the loss, every layer backward",
    "sum_sgd_kernel": "fused step: the blocks' dW partials summed (back to back: and the SGD update)",
}
STEP_KERNEL = "sgd_momentum_kernel"
TIME, SM, GRID, BLOCK = ("gpu__time_duration.sum", "sm__throughput.avg.pct_of_peak_sustained_elapsed",
                         "launch__grid_size", "launch__block_size")


def kernel_name(full: str) -> str:
    """'conv_pool_smem::conv_relu_pool_forward_smem_kernel[v1,cw51…](Array<…>, …)' -> 'conv_relu_pool_forward_smem_kernel'."""
    return re.sub(r"[\[(].*", "", full).split("::")[-1]


def number(text: str) -> float:
    return float(text.replace(",", ""))


def read_launches(path) -> list[dict]:
    """One dict a kernel launch, in launch order: kernel, module, time_ns, sm_percent, grid, block."""
    path = Path(path)
    try:
        lines = [line for line in path.read_text().splitlines() if line.startswith('"')]
    except OSError as err:
        raise ValueError(f"{path}: cannot read it ({err})") from None
    rows = list(csv.DictReader(lines))
    if not rows or not {"ID", "Kernel Name", "Metric Name", "Metric Value"} <= set(rows[0]):
        raise ValueError(f"{path}: not an Nsight Compute CSV (ncu --csv): no ID/Kernel Name/Metric rows")
    launches = {}
    for row in rows:
        launch = launches.setdefault(row["ID"], {"kernel": kernel_name(row["Kernel Name"]),
                                                 "module": row["Kernel Name"].split("::")[0],
                                                 "grid": row["Grid Size"], "block": row["Block Size"]})
        launch[row["Metric Name"]] = number(row["Metric Value"])
    missing = [launch_id for launch_id, launch in launches.items() if TIME not in launch]
    if missing:
        raise ValueError(f"{path}: launch {missing[0]} has no {TIME} (ncu --metrics must include it)")
    return [{"kernel": launch["kernel"], "module": launch["module"], "time_ns": launch[TIME],
             "sm_percent": launch.get(SM), "grid": launch["grid"], "block": launch["block"]}
            for launch in launches.values()]


def kernel_summary(path) -> dict:
    """The profile of ``path`` per training step: {"steps", "total_us", "kernels": [row, ...], "shares": {...}}.

    row = {"kernel", "role", "launches" (a step), "us" (a step), "share" (of the kernel time),
           "sm_percent" (range over its launches), "grid", "block" (of its first launch)}, in launch order;
    shares = {"conv backward": share of every kernel whose role starts so, "conv forward": …, …}.
    """
    launches = read_launches(path)
    steps = sum(launch["kernel"] == STEP_KERNEL for launch in launches)
    if steps == 0:
        raise ValueError(f"{path}: no {STEP_KERNEL} launch, so no whole training step was profiled")
    total_ns = sum(launch["time_ns"] for launch in launches)
    kernels = {}
    for launch in launches:
        row = kernels.setdefault(launch["kernel"], {
            "kernel": launch["kernel"], "role": KERNEL_ROLES.get(launch["kernel"], "other"), "launches": 0,
            "ns": 0.0, "sm": [], "grid": launch["grid"], "block": launch["block"]})
        row["launches"] += 1
        row["ns"] += launch["time_ns"]
        if launch["sm_percent"] is not None:
            row["sm"].append(launch["sm_percent"])
    rows = [{"kernel": row["kernel"], "role": row["role"], "launches": row["launches"] / steps,
             "us": row["ns"] / steps / 1e3, "share": row["ns"] / total_ns,
             "sm_percent": (min(row["sm"]), max(row["sm"])) if row["sm"] else None,
             "grid": row["grid"], "block": row["block"]} for row in kernels.values()]
    return {"file": Path(path).name, "steps": steps, "total_us": total_ns / steps / 1e3, "kernels": rows,
            "shares": role_shares(rows)}


LAYER_GROUPS = ("conv backward", "conv forward", "dense", "fused step")


def role_shares(rows) -> dict:
    """Share of the kernel time of each kind of work: conv forward, conv backward, dense, the fused step, the rest."""
    groups = dict.fromkeys((*LAYER_GROUPS, "other"), 0.0)
    for row in rows:
        group = next((name for name in LAYER_GROUPS if row["role"].startswith(name)), "other")
        groups[group] += row["share"]
    return groups


def share_words(shares: dict, short: bool = False) -> str:
    """Where a step's kernel time goes, in words: 'the convolutions' backward pass 57 %, their forward pass
    16 %, the dense layers 23 %' (``short``: 'conv backward 57 %, conv forward 16 %, dense 23 %'); for a
    step fused into one kernel, that kernel's share, since it is not split by layer."""
    percent = {name: f"{100 * share:.0f} %" for name, share in shares.items()}
    if shares["fused step"] > 0:
        return f"{'fused' if short else 'the fused kernels'} {percent['fused step']}"
    if short:
        return (f"conv backward {percent['conv backward']}, conv forward {percent['conv forward']}, "
                f"dense {percent['dense']}")
    return (f"the convolutions' backward pass {percent['conv backward']}, their forward pass "
            f"{percent['conv forward']}, the dense layers {percent['dense']}")
