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

Row 0 is a header (``OPS`` rows follow, ``SAMPLES`` samples a block, where the input and labels
sit, the words of shared memory in all); each later row holds the fields named below. Offsets
are in 4-byte words of the block's dynamic shared memory, seen as float32 (activations and
gradients, from word 0) and as int32 (pooling switches and labels, after the floats). A buffer
holds the block's ``SAMPLES`` samples one after the other: sample s of a buffer of ``size``
words per sample starts at offset + s·size.

Per group of S samples, a block's shared memory holds:

    input       S·C·H·W        the samples, gathered from the resident data set
    OUT         S·F·Ho·Wo      each row's output (pooled), kept for the backward pass
    grad A, B   S·max |out|    dL/d(output) of a row and dL/d(input) it writes, taking turns; during
                               the forward pass the same words are a Dense row's scratch (S·F·LANES)
    SWITCH      S·F·Ho·Wo      ints: which (ci, cj) won each pooling window, packed ci·2¹⁶ + cj
    labels      S              ints
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

WINDOW, DENSE = 0, 1
# row 0
OPS, SAMPLES, INPUT, INPUT_SIZE, LABELS, WORDS, POISON, SCRATCH = range(8)
# rows 1 … OPS
(KIND, IN, OUT, SWITCH, DIN, DOUT, C, H, W, F, HO, WO, HC, WC, K, STRIDE, PAD, POOL, PSTRIDE, RELU, PARAM,
 NEED_DX) = range(22)
FIELDS = 22
LANES = 32                      # threads that share one Dense output's dot product (kernels/fused_net_layers.py)
PACKED_LIMIT = 1 << 15          # switches pack ci and cj in 16 bits each
WORD = 4                        # bytes
BLOCKS_PER_SM = 2               # samples a block grow only once the batch gives every SM this many blocks


class Plan(NamedTuple):
    """A layer table for blocks of ``samples`` samples, and what its shared memory holds."""

    table: np.ndarray            # (1 + ops, FIELDS) int32
    samples: int
    shared_bytes: int
    regions: dict                # name -> words for the whole block (the budget table of the docs)


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
        if max(row["HC"], row["WC"]) >= PACKED_LIMIT:
            raise ValueError(f"a {row['HC']}x{row['WC']} plane is too large for switches packed in 16 bits")
        self.rows.append(row)
        self.shape = (row["F"], row["HO"], row["WO"])

    # -- the shared-memory plan ------------------------------------------------------------------
    def words_per_sample(self) -> dict:
        """Words of shared memory one sample needs, region by region (``plan`` multiplies by S)."""
        outs = [row["F"] * row["HO"] * row["WO"] for row in self.rows]
        lanes = [LANES * row["F"] for row in self.rows if row["KIND"] == DENSE]
        gradients = 2 * max(outs)
        return {"input": int(np.prod(self.input_shape)), "outputs": sum(outs),
                "gradients": gradients + max(0, max(lanes, default=0) - gradients),
                "switches": sum(out for out, row in zip(outs, self.rows) if row["KIND"] == WINDOW), "labels": 1}

    def samples_for(self, batch: int, limit_bytes: int, sms: int) -> int:
        """Samples a block for a batch: one — more only when the batch gives every one of the ``sms`` SMs
        ``BLOCKS_PER_SM`` blocks anyway (fewer rows of partial sums to add up) and they fit in shared memory."""
        fit = limit_bytes // (WORD * sum(self.words_per_sample().values()))
        return max(1, min(fit, -(-batch // (BLOCKS_PER_SM * sms))))

    def plan(self, samples: int, limit_bytes: int, poison: bool = False) -> Plan:
        """The table for blocks of ``samples`` samples; ValueError (one line) when it needs more than ``limit_bytes``."""
        if not self.rows:
            raise ValueError("the network has no layer to run")
        per_sample = self.words_per_sample()
        regions = {name: samples * words for name, words in per_sample.items()}
        words = sum(regions.values())
        if words * WORD > limit_bytes:
            raise ValueError(f"{samples} sample(s) a block need {words * WORD / 1024:.1f} KiB of shared memory "
                             f"({', '.join(f'{name} {count * WORD / 1024:.1f}' for name, count in regions.items())}"
                             f" KiB), more than the {limit_bytes / 1024:.0f} KiB a block may have")
        sizes = [samples * row["F"] * row["HO"] * row["WO"] for row in self.rows]
        outputs = list(_offsets(regions["input"], sizes))             # the input sits at word 0, then the outputs
        gradients = regions["input"] + regions["outputs"]
        turns = (gradients, gradients + max(sizes))                    # grad A, grad B
        switches = list(_offsets(gradients + regions["gradients"], [size if row["KIND"] == WINDOW else 0
                                                                     for size, row in zip(sizes, self.rows)]))
        table = np.zeros((1 + len(self.rows), FIELDS), np.int32)
        table[0, [OPS, SAMPLES, INPUT, INPUT_SIZE, LABELS, WORDS, POISON, SCRATCH]] = (
            len(self.rows), samples, 0, per_sample["input"], switches[-1], words, int(poison), gradients)
        for position, row in enumerate(self.rows):
            from_end = len(self.rows) - 1 - position                   # the last row reads grad A
            fields = {**row, "IN": outputs[position - 1] if position else 0, "OUT": outputs[position],
                      "DOUT": turns[from_end % 2], "DIN": turns[(from_end + 1) % 2],
                      "SWITCH": switches[position] if row["KIND"] == WINDOW else -1, "NEED_DX": int(position > 0)}
            table[1 + position] = [fields[name] for name in _FIELD_NAMES]
        return Plan(table, samples, words * WORD, regions)


_FIELD_NAMES = ("KIND", "IN", "OUT", "SWITCH", "DIN", "DOUT", "C", "H", "W", "F", "HO", "WO", "HC", "WC", "K",
                "STRIDE", "PAD", "POOL", "PSTRIDE", "RELU", "PARAM", "NEED_DX")


def _offsets(start: int, sizes):
    """start, start + sizes[0], start + sizes[0] + sizes[1], …: consecutive buffers."""
    yield start
    for size in sizes:
        start += size
        yield start
