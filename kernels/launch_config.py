"""Launch configurations chosen from each layer's shape (stage 7's ``launch-config`` fix).

Stages 4–6 give every element-wise kernel 128 threads a block and every matrix product
16 × 16 tiles, whatever the layer. A GPU with S streaming multiprocessors (SMs) keeps them all
busy only when a launch has at least S blocks — and hides each block's memory stalls behind
another's when it has about 2·S. A layer of LeNet-5 at batch 64 often has fewer: conv2's
pooled output is 64·16·4·4 = 16 384 threads = 128 blocks of 128 (132 SMs on an H100), the
dense layers' weight gradients (120 × 256) are 8 × 16 = 128 tiles of 16 × 16.

``LaunchConfig(tuned)`` answers the two questions every launch asks:

    threads(count)       threads a block for ``count`` threads of work:
                         the LARGEST of 256, 128, 64, 32 that still makes ≥ 2·S blocks;
                         32 (one warp) when even that makes fewer
    tile(rows, cols)     tile edge for a rows × cols product: 16 when that makes ≥ S tiles, else 8

With ``tuned=False`` it answers as stages 4–6 do (128 threads, 16 × 16 tiles), so the fix can be
switched off and measured. S comes from the device; the simulator has none, and then
``ASSUMED_SMS`` (an H100 SXM's 132) is used — the choices only depend on shapes.
"""

from __future__ import annotations

from kernels.device import cuda, simulated
from kernels.launch import THREADS_PER_BLOCK, blocks_for

ASSUMED_SMS = 132
BLOCK_CHOICES = (256, 128, 64, 32)
DEFAULT_TILE, SMALL_TILE = 16, 8


def multiprocessors() -> int:
    """Streaming multiprocessors of the current GPU (``ASSUMED_SMS`` in the simulator)."""
    if simulated():
        return ASSUMED_SMS
    return int(cuda.get_current_device().MULTIPROCESSOR_COUNT)


class LaunchConfig:
    """Block and tile sizes from the shape of the work (``tuned``), or the fixed ones of stages 4–6."""

    def __init__(self, tuned: bool, sms: int | None = None):
        self.tuned = tuned
        self.sms = sms if sms is not None else (multiprocessors() if tuned else ASSUMED_SMS)

    def threads(self, count: int) -> int:
        if not self.tuned:
            return THREADS_PER_BLOCK
        for threads in BLOCK_CHOICES:
            if blocks_for(count, threads) >= 2 * self.sms:
                return threads
        return BLOCK_CHOICES[-1]

    def tile(self, rows: int, cols: int) -> int:
        if not self.tuned or blocks_for(rows, DEFAULT_TILE) * blocks_for(cols, DEFAULT_TILE) >= self.sms:
            return DEFAULT_TILE
        return SMALL_TILE
