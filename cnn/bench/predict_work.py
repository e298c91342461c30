"""What one kernel launch has to do: multiply-adds, bytes, and how often its hot loop runs.

The prediction (``cnn/bench/predict_step.py``) turns this and the machine code into time. A launch
is read as the static report recorded it (``cnn/bench/static_report.py``): argument shapes and
values, grid, block. Per launch:

    macs        multiply-adds executed (padding included: a tile's idle rows still multiply)
    bytes       the bytes its arrays hold that it must read or write once — a floor on its memory
                traffic (every array here fits the H100's 50 MB L2, so re-reads mostly hit there)
    trips       executions of the hot loop's body per thread; None: derived from ``macs`` and the
                FFMAs in the body (``trips = macs / (threads · FFMAs in the body)``)
    slices      round trips to memory a block waits for one after the other (the k-slices of a
                tiled product, each ended by a barrier); 1 for the others
    loads       elements a thread stages into shared memory a slice (A, B), for the tiled products
    global_atomics, shared_atomics   atomic adds (the push kernels of stages 5-7)

``WORK`` names the kernels whose work is not simply "each thread reads its elements once"
(``plain``): the products and the convolutions. A kernel it does not name — a new stage's — gets
``plain``: its bytes, and its hot loop run once (the report says so beside its prediction).

``OWN_MODELS`` names the kernels whose device time a model of their own predicts, because no
roofline of their bytes and multiply-adds describes them: stage 8's ``fused_net_step_kernel``
(the whole step of a group of samples, phase after phase in one block) is timed by
``kernels/fused_net_cost.py``, the stage's own model, walking the same layer table the kernel walks.
Its work carries ``device_us``: (low, high) µs, the high end from issue 22's calibrated constants.
"""

from __future__ import annotations

import math


def size(description) -> int:
    return math.prod(description["shape"])


def shape(description) -> list[int]:
    return description["shape"]


def arrays(description):
    """Every array description inside an argument (tuples opened)."""
    if "array" in description:
        yield description
    for key in ("tuple", "fields"):
        for item in description.get(key, []):
            yield from arrays(item)


def nbytes(description) -> int:
    return size(description) * int(description["array"][-1])


def threads(launch) -> int:
    return math.prod(launch["grid"]) * math.prod(launch["block"])


def plain(launch, ref) -> dict:
    """Each array read or written once; the hot loop (if any) run once a thread."""
    return {"macs": 0, "bytes": sum(nbytes(a) for arg in launch["args"] for a in arrays(arg)), "trips": 1,
            "slices": 1}


def with_macs(macs, launch, slices=1):
    return {**plain(launch, None), "macs": macs, "trips": None, "slices": slices}


def conv_taps(w) -> int:
    """C·K·K of a filter array (F, C, K, K)."""
    return math.prod(shape(w)[1:])


def conv_forward(launch, ref):                       # (x, w, y, stride, pad)
    x, w, y = launch["args"][:3]
    return with_macs(size(y) * conv_taps(w), launch)


def conv_backward_data(launch, ref):                 # (dy, w, dx, stride, pad)
    dy, w, dx, stride = launch["args"][:4]
    return with_macs(size(dx) * shape(w)[0] * shape(w)[2] ** 2 // stride["int"] ** 2, launch)


def conv_backward_filter(launch, ref):               # (dy, x, dw, stride, pad)
    dy, x, dw = launch["args"][:3]
    n, _, h, w = shape(dy)
    return with_macs(size(dw) * n * h * w, launch)


def conv_pool_forward(launch, ref):                  # (x, w, b, y, switches, stride, pad, size, pool_stride, …)
    w, y, window = launch["args"][1], launch["args"][3], launch["args"][7]["int"]
    return with_macs(size(y) * window * window * conv_taps(w), launch)


def conv_pool_backward_push(launch, ref):            # (dy, y, switches, x, w, dx, dw, db, …, with_dx)
    """A thread a pooled output; every tap an atomic add into dW (and dX): global atomics."""
    dy, w = launch["args"][0], launch["args"][4]
    taps, with_dx = conv_taps(w), launch["args"][-1].get("bool", True)
    return {**plain(launch, ref), "trips": taps, "global_atomics": size(dy) * taps * (2 if with_dx else 1)}


def conv_pool_backward_smem(launch, ref):
    """As the push kernel, but dW added up in shared memory: one global atomic a weight and block."""
    dy, w = launch["args"][0], launch["args"][4]
    taps, with_dx = conv_taps(w), launch["args"][-1].get("bool", True)
    return {**plain(launch, ref), "trips": taps, "shared_atomics": size(dy) * taps,
            "global_atomics": size(dy) * taps * with_dx + math.prod(launch["grid"]) * (taps + 1)}


def matmul(launch, ref):                             # (a, b, c, transpose_a, transpose_b[, extra])
    a, b, c, transpose_a = launch["args"][:4]
    inner = shape(a)[0] if transpose_a["bool"] else shape(a)[1]
    tile = launch["block"][0]
    padded = math.prod(launch["grid"]) * tile * tile
    return with_macs(padded * math.ceil(inner / tile) * tile, launch, slices=math.ceil(inner / tile))


def dense_loss(launch, ref):                         # (x, w, b, labels, logits, dlogits, row_loss)
    x, w = launch["args"][:2]
    return with_macs(shape(x)[0] * size(w), launch)


def implicit_gemm(launch, ref):                      # (a_src, b_src, out, inner, k_chunk); tiles in the factory call
    bm, bn, bk, tm, tn = (field["int"] for field in ref["args"][5]["fields"])
    inner, k_chunk = launch["args"][3]["int"], launch["args"][4]["int"]
    blocks_x, blocks_y, splits = launch["grid"]
    per_block = math.ceil(min(k_chunk, inner) / bk) * bk
    block_threads = (bm // tm) * (bn // tn)
    return {**with_macs(blocks_x * blocks_y * splits * bm * bn * per_block, launch, slices=per_block // bk),
            "loads": (bk * bm / block_threads, bk * bn / block_threads)}


def gather(launch, ref):                             # (images, labels, order, …, batch_images, batch_labels)
    batch = [arg for arg in launch["args"] if "array" in arg][-2:]
    return {**plain(launch, ref), "bytes": 2 * sum(nbytes(arg) for arg in batch)}


def strided_sum(launch, ref):                        # bias_grad_kernel (dz, db, inner): a block a channel
    dz, db = launch["args"][:2]
    return {**plain(launch, ref), "trips": size(dz) / size(db) / math.prod(launch["block"])}


def sum_splits(launch, ref):                         # (partial, dw, db): a thread an output, over the splits
    return {**plain(launch, ref), "trips": shape(launch["args"][0])[0]}


def rows_a_thread(launch, ref):                      # softmax_xent_kernel (logits, …): a block, a thread a row
    return {**plain(launch, ref), "trips": max(1.0, shape(launch["args"][0])[0] / threads(launch))}


WORK = {
    "conv2d_forward_kernel": conv_forward,
    "conv2d_backward_data_kernel": conv_backward_data,
    "conv2d_backward_filter_kernel": conv_backward_filter,
    "conv_relu_pool_forward_kernel": conv_pool_forward,
    "conv_relu_pool_forward_smem_kernel": conv_pool_forward,
    "conv_relu_pool_backward_push_kernel": conv_pool_backward_push,
    "conv_relu_pool_backward_smem_kernel": conv_pool_backward_smem,
    "matmul_tiled_kernel": matmul,
    "tiled_epilogue_kernel": matmul,
    "dense_softmax_xent_kernel": dense_loss,
    "gather_batch_kernel": gather,
    "gather_step_batch_kernel": gather,
    "bias_grad_kernel": strided_sum,
    "sum_splits_kernel": sum_splits,
    "softmax_xent_kernel": rows_a_thread,
}


def fused_net_step(launch, ref, model: str) -> dict:
    """Stage 8's kernel 1 (table, params, images, labels, order, position, batch, train, partials, …): a block
    a group of samples, its time ``kernels/fused_net_cost.predict``'s for ``model``'s layer table, with
    the block size, groups and batch of this launch."""
    from cnn.model import get_network
    from cnn.stages.s8_cuda_fused_net import layer_table
    from kernels.fused_net_cost import predict

    params, batch = launch["args"][1], launch["args"][6]["int"]
    groups, threads = launch["grid"][0], launch["block"][0]
    kernel_1 = predict(layer_table(get_network(model)), size(params), batch, math.ceil(batch / groups), threads)
    return {**plain(launch, ref), "device_us": tuple(kernel_1.kernel_1_us)}


OWN_MODELS = {
    "fused_net_step_kernel": fused_net_step,
}


def work(launch: dict, kernel: dict, model: str | None = None) -> dict:
    """The work of ``launch`` of ``kernel`` (an entry of the report's "kernels") in a step of ``model``, with
    "modelled": False when neither ``WORK`` nor ``OWN_MODELS`` knows the kernel (a new stage's: only its
    bytes are known)."""
    name = kernel["function"]
    if name in OWN_MODELS and model is not None:
        return {**OWN_MODELS[name](launch, kernel["ref"], model), "modelled": True}
    if name.startswith("gemm_"):
        return {**implicit_gemm(launch, kernel["ref"]), "modelled": True}
    if name in WORK:
        return {**WORK[name](launch, kernel["ref"]), "modelled": True}
    return {**plain(launch, kernel["ref"]), "modelled": False}
