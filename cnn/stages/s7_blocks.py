"""The blocks stage 7's fixes swap in (``cnn/stages/s7_cuda_tuned.py`` says which fix does what).

With every switch off each block is stage 5's (a fused Conv → ReLU → MaxPool) or stage 4's (a
Dense + ReLU), so a fix can be measured on its own:

    TunedConvPoolBlock   smem-weights: the filter in shared memory, dW/db summed per block first
                         fewer-launches: its atomics accumulate into buffers the stage zeroed in one launch
                         tiled-conv: forward, dW and dX as implicit GEMMs (``kernels/conv_gemm.py``), no atomics
    TunedDenseBlock      fewer-launches: 1 launch forward, 2 backward (``kernels/dense_fused.py``)
                         tiled-conv: the same three products through the implicit GEMM (``kernels/dense_gemm.py``)
    DenseLossBlock       fused-loss: the last Dense + softmax + cross-entropy + dL/dlogits in one kernel
"""

from __future__ import annotations

from cnn.stages.s4_cuda import INDEX, DenseBlock
from cnn.stages.s5_cuda_fused import FusedConvPoolBlock
from kernels import conv_pool_fused, dense_fused, dense_gemm
from kernels.conv_gemm import (ConvGeometry, ConvTables, conv_relu_pool_backward_tiled, conv_relu_pool_forward_tiled,
                               conv_tables, partial_shape)
from kernels.conv_pool_smem import conv_relu_pool_backward_smem, conv_relu_pool_forward_smem, fits
from kernels.dense_loss import dense_softmax_xent
from kernels.fill import fill


# -- blocks with switches: off, each is stage 5's or stage 4's block -------------------------------
class TunedConvPoolBlock(FusedConvPoolBlock):
    """Conv → ReLU → MaxPool: tiled implicit GEMMs (``tiled``), or stage 5's push kernels with the
    filter in shared memory (``smem``) and/or their buffers zeroed by the stage (``prezeroed``)."""

    def __init__(self, stage, index):
        super().__init__(stage, index)
        self.tiled = stage.has("tiled-conv")
        self.layouts = {}                   # batch -> (geometry, decode tables on the device)
        self.smem = not self.tiled and stage.has("smem-weights") and fits(self.layer.in_channels, self.layer.kernel)
        self.prezeroed = not self.tiled and stage.has("fewer-launches")

    def layout(self, batch: int) -> tuple[ConvGeometry, ConvTables]:
        """The tiled kernels' geometry and decode tables for this batch size (made once, kept)."""
        if batch not in self.layouts:
            g = ConvGeometry.of((batch, *self.stage.net.activation_shapes()[self.index]), self.params["W"].shape,
                                self.layer.stride, self.layer.pad, self.pool.size, self.pool.stride)
            self.layouts[batch] = g, conv_tables(g)
        return self.layouts[batch]

    def forward(self, x):
        if not (self.smem or self.tiled):
            return super().forward(x)
        self.x = x
        shape = (x.shape[0], *self.out_shape)
        self.y, self.switches = self.buffer("y", shape), self.buffer("switches", shape, INDEX)
        if self.tiled:
            conv_relu_pool_forward_tiled(x, self.params["W"], self.params["b"], self.y, self.switches,
                                         *self.layout(x.shape[0]), self.launch)
        else:
            conv_relu_pool_forward_smem(x, self.params["W"], self.params["b"], self.y, self.switches,
                                        self.layer.stride, self.layer.pad, self.pool.size, self.pool.stride,
                                        self.conv_width, self.stage.config.threads(self.y.size), self.launch)
        return self.y

    def backward(self, dy, need_dx):
        if self.tiled:
            return self.backward_tiled(dy, need_dx)
        if not (self.smem or self.prezeroed):
            return super().backward(dy, need_dx)
        dx = self.zeroed_dx(need_dx)
        args = (dy, self.y, self.switches, self.x, self.params["W"], dx, self.grads["W"], self.grads["b"],
                self.layer.stride, self.layer.pad, self.conv_width, need_dx)
        if self.smem:
            conv_relu_pool_backward_smem(*args, threads=self.stage.config.threads(dy.size), launch=self.launch)
        else:
            conv_pool_fused.conv_relu_pool_backward_push(*args, launch=self.launch)
        return dx if need_dx else None

    def backward_tiled(self, dy, need_dx):
        """dz, dW and db, dX: every output written once, nothing to zero first (``kernels/conv_gemm.py``)."""
        g, tables = self.layout(dy.shape[0])
        dx = self.buffer("dx", self.x.shape) if need_dx else self.stage.no_dx
        dz = self.buffer("dz", (g.batch, g.filters, g.conv_h, g.conv_w))
        conv_relu_pool_backward_tiled(dy, self.y, self.switches, self.x, self.params["W"], dx, self.grads["W"],
                                      self.grads["b"], dz, self.buffer("partial", partial_shape(g)), g, tables,
                                      need_dx, self.launch)
        return dx if need_dx else None

    def zeroed_dx(self, need_dx):
        """dX (or the unused placeholder), zeroed, with this block's dW and db zeroed too."""
        if self.prezeroed:                                   # the stage's zero_pair launch did it
            return self.stage.arena_views[self.index] if need_dx else self.stage.no_dx
        fill(self.param_grads, 0.0, self.launch)
        if not need_dx:
            return self.stage.no_dx
        dx = self.buffer("dx", self.x.shape)
        fill(dx, 0.0, self.launch)
        return dx


class TunedDenseBlock(DenseBlock):
    """Dense (+ ReLU): stage 4's 2 + 4 launches, or 1 + 2 with ``fused`` (``kernels/dense_fused.py``),
    through the implicit GEMM when ``tiled`` (``kernels/dense_gemm.py``).

    ``mask_dx``: this block's input came out of a ReLU whose block expects dz ready-made, so
    dX is written already masked by x > 0. ``masked_from_above``: the block above does that
    for this block's ReLU, so no relu_backward is left to launch here.
    """

    def __init__(self, stage, index, relu, fused, tiled=False):
        super().__init__(stage, index, relu)
        self.fused, self.tiled = fused or tiled, tiled
        self.mask_dx, self.masked_from_above = False, False

    def tile(self, rows, cols):
        return self.stage.config.tile(rows, cols)

    def masks_own_relu(self) -> bool:
        return not self.masked_from_above

    def layer_forward(self, x, y):
        weights, bias = self.params["W"], self.params["b"]
        if self.tiled:
            dense_gemm.dense_forward(x, weights, bias, y, self.relu, self.launch)
        elif self.fused:
            dense_fused.dense_forward(x, weights, bias, y, self.relu, self.tile(*y.shape), self.launch)
        else:
            super().layer_forward(x, y)

    def layer_backward(self, dy, dx):
        if not self.fused:
            return super().layer_backward(dy, dx)
        weights, mask = self.params["W"], (self.x if self.mask_dx else None)
        if self.tiled:
            dense_gemm.dense_backward_params(dy, self.x, self.grads["W"], self.grads["b"], self.launch)
            if dx is not None:
                dense_gemm.dense_backward_data(dy, weights, dx, mask, self.launch)
            return
        dense_fused.dense_backward_params(dy, self.x, self.grads["W"], self.grads["b"], self.tile(*weights.shape),
                                          self.launch)
        if dx is not None:
            dense_fused.dense_backward_data(dy, weights, dx, self.tile(*dx.shape), mask, self.launch)


class DenseLossBlock(TunedDenseBlock):
    """The last Dense layer; ``forward_loss`` adds softmax, the loss and dL/dlogits in the same kernel."""

    def forward_loss(self, x, labels, dlogits, row_loss):
        self.x = x
        self.y = self.buffer("y", (x.shape[0], *self.out_shape))
        dense_softmax_xent(x, self.params["W"], self.params["b"], labels, self.y, dlogits, row_loss, self.launch)


def wire_masks(blocks) -> None:
    """Let each fused Dense block mask the dX it writes when the block below is a fused Dense + ReLU."""
    for lower, upper in zip(blocks, blocks[1:]):
        if (isinstance(lower, TunedDenseBlock) and lower.fused and lower.relu
                and isinstance(upper, TunedDenseBlock) and upper.fused):
            upper.mask_dx, lower.masked_from_above = True, True
