"""Memory of an nn.Graph step: activation checkpointing and ZeRO-3, measured.

1. **Activation checkpointing**: gpt-mini at sequence length 256 (batch 8 per rank, data
   parallel over the launch's ranks), one training graph without and one with every
   transformer block checkpointed. The measured figure is the peak resident memory (RSS,
   Linux ``VmHWM``, reset through ``/proc/self/clear_refs`` before the step) of one
   replayed step above the RSS before it, on rank 0; the program's own estimate (the
   peak of live intermediates, ``print(graph)``) is shown beside it.
2. **ZeRO-3**: the per-rank bytes of parameters + gradients + optimizer state (what each
   rank stores: ``sbpflow.graph.show.memory``) of the same model as a data-parallel
   graph and as a ZeRO-3 graph (``shard_min_size=1``), and their ratio against ``1/N``;
   then the step's peak of live intermediates (the program's estimate) at sequence
   length 32, batch 1 (parameters outweigh activations there) for DP, ZeRO-3 and
   ZeRO-3 with every gather started at the top of the step (no prefetch bound): ZeRO-3
   keeps a gathered parameter only while its module runs and gathers it again in
   backward.

Run (2 ranks, as the figures in README)::

    sbpflow launch --nproc-per-node 2 bench/graph_memory.py
"""

from __future__ import annotations

import gc

import torch

import sbpflow
from sbpflow import models
from sbpflow.graph import GraphModule, passes, show
from sbpflow.sbp import split

SEQ, BATCH = 256, 8


def _vm(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


class Step(sbpflow.nn.Graph):
    def __init__(self, model, opt, pl):
        super().__init__()
        self.model, self.pl = model, pl
        self.add_optimizer(opt)

    def build(self, x, y):
        with sbpflow.default_placement(self.pl):
            loss = self.model(x, y)[1]
        loss.backward()
        return loss


def _graph(ckpt: bool = False, zero: int = 0):
    spec = models.get("gpt-mini")
    sbpflow.manual_seed(0)
    model = spec.build(block_size=SEQ)
    pl = sbpflow.placement.all("cpu")
    model.to_global(pl)
    opt = sbpflow.optim.AdamW(model.parameters(), lr=1e-3)
    g = Step(model, opt, pl)
    if ckpt:
        for blk in model.transformer.h:
            blk.to(GraphModule).activation_checkpointing = True
    if zero:
        g.config.enable_zero(True, stage=zero, shard_min_size=1)
    n = pl.size
    x = torch.randint(0, spec.config.vocab_size, (BATCH * n, SEQ),
                      generator=torch.Generator().manual_seed(0))
    xs = sbpflow.tensor(x, placement=pl, sbp=split(0))
    return g, xs


def _peak_of_step(g, xs) -> tuple[int, int]:
    g(xs, xs)  # traced
    g(xs, xs)  # replayed once (allocator warm)
    gc.collect()
    before = _vm("VmRSS")
    _reset_peak()
    g(xs, xs).item()
    return _vm("VmHWM") - before, show.peak_live_bytes(next(iter(g._programs.values())).gm)


def _return_freed_memory() -> None:
    """glibc: serve every allocation above 128 KiB by mmap and give freed memory back at
    once (fixed thresholds), so that RSS follows the live tensors and its high-water mark
    measures the peak (by default glibc keeps freed blocks and raises its thresholds)."""
    import ctypes

    libc = ctypes.CDLL("libc.so.6")
    m_trim_threshold, m_mmap_threshold = -1, -3
    libc.mallopt(m_mmap_threshold, 128 * 1024)
    libc.mallopt(m_trim_threshold, 128 * 1024)


def main() -> None:
    _return_freed_memory()
    torch.set_num_threads(1)
    rank, n = sbpflow.distributed.get_rank(), sbpflow.distributed.get_world_size()
    seq, batch = SEQ, BATCH
    g, xs = _graph()
    plain, plain_est = _peak_of_step(g, xs)
    dp_mem = show.memory(g, next(iter(g._programs.values())))
    del g
    gc.collect()
    g, xs = _graph(ckpt=True)
    ckpt, ckpt_est = _peak_of_step(g, xs)
    del g
    gc.collect()
    g, xs = _graph(zero=3)
    g(xs, xs)
    z_mem = show.memory(g, next(iter(g._programs.values())))
    del g
    gc.collect()
    global SEQ, BATCH
    SEQ, BATCH = 32, 1
    small = {}
    for name, zero, depth in (("DP", 0, None), ("ZeRO-3", 3, None),
                              ("ZeRO-3, gathers unbounded", 3, 10 ** 6)):
        if depth is not None:
            passes.GATHERS_IN_FLIGHT, keep = depth, passes.GATHERS_IN_FLIGHT
        g, xs = _graph(zero=zero)
        g(xs, xs)
        small[name] = show.peak_live_bytes(next(iter(g._programs.values())).gm)
        if depth is not None:
            passes.GATHERS_IN_FLIGHT = keep
        del g
        gc.collect()
    if rank == 0:
        mib = 2.0 ** 20
        print(f"graph memory bench: gpt-mini, seq {seq}, batch {batch}/rank, {n} rank(s), "
              f"torch {torch.__version__}")
        print(f"  activation checkpointing: step peak RSS above the step's start "
              f"{plain / mib:.1f} MiB -> {ckpt / mib:.1f} MiB "
              f"({100 * (1 - ckpt / plain):.0f}% lower; goal >= 30%); program estimate "
              f"{plain_est / mib:.1f} -> {ckpt_est / mib:.1f} MiB")
        state = ("params", "grads", "optimizer")
        dp, z = sum(dp_mem[k] for k in state), sum(z_mem[k] for k in state)
        print(f"  ZeRO-3: per-rank parameters+gradients+optimizer {dp / mib:.2f} MiB (DP) -> "
              f"{z / mib:.2f} MiB (ZeRO-3) = {z / dp:.3f} of DP (1/N = {1 / n:.3f}; "
              f"goal within 5%: {abs(z / dp * n - 1) * 100:.1f}% off)")
        print("  step peak of live intermediates at seq 32, batch 1 (program estimate): "
              + ", ".join(f"{k} {v / mib:.2f} MiB" for k, v in small.items()))


if __name__ == "__main__":
    main()
