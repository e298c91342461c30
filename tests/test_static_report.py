"""The static sm_90 report and the PREDICTED step (issue 22): no GPU needed, only NVIDIA's compiler tools.

The report's slow fixture compiles every kernel of one real training step (cuda-tuned, AlexNet-small at
batch 128: ~19 kernels, ~30 s) for sm_90 and checks what the fix of stage 7's tiled convolutions claims:
no integer division inside any loop of any kernel, the convolution products' hot loops mostly FFMAs,
no spill. The others read small inputs or the committed results files.
"""

import json
from pathlib import Path

import pytest

from cnn.bench import predict_report, static_h100, static_sass
from cnn.bench.results import RESULTS_DIR

SASS = """
        /*0000*/                   S2R R0, SR_TID.X ;
.L_x_1:
        /*0010*/                   LDS R2, [R1] ;
        /*0020*/                   FFMA R4, R2, R3, R4 ;
        /*0030*/                   FFMA R5, R2, R3, R5 ;
        /*0040*/                   I2F.U32.RP R6, R7 ;
        /*0050*/                   LDG.E R8, desc[UR4][R10.64] ;
        /*0060*/               @P0 BRA `(.L_x_1) ;
        /*0070*/                   EXIT ;
.L_x_2:
        /*0080*/                   BRA `(.L_x_2) ;
"""


def test_occupancy_follows_the_h100_limits():
    assert static_h100.occupancy(32, 256, 0) == (8, 64, 1.0, "warps")               # 2048 threads an SM
    assert static_h100.occupancy(128, 128, 0).blocks_per_sm == 4                      # 65536 / (128·128)
    assert static_h100.occupancy(255, 256, 0) == (1, 8, 0.125, "registers")           # 256 registers a thread
    assert static_h100.occupancy(16, 64, 100 * 1024).limited_by == "shared memory"   # 2 blocks of 101 KB
    assert static_h100.occupancy(16, 32, 0) == (32, 32, 0.5, "blocks")
    with pytest.raises(ValueError, match="1 to 1024"):
        static_h100.occupancy(32, 2048, 0)


def test_sass_reading_finds_the_loop_its_mix_and_divisions():
    mix = static_sass.loop_mix(SASS)
    assert mix["loops"] == 1                                    # the branch-to-itself after EXIT is no loop
    assert (mix["hot"]["ffma"], mix["hot"]["instructions"], mix["hot"]["lds"], mix["hot"]["ldg"]) == (2, 6, 1, 1)
    assert mix["in_loops"]["divisions_32"] == 1 and mix["kernel"]["instructions"] == 9


def test_missing_tools_say_what_to_install(monkeypatch):
    monkeypatch.setattr(static_sass, "find_tool", lambda name: None)
    with pytest.raises(ValueError, match=r"ptxas and nvdisasm not found.*pip install"):
        static_sass.tools()


@pytest.fixture(scope="module")
def tuned_alexnet():
    try:
        static_sass.tools()
    except ValueError as err:
        pytest.skip(str(err))
    from cnn.bench.static_report import static_report

    return static_report("cuda-tuned", "alexnet-small", 128)


def test_report_of_a_real_step_compiles_every_kernel_sanely(tuned_alexnet):
    kernels = tuned_alexnet["kernels"]
    assert all("error" not in kernel for kernel in kernels), [k.get("error") for k in kernels]
    steps = [op for op in tuned_alexnet["back_to_back"] if "copy" not in op]
    assert sum(kernel["launches_per_step"] for kernel in kernels) == len(steps) == 26
    for kernel in kernels:
        assert 0 < kernel["resources"]["registers"] <= 255
        for occupancy in kernel["occupancy"]:
            assert 0 < occupancy["occupancy"] <= 1 and occupancy["blocks_per_sm"] >= 1


def test_the_tiled_convolutions_loop_without_dividing(tuned_alexnet):
    """What the fix of issue 22 claims, read from the machine code it compiles to."""
    gemms = [kernel for kernel in tuned_alexnet["kernels"] if kernel["function"].startswith("gemm_")]
    assert gemms
    for kernel in gemms:
        in_loops = kernel["mix"]["in_loops"]
        assert in_loops["divisions_32"] + in_loops["divisions_64"] == 0, kernel["function"]
        assert kernel["resources"]["spill_stores"] == 0, kernel["function"]
    convolutions = [k for k in gemms if k["function"] in ("gemm_bias_relu_pool_store", "gemm_store_partial",
                                                           "gemm_pixel_store")]
    for kernel in convolutions:
        hot = kernel["mix"]["hot"]
        assert hot["ffma"] / hot["instructions"] > 0.5, kernel["function"]


def test_prediction_is_within_its_target_on_every_committed_step():
    """The committed prediction file (python -m cnn bench --predict) holds a prediction for every committed
    H100 step of stages 4-7, each within 1.5× of the measurement, and says tiled-conv now speeds up both
    networks (PREDICTED; the next GPU session measures it)."""
    path = Path(RESULTS_DIR) / predict_report.RESULTS_NAME
    result = json.loads(path.read_text())
    steps = [s for s in result["calibration"]["steps"] if s["kind"] == "bench"]
    assert len(steps) >= 16 and all(predict_report.finite(s["predicted_ms"]) for s in steps)
    assert predict_report.worst_bench_ratio(RESULTS_DIR) <= 1.5
    tiled = result["predicted"]["tiled_conv"]
    assert {row["model"] for row in tiled} == {"lenet5", "alexnet-small"}
    assert all(row["speedup_vs_baseline"] > 1 for row in tiled if row["variant"] == "+ tiled-conv alone")


def test_stage_8s_fused_step_is_timed_by_its_own_model_and_as_one_graph():
    """fused_net_step_kernel has no roofline: the prediction takes its time from kernels/fused_net_cost.py (the
    stage's model, the high end for the calibrated figure), and cuda-fused-net, which replays its step as one
    CUDA graph, is predicted as one (the committed file: no kernel without a model, a graph time)."""
    from cnn.bench import predict_step
    from cnn.model import lenet5
    from cnn.stages.s8_cuda_fused_net import layer_table
    from kernels.fused_net_cost import predict

    report = json.loads((Path(RESULTS_DIR) / "static-sm90-cuda-fused-net-lenet5-b64.json").read_text())
    launch = next(op for op in report["back_to_back"] if op.get("function") == "fused_net_step_kernel")
    timed = predict_step.kernel_us(report["kernels"][launch["kernel"]], launch, predict_step.CALIBRATED, "lenet5")
    groups, threads = launch["grid"][0], launch["block"][0]
    low, high = predict(layer_table(lenet5()), lenet5().num_params, 64, -(-64 // groups), threads).kernel_1_us
    assert timed["bound"] == "own model" and (timed["low_us"], timed["us"]) == pytest.approx((low, high)) and low < high
    rows = [row for row in json.loads((Path(RESULTS_DIR) / predict_report.RESULTS_NAME).read_text())["predicted"]["stages"]
            if row["stage"] == "cuda-fused-net"]
    assert {row["model"] for row in rows} == {"lenet5", "alexnet-small"}
    for row in rows:
        assert row["unmodelled"] == [] and [k["kernel"] for k in row["own_models"]] == ["fused_net_step_kernel"]
        assert predict_report.finite(row["graph_ms"]) and row["graph_ms"] < row["back_to_back_ms"] * 1.01
