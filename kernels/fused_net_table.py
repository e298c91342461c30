"""Stage 8's layer table: a network as rows of int32 that one kernel walks, and its shared-memory plan.

``kernels/fused_net_step.py`` runs a whole training step of a group of samples in one block. It
knows nothing about the network it runs: it reads a small int32 *table*, one row an operation,
and calls one device function per kind of row. This module builds that table from a layer list
(``TableBuilder``; ``cnn/stages/s8_cuda_fused_net.py`` walks ``net.layers`` and calls it) and decides
where every buffer of the block lives in its dynamic shared memory (``TableBuilder.plan``).

Two kinds of operation cover the course's layer list (Conv, ReLU, MaxPool, Flatten, Dense):

    WINDOW   z = conv(x) + b (or z = x when the row has no convolution, K = 0), then the max over
             POOL × POOL windows every PSTRIDE (1 × 1: no pooling), then the ReLU when RELU = 1.
             A Conv takes the ReLUs and the one MaxPool that follow it, in either order:
             max(ReLU(z)) = ReLU(max(z)) because the ReLU never changes which value is largest,
             and the gradient is the same both ways (it is zero wherever the ReLU is off). Only the
             pooled output and its switches are kept: the convolution output is never stored.
    DENSE    y = x·Wᵀ + b, then the ReLU when RELU = 1 (the ReLUs that follow it).

A Flatten is no row at all: a block keeps each sample's activations in C order, so the flat
vector a Dense reads is the (C, H, W) output of the row before it, as it lies. A MaxPool that
finds no WINDOW row to join (a pool after a pool) and a ReLU that opens the network become rows
of their own, a WINDOW with K = 0.

What the plan decides for speed (``kernels/fused_net_window.py`` uses it):

    halos     a convolution with padding reads its input from planes stored WITH a zero border
              of PAD: (H + 2·PAD) × (W + 2·PAD). The row that writes that input writes inside the
              border (its OPAD), and the border is zeroed once at the start of the kernel, so no
              inner loop tests whether a tap falls in the padding.
    slices    a convolution whose items are fewer than the block's threads splits its sum over the
              C·K filter rows (c, p) into SLICES equal parts, each an item of its own; a second
              pass adds the parts in slice order (a fixed order: the same bits every run) and
              pools. LeNet-5's conv2 has 32 items of 150 taps unsplit, 192 of 25 split in 6.
              Likewise dW, a sum over the pooling windows, in DW_PARTS parts when its items are
              fewer than half the threads: LeNet-5's conv1 has 30 items of 144 windows, 270 of 16.
    staging   the weights a convolution multiplies by are copied into shared memory before they
              are used, STEP_ROWS filter rows of every slice at a time (all of them when they fit),
              laid out filter-fastest so that the 8 filters of a tile are 8 neighbouring words;
              the backward pass stages DX_FILTERS filters at a time, channel-fastest.

Row 0 is a header (``OPS`` rows follow, ``SAMPLES`` samples a block, where the input and labels
sit, the words of shared memory in all, where the scratch, the dW parts and the staging area
start); each later row holds the fields named below. Offsets are in 4-byte words of the block's
dynamic shared memory, seen as float32 (activations, gradients, weights), as int32 (labels) and as
bytes (switches: a row's switches start at byte 4·SWITCH).
A buffer holds the block's ``SAMPLES`` samples one after the other.

Per group of S samples, a block's shared memory holds:

    input       S·C·(H + 2·PAD)·(W + 2·PAD)   the samples, gathered from the resident data set
    OUT         S·F·(HO + 2·OPAD)·(WO + 2·OPAD)   each row's output (pooled), kept for the backward
    grad A, B   S·max |out|    dL/d(output) of a row and dL/d(input) it writes, taking turns; during
                               the forward pass the same words are scratch: a Dense row's partial dot
                               products (S·F·(LANES + 1)), a split convolution's partial sums
    SWITCH      S·F·Ho·Wo / 4  bytes: which position of each pooling window won, its row · 16 + its column
    labels      S              ints
    parts       (shared) a split dW's sums, part by part, before they are added in order
    staging     (shared) the weights being multiplied
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

WINDOW, DENSE = 0, 1
# row 0
OPS, SAMPLES, INPUT, INPUT_SIZE, LABELS, WORDS, POISON, SCRATCH, STAGE, PARTS = range(10)
# rows 1 … OPS
(KIND, IN, OUT, SWITCH, DIN, DOUT, C, H, W, F, HO, WO, HC, WC, K, STRIDE, PAD, POOL, PSTRIDE, RELU, PARAM,
 NEED_DX, OPAD, IN_RELU, SLICES, STEP_ROWS, DX_FILTERS, DW_PARTS) = range(28)
FIELDS = 28
LANES = 32                      # threads that share one Dense output's dot product (kernels/fused_net_layers.py)
FILTER_TILE = 8                 # filters a forward convolution item computes at once
POSITIONS = 4                   # conv outputs of a pooling window it computes at once (a 2 × 2 window)
CHANNEL_TILE = 8                # channels a dL/dx item computes at once
TAP_TILE = 8                    # neighbouring taps of a filter row a dW item computes at once
MIN_WINDOWS = 16                # the fewest pooling windows one part of a split dW sums
THREADS = 512                   # a block on the H100: 16 warps (kernels/fused_net_step.py); the slices are
                                # planned for it, so the bits never depend on the threads a block really has
MIN_TAPS = 25                   # the fewest taps (c, p, q) one part of a split convolution sums
LARGEST_POOL = 16               # a switch holds a window's row and column in 4 bits each
WORD = 4                        # bytes
BLOCKS_PER_SM = 2               # samples a block grow only once the batch gives every SM this many blocks


class Plan(NamedTuple):
    """A layer table for blocks of ``samples`` samples, and what its shared memory holds."""

    table: np.ndarray            # (1 + ops, FIELDS) int32
    samples: int
    shared_bytes: int
    regions: dict                # name -> words for the whole block (the budget table of the docs)


def filter_pitch(filters: int) -> int:
    """Words between two taps of the forward staging area: the filters rounded up to tiles, plus one (an odd
    pitch: the 32 lanes of a warp storing 32 taps of one filter hit 32 different banks)."""
    return -(-filters // FILTER_TILE) * FILTER_TILE + 1


def channel_pitch(channels: int) -> int:
    """Words between two taps of the backward staging area (channels rounded up to tiles, plus one)."""
    return -(-channels // CHANNEL_TILE) * CHANNEL_TILE + 1


def divisors(number: int) -> list[int]:
    return [d for d in range(1, number + 1) if number % d == 0]


class TableBuilder:
    """Layers in, one row per fused operation out: call ``conv``, ``pool``, ``relu``, ``flatten``, ``dense``
    in network order, then ``plan(samples, limit)``."""

    def __init__(self, input_shape):
        self.input_shape = tuple(input_shape)
        self.shape = self.input_shape
        self.rows: list[dict] = []

    # -- the layers -----------------------------------------------------------------------------
    def conv(self, filters: int, kernel: int, stride: int, pad: int, param: int) -> None:
        channels, height, width = self.shape
        out_h, out_w = (height + 2 * pad - kernel) // stride + 1, (width + 2 * pad - kernel) // stride + 1
        self._window(dict(C=channels, H=height, W=width, F=filters, HC=out_h, WC=out_w, K=kernel, STRIDE=stride,
                          PAD=pad, PARAM=param))

    def pool(self, size: int, stride: int) -> None:
        if size > LARGEST_POOL:
            raise ValueError(f"a {size}x{size} pool: a switch holds a window's row and column in 4 bits each "
                             f"(at most {LARGEST_POOL}x{LARGEST_POOL})")
        last = self.rows[-1] if self.rows else None
        if last is None or last["KIND"] != WINDOW or last["POOL"] != 1:
            channels, height, width = self.shape
            self._window(dict(C=channels, H=height, W=width, F=channels, HC=height, WC=width))
            last = self.rows[-1]
        last.update(POOL=size, PSTRIDE=stride, HO=(last["HC"] - size) // stride + 1,
                    WO=(last["WC"] - size) // stride + 1)
        self.shape = (last["F"], last["HO"], last["WO"])

    def relu(self) -> None:
        if not self.rows:                                    # a ReLU on the input: a row of its own
            channels, height, width = self.shape
            self._window(dict(C=channels, H=height, W=width, F=channels, HC=height, WC=width))
        self.rows[-1]["RELU"] = 1

    def flatten(self) -> None:
        self.shape = (int(np.prod(self.shape)),)

    def dense(self, out_features: int, param: int) -> None:
        self.rows.append(dict(KIND=DENSE, C=int(np.prod(self.shape)), H=1, W=1, F=out_features, HO=1, WO=1, HC=1,
                              WC=1, K=0, STRIDE=1, PAD=0, POOL=1, PSTRIDE=1, RELU=0, PARAM=param))
        self.shape = (out_features,)

    def _window(self, fields: dict) -> None:
        row = {**dict(KIND=WINDOW, K=0, STRIDE=1, PAD=0, POOL=1, PSTRIDE=1, RELU=0, PARAM=-1), **fields}
        row.setdefault("HO", row["HC"])
        row.setdefault("WO", row["WC"])
        self.rows.append(row)
        self.shape = (row["F"], row["HO"], row["WO"])

    # -- the shared-memory plan ------------------------------------------------------------------
    def halos(self) -> list[int]:
        """The zero border each row's output is stored with: the padding of the convolution that reads it."""
        return [nxt["PAD"] if nxt["KIND"] == WINDOW and nxt["K"] else 0 for nxt in self.rows[1:]] + [0]

    def input_words(self) -> int:
        first = self.rows[0] if self.rows else {"K": 0}
        pad = first["PAD"] if first["K"] else 0
        channels, height, width = self.input_shape
        return channels * (height + 2 * pad) * (width + 2 * pad)

    @staticmethod
    def is_conv(row: dict) -> bool:
        return row["KIND"] == WINDOW and row["K"] > 0

    def slices(self, row: dict, samples: int) -> int:
        """SLICES of a convolution: the fewest equal parts of its C·K filter rows that give the block at least
        ``THREADS`` items, but no part shorter than ``MIN_TAPS`` taps (a part's set-up and the pass that adds the
        parts must stay small beside it)."""
        rows = row["C"] * row["K"]
        groups = -(-row["F"] // FILTER_TILE) * -(-row["POOL"] ** 2 // POSITIONS)
        items = samples * groups * row["HO"] * row["WO"]
        allowed = [d for d in divisors(rows) if d == 1 or rows // d * row["K"] >= MIN_TAPS]
        return next((d for d in allowed if items * d >= THREADS), allowed[-1])

    @staticmethod
    def dw_items(row: dict) -> int:
        """dW items of a convolution (weight_gradient): (f, c, p, tile of TAP_TILE taps q)."""
        return row["F"] * row["C"] * row["K"] * -(-row["K"] // TAP_TILE)

    def dw_parts(self, row: dict) -> int:
        """DW_PARTS: the fewest parts of its windows that give dW half the block's threads as items, each part
        at least MIN_WINDOWS windows long."""
        windows = row["HO"] * row["WO"]
        return max(1, min(-(-THREADS // 2 // self.dw_items(row)), windows // MIN_WINDOWS))

    def parts_words(self) -> int:
        """The parts region: the largest split dW's sums, every part of every weight (W's C·K·K·F words a part)."""
        return max([self.dw_parts(row) * row["F"] * row["C"] * row["K"] ** 2 for row in self.rows
                    if self.is_conv(row) and self.dw_parts(row) > 1], default=0)

    @staticmethod
    def split_scratch(row: dict, slices: int) -> int:
        """Words a sample's split convolution leaves in the scratch: every item's FILTER_TILE × POSITIONS sums."""
        if slices == 1 and row["POOL"] ** 2 <= POSITIONS:
            return 0
        tiles = -(-row["F"] // FILTER_TILE) * -(-row["POOL"] ** 2 // POSITIONS)
        return slices * tiles * FILTER_TILE * POSITIONS * row["HO"] * row["WO"]

    def words_per_sample(self, slices=None) -> dict:
        """Words of shared memory one sample needs, region by region (``plan`` multiplies by S)."""
        slices = slices or [self.slices(row, 1) if self.is_conv(row) else 1 for row in self.rows]
        halos = self.halos()
        outs = [row["F"] * row["HO"] * row["WO"] for row in self.rows]
        stored = [row["F"] * (row["HO"] + 2 * halo) * (row["WO"] + 2 * halo) for row, halo in zip(self.rows, halos)]
        scratch = [(LANES + 1) * row["F"] if row["KIND"] == DENSE else self.split_scratch(row, s) if self.is_conv(row)
                   else 0 for row, s in zip(self.rows, slices)]
        return {"input": self.input_words(), "outputs": sum(stored), "gradients": max([2 * max(outs)] + scratch),
                "switches": sum(-(-out // WORD) for out, row in zip(outs, self.rows) if row["KIND"] == WINDOW),
                "labels": 1}

    def staging_words(self, row: dict, slices: int, step_rows: int, dx_filters: int) -> int:
        """Words of the staging area a convolution needs: a forward step, and a backward step when it has one."""
        forward = slices * step_rows * row["K"] * filter_pitch(row["F"])
        backward = dx_filters * row["K"] ** 2 * channel_pitch(row["C"])
        return max(forward, backward if row is not self.rows[0] else 0)

    def samples_for(self, batch: int, limit_bytes: int, sms: int) -> int:
        """Samples a block for a batch: one — more only when the batch gives every one of the ``sms`` SMs
        ``BLOCKS_PER_SM`` blocks anyway (fewer rows of partial sums to add up) and they fit in shared memory."""
        smallest = max([self.staging_words(row, 1, 1, 1) for row in self.rows if self.is_conv(row)], default=0)
        fit = (limit_bytes // WORD - smallest - self.parts_words()) // sum(self.words_per_sample().values())
        return max(1, min(fit, -(-batch // (BLOCKS_PER_SM * sms))))

    def plan(self, samples: int, limit_bytes: int, poison: bool = False) -> Plan:
        """The table for blocks of ``samples`` samples; ValueError (one line) when it needs more than ``limit_bytes``.

        Slices as ``slices`` asks unless their scratch leaves no room to stage one filter row at a time (then
        fewer); then each convolution stages as many filter rows (forward) and filters (backward) at a time as
        the words left hold, in equal steps."""
        if not self.rows:
            raise ValueError("the network has no layer to run")
        slices = [self.slices(row, samples) if self.is_conv(row) else 1 for row in self.rows]
        while True:
            per_sample = self.words_per_sample(slices)
            regions = {name: samples * words for name, words in per_sample.items()}
            regions["parts"] = self.parts_words()
            smallest = max([self.staging_words(row, s, 1, 1) for row, s in zip(self.rows, slices)
                            if self.is_conv(row)], default=0)
            left = limit_bytes // WORD - sum(regions.values()) - smallest
            widest = max(range(len(slices)), key=lambda r: self.split_scratch(self.rows[r], slices[r]))
            if left >= 0 or slices[widest] == 1:
                break
            slices[widest] = max(d for d in divisors(self.rows[widest]["C"] * self.rows[widest]["K"])
                                 if d < slices[widest])
        if left < 0:
            words = sum(regions.values()) + smallest
            raise ValueError(f"{samples} sample(s) a block need {words * WORD / 1024:.1f} KiB of shared memory "
                             f"({', '.join(f'{name} {count * WORD / 1024:.1f}' for name, count in regions.items())}"
                             f" KiB, staging {smallest * WORD / 1024:.1f} KiB), more than the "
                             f"{limit_bytes / 1024:.0f} KiB a block may have")
        budget = left + smallest
        steps = [self._steps(row, s, budget) if self.is_conv(row) else (1, 1) for row, s in zip(self.rows, slices)]
        regions["staging"] = max([self.staging_words(row, s, *step) for row, s, step in zip(self.rows, slices, steps)
                                  if self.is_conv(row)], default=0)
        return Plan(self._table(samples, slices, steps, regions, poison), samples,
                    sum(regions.values()) * WORD, regions)

    def _steps(self, row: dict, slices: int, budget: int) -> tuple[int, int]:
        """(STEP_ROWS, DX_FILTERS): the most filter rows of a slice, and filters, that ``budget`` words hold, in
        equal steps (divisors)."""
        rows = row["C"] * row["K"] // slices
        step_rows = max(d for d in divisors(rows) if self.staging_words(row, slices, d, 1) <= budget)
        dx_filters = max(d for d in divisors(row["F"]) if self.staging_words(row, slices, 1, d) <= budget)
        return step_rows, dx_filters

    def _table(self, samples: int, slices, steps, regions: dict, poison: bool) -> np.ndarray:
        halos = self.halos()
        sizes = [samples * row["F"] * row["HO"] * row["WO"] for row in self.rows]
        stored = [samples * row["F"] * (row["HO"] + 2 * halo) * (row["WO"] + 2 * halo)
                  for row, halo in zip(self.rows, halos)]
        outputs = list(_offsets(regions["input"], stored))            # the input sits at word 0, then the outputs
        gradients = regions["input"] + regions["outputs"]
        turns = (gradients, gradients + max(sizes))                    # grad A, grad B
        switches = list(_offsets(gradients + regions["gradients"], [-(-size // WORD) if row["KIND"] == WINDOW else 0
                                                                     for size, row in zip(sizes, self.rows)]))
        words = sum(regions.values())
        table = np.zeros((1 + len(self.rows), FIELDS), np.int32)
        table[0, [OPS, SAMPLES, INPUT, INPUT_SIZE, LABELS, WORDS, POISON, SCRATCH, STAGE, PARTS]] = (
            len(self.rows), samples, 0, int(np.prod(self.input_shape)), switches[-1], words, int(poison), gradients,
            words - regions["staging"], words - regions["staging"] - regions["parts"])
        for position, row in enumerate(self.rows):
            from_end = len(self.rows) - 1 - position                   # the last row reads grad A
            fields = {**row, "IN": outputs[position - 1] if position else 0, "OUT": outputs[position],
                      "DOUT": turns[from_end % 2], "DIN": turns[(from_end + 1) % 2],
                      "SWITCH": switches[position] if row["KIND"] == WINDOW else -1, "NEED_DX": int(position > 0),
                      "OPAD": halos[position], "IN_RELU": self.rows[position - 1]["RELU"] if position else 0,
                      "SLICES": slices[position], "STEP_ROWS": steps[position][0], "DX_FILTERS": steps[position][1],
                      "DW_PARTS": self.dw_parts(row) if self.is_conv(row) else 1}
            table[1 + position] = [fields[name] for name in _FIELD_NAMES]
        return table


_FIELD_NAMES = ("KIND", "IN", "OUT", "SWITCH", "DIN", "DOUT", "C", "H", "W", "F", "HO", "WO", "HC", "WC", "K",
                "STRIDE", "PAD", "POOL", "PSTRIDE", "RELU", "PARAM", "NEED_DX", "OPAD", "IN_RELU", "SLICES",
                "STEP_ROWS", "DX_FILTERS", "DW_PARTS")


def _offsets(start: int, sizes):
    """start, start + sizes[0], start + sizes[0] + sizes[1], …: consecutive buffers."""
    yield start
    for size in sizes:
        start += size
        yield start
