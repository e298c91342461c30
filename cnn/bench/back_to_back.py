"""Steps back to back: N training steps queued with ONE synchronisation at the end, as training runs them.

The phase breakdown (``step_timing``) synchronises around every phase, so that each can be
timed; that costs a GPU stage the overlap of host and device work, and every phase pays a wait.
This module times what a training run sees instead — the same figure for every row:

- a stage: ``load_dataset`` once, ``begin_epoch``, then ``run_steps`` in requests of the stage's
  ``steps_per_sync`` (exactly as ``cnn.train`` asks), N steps, one ``synchronize()`` at the end.
  A CPU stage fetches each loss anyway (its run_steps is a train_step a step); stage 7 with
  ``device-epoch`` waits once a request, with ``cuda-graph`` each step is one graph launch.
- PyTorch, eager: forward, loss, backward and ``optimizer.step()`` for N steps on batches already
  on the device, no ``.item()``, one ``synchronize()``.
- PyTorch, graphed (CUDA only): the whole step captured once with ``torch.cuda.graph`` (static
  input tensors, SGD included, as in PyTorch's whole-network capture example) and replayed N times.

The time a step is the median over ``repeats`` runs of N steps, divided by N, after a warm-up run.
"""

from __future__ import annotations

import time

import numpy as np

from cnn.bench.measure import summarize


def timed_runs(run, synchronize, steps: int, repeats: int) -> dict:
    """stats (ms a step) of ``repeats`` calls of ``run(steps)``, each ending in ``synchronize()``, after a warm-up call."""
    run(steps)
    synchronize()
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        run(steps)
        synchronize()
        samples.append((time.perf_counter() - started) * 1e3 / steps)
    return summarize(samples)


class EpochLoop:
    """``loop(n)``: n more training steps of a stage through its epoch API, over the given batches in turn."""

    def __init__(self, stage, batches, hyper, steps_per_epoch: int):
        lr, self.momentum, self.weight_decay = hyper
        images = np.concatenate([images for images, _ in batches])
        labels = np.concatenate([labels for _, labels in batches])
        self.stage, self.batch_size = stage, len(batches[0][1])
        stage.load_dataset(images, labels)
        passes = -(-steps_per_epoch * self.batch_size // len(images))
        self.order = np.tile(np.arange(len(images)), passes)[:steps_per_epoch * self.batch_size]
        self.lrs = np.full(steps_per_epoch, lr)
        self.next_step = steps_per_epoch

    def __call__(self, n: int) -> np.ndarray:
        losses = []
        while n > 0:
            if self.next_step == len(self.lrs):
                self.stage.begin_epoch(self.order, self.lrs, self.batch_size, self.momentum, self.weight_decay)
                self.next_step = 0
            count = min(n, self.stage.steps_per_sync, len(self.lrs) - self.next_step)
            losses.append(self.stage.run_steps(self.next_step, count))
            self.next_step, n = self.next_step + count, n - count
        return np.concatenate(losses)


def stage_back_to_back(stage, batches, hyper, steps: int = 50, repeats: int = 5) -> dict:
    """ms a step of ``steps`` steps run as the trainer runs them, one wait at the end (stats)."""
    loop = EpochLoop(stage, batches, hyper, steps_per_epoch=steps)
    return {"back_to_back_ms": timed_runs(loop, stage.synchronize, steps, repeats), "back_to_back_steps": steps}


def torch_back_to_back(runner, batches, hyper, steps: int = 50, repeats: int = 5) -> dict:
    """PyTorch's step back to back, eager and (on CUDA) as one captured graph (stats, ms a step)."""
    torch = runner.torch
    runner.loss = None                  # the phase timing's last autograd graph: alive, it would break capture
    on_device = [(torch.from_numpy(np.ascontiguousarray(x)).to(runner.device),
                  torch.from_numpy(np.asarray(y, dtype=np.int64)).to(runner.device)) for x, y in batches]
    model, optimizer = runner.model, runner.optimizer
    for group in optimizer.param_groups:
        group.update(lr=hyper[0], momentum=hyper[1], weight_decay=hyper[2])

    def eager(n):
        for step in range(n):
            x, y = on_device[step % len(on_device)]
            optimizer.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()

    result = {"back_to_back_ms": timed_runs(eager, runner.synchronize, steps, repeats), "back_to_back_steps": steps}
    if runner.device == "cuda":
        try:
            result["graph_ms"] = timed_runs(torch_graphed_step(torch, model, optimizer, *on_device[0]),
                                             runner.synchronize, steps, repeats)
        except Exception as err:        # a capture PyTorch refuses must not cost the row its other figures
            result["graph_error"] = f"{type(err).__name__}: {str(err).splitlines()[0]}"
    return result


def torch_graphed_step(torch, model, optimizer, x, y):
    """``replay(n)``: n replays of one training step captured as a CUDA graph (PyTorch's whole-network capture)."""
    static_x, static_y = x.clone(), y.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):                  # warm-up on a side stream, as torch.cuda.graph requires
        for _ in range(3):
            optimizer.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(model(static_x), static_y).backward()
            optimizer.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    optimizer.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        torch.nn.functional.cross_entropy(model(static_x), static_y).backward()
        optimizer.step()

    def replay(n):
        for _ in range(n):
            graph.replay()
    return replay
