"""Stage 8 ``cuda-fused-net``: the whole training step in three kernels (DOCSTRING IN PROGRESS)."""

from __future__ import annotations

import numpy as np

from cnn.model import Conv, Dense, Flatten, MaxPool, ReLU
from cnn.stages.base import Stage
from cnn.stages.device_epoch import DeviceEpoch, resident_set
from cnn.stages.s4_cuda import INDEX, CudaStage
from cnn.stages.s7_cuda_tuned import SYNC_EVERY
from kernels.device import cuda, simulated
from kernels.device_epoch import finish_step, sum_scores
from kernels.fused_net_step import THREADS, fused_net_scores, fused_net_step, shared_memory_limit
from kernels.fused_net_sum_sgd import sum_partials, sum_sgd
from kernels.fused_net_table import WORD, TableBuilder
from kernels.launch_config import multiprocessors
from kernels.sgd import sgd_momentum
from kernels.streams import StreamLaunchCounter

BLOCKS_PER_SM = 2             # samples a block grow only once the batch gives every SM this many blocks


def layer_table(net) -> TableBuilder:
    """The network as fused operations (``kernels/fused_net_table.py``), the parameter offsets from its layout."""
    builder = TableBuilder(net.input_shape)
    offsets = {slot.layer: slot.offset for slot in net.param_layout() if slot.name == "W"}
    for index, layer in enumerate(net.layers):
        if isinstance(layer, Conv):
            builder.conv(layer.out_channels, layer.kernel, layer.stride, layer.pad, offsets[index])
        elif isinstance(layer, ReLU):
            builder.relu()
        elif isinstance(layer, MaxPool):
            builder.pool(layer.size, layer.stride)
        elif isinstance(layer, Flatten):
            builder.flatten()
        elif isinstance(layer, Dense):
            builder.dense(layer.out_features, offsets[index])
        else:
            raise TypeError(f"stage 'cuda-fused-net': unknown layer {layer!r}")
    return builder


class CudaFusedNetStage(CudaStage):
    name = "cuda-fused-net"
    summary = ("Numba CUDA: a group of samples' whole forward, loss and backward in ONE kernel (every activation "
               "in shared memory), the gradient summed in a fixed order + SGD in a second: 3 kernels, one graph")

    def __init__(self, net, dtype=np.float32, samples_per_block: int | None = None, threads: int = THREADS,
                 poison: bool | None = None, graphs: bool = True):
        self.builder = layer_table(net)
        self.samples_per_block, self.threads = samples_per_block, threads
        self.poison = simulated() if poison is None else poison
        self.tables = {}                      # samples a block -> Plan with its table on the device
        super().__init__(net, dtype)
        self.shared_limit = shared_memory_limit()
        if samples_per_block is not None and samples_per_block < 1:
            raise ValueError(f"stage {self.name!r}: samples_per_block must be at least 1, got {samples_per_block}")
        self.table_for(samples_per_block or 1)                 # a network that cannot be fused fails here
        self.d_zero = cuda.to_device(np.zeros(1, INDEX))       # position 0: a batch that starts at row 0
        self.d_no_lrs = cuda.to_device(np.zeros(1, np.float32))
        self.identities, self.zero_labels = {}, {}     # count -> order 0, 1, …, count − 1 / labels 0 on the device
        self.d_train = self.d_test = None
        self.steps_per_sync = SYNC_EVERY
        self.epoch_state = DeviceEpoch(self.stream, 1, self.queue_device_step, use_graphs=graphs)

    def make_launcher(self):
        self.stream = cuda.stream()
        return StreamLaunchCounter(self.stream)

    def build_blocks(self):
        return []                             # no blocks: the whole network is one table

    # -- the layer table for a batch size --------------------------------------------------------
    def samples_for(self, batch: int) -> int:
        """Samples a block: as given, else one — more only when the batch gives every SM BLOCKS_PER_SM blocks
        anyway (fewer partial rows to add up) and they fit in shared memory."""
        if self.samples_per_block is not None:
            return self.samples_per_block
        fit = self.shared_limit // (WORD * sum(self.builder.words_per_sample().values()))
        return max(1, min(fit, -(-batch // (BLOCKS_PER_SM * multiprocessors()))))

    def table_for(self, samples: int):
        if samples not in self.tables:
            try:
                plan = self.builder.plan(samples, self.shared_limit, self.poison)
            except ValueError as err:
                raise ValueError(f"stage {self.name!r}: network {self.net.name!r} cannot be fused: {err}") from None
            self.tables[samples] = plan._replace(table=cuda.to_device(plan.table))
        return self.tables[samples]

    def identity(self, count: int):
        if count not in self.identities:
            self.identities[count] = cuda.to_device(np.arange(count, dtype=INDEX))
        return self.identities[count]

    def no_labels(self, count: int):
        if count not in self.zero_labels:
            self.zero_labels[count] = cuda.to_device(np.zeros(count, dtype=INDEX))
        return self.zero_labels[count]

    # -- one training step: the fused kernel, the sum, the update ----------------------------------
    def queue_fused_step(self, images, labels, order, position, batch: int) -> None:
        """Kernel 1 on the batch order[position·B …] of the (N, D) ``images``: row losses and partial sums."""
        plan = self.table_for(self.samples_for(batch))
        groups = -(-batch // plan.samples)
        self.d_partials = self.buffers.get("partials", (groups, self.net.num_params))
        self.d_row_loss = self.buffers.get("row-loss", (batch,))
        fused_net_step(plan, self.d_params, images, labels, order, position, batch, self.d_partials,
                       self.d_row_loss, self.threads, self.launch)

    def forward(self):
        """Kernel 1: forward, loss AND backward (they are one kernel); the gradient waits in the partials."""
        batch = self.d_images.shape[0]
        images = self.d_images.reshape((batch, self.d_images.size // batch))
        self.queue_fused_step(images, self.d_labels, self.identity(batch), self.d_zero, batch)

    def backward(self):
        """Kernel 2 without its update: the partial sums added into the flat gradient."""
        sum_partials(self.d_partials, self.d_grad, self.d_params, self.d_velocity, self.d_no_lrs, self.d_zero,
                     self.launch)

    def update(self, lr, momentum, weight_decay):
        sgd_momentum(self.d_params, self.d_velocity, self.d_grad, lr, momentum, weight_decay, self.launch)
        self.count_step_launches()

    def fetch_loss(self):
        rows = self.d_row_loss.copy_to_host(stream=self.stream)
        self.stream.synchronize()
        return float(rows.sum(dtype=np.float64) / len(rows))

    def predict(self, images):
        d_images = self._images(images, "predict-images")
        count = d_images.shape[0]
        logits = self.scores(d_images.reshape((count, d_images.size // count)), self.no_labels(count), count)
        return logits.copy_to_host(stream=self.stream)

    def scores(self, images, labels, count):
        """Kernel 1 in evaluation: logits, loss and right-or-wrong of samples 0 … count − 1; the logits."""
        logits = self.buffers.get("logits", (count, self.net.num_classes))
        self.d_scored_loss = self.buffers.get("scored-loss", (count,))
        self.d_correct = self.buffers.get("correct", (count,))
        fused_net_scores(self.table_for(self.samples_for(count)), self.d_params, images, labels, self.identity(count),
                         self.d_zero, count, logits, self.d_scored_loss, self.d_correct, self.threads, self.launch)
        return logits

    # -- an epoch on the device -----------------------------------------------------------------------
    def load_dataset(self, train_images, train_labels, test_images=None, test_labels=None):
        Stage.load_dataset(self, train_images, train_labels, test_images, test_labels)
        images, self.d_train_labels = resident_set(self, train_images, train_labels, "training")
        self.d_train = images.reshape((len(images), images.size // max(1, len(images))))
        if test_images is not None:
            images, self.d_test_labels = resident_set(self, test_images, test_labels, "test")
            self.d_test = images.reshape((len(images), images.size // max(1, len(images))))
            self.d_totals, self.host_totals = cuda.device_array(2, np.float64), cuda.pinned_array(2, np.float64)
        self.epoch_state.drop_graphs()                     # the graphs read the old training set

    def begin_epoch(self, order, lrs, batch_size, momentum, weight_decay):
        super().begin_epoch(order, lrs, batch_size, momentum, weight_decay)
        self.epoch_state.begin(self.plan)

    def run_steps(self, first, count):
        if self.d_train is None:
            raise RuntimeError(f"stage {self.name!r}: run_steps needs the data on the device; call load_dataset first")
        return self.epoch_state.run(first, count)

    def queue_device_step(self, slot: int) -> None:
        """The step the graph records: kernel 1 on the batch at the step counter, kernel 2 (sum + SGD at
        lrs[counter]), then stage 7's finish_step (the mean loss logged, the counter advanced)."""
        epoch, plan = self.epoch_state, self.plan
        self._step_start = self.launch.count
        self.queue_fused_step(self.d_train, self.d_train_labels, epoch.order, epoch.counter, plan.batch_size)
        sum_sgd(self.d_partials, self.d_grad, self.d_params, self.d_velocity, epoch.lrs, epoch.counter,
                plan.momentum, plan.weight_decay, self.launch)
        finish_step(self.d_row_loss, epoch.counter, epoch.loss_log, epoch.first_bad, self.launch)
        self.count_step_launches()

    def launches_per_step(self) -> int:
        """Kernels the host queued for the last step; 1 once steps are replayed as a CUDA graph."""
        return 1 if self.epoch_state.graphs else super().launches_per_step()

    def test_scores(self, count=None):
        """The test set scored on the device in one launch, then added up in a fixed order: two numbers back."""
        if self.d_test is None:
            return super().test_scores(count)
        count = len(self.d_test) if count is None else min(count, len(self.d_test))
        self.scores(self.d_test, self.d_test_labels, count)
        sum_scores(self.d_correct, self.d_scored_loss, count, self.d_totals, self.launch)
        self.d_totals.copy_to_host(self.host_totals, stream=self.stream)
        self.stream.synchronize()
        return int(round(self.host_totals[0])), float(self.host_totals[1])
