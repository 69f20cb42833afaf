"""Dispatch overhead per op: sbpflow (local and global tensors) vs calling torch directly.

A chain of 200 small ops (add, mul by a tensor, relu, scalar mul; 4x4 fp32, no grad) is
timed on torch tensors, on sbpflow local tensors, and on sbpflow global tensors laid out
S(0) over the launch's ranks (signatures cached after the first pass), and as an
``nn.Graph`` over the global tensors (the chain traced once, then replayed as each rank's
torch.fx program). Prints us/op and the overhead over torch. Goals: <= 10 us/op local,
<= 30 us/op global (issue 3); <= 2 us/op left in a graph (issue 11).

Run::

    python bench/dispatch_bench.py                                  # 1 rank
    sbpflow launch --nproc-per-node 2 bench/dispatch_bench.py       # global on 2 ranks
"""

from __future__ import annotations

import statistics
import time

import torch

import sbpflow
from sbpflow.sbp import split

N_OPS = 200


def chain(x, w):
    y = x
    for _ in range(N_OPS // 4):
        y = ((y + w) * w).relu() * 0.5
    return y


def per_op_us(fn, reps: int = 30) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) / N_OPS * 1e6


class ChainGraph(sbpflow.nn.Graph):
    """The chain as a graph (evaluation graph: no optimizer)."""

    def build(self, x, w):
        return chain(x, w)


def main() -> None:
    torch.set_num_threads(1)
    rank = sbpflow.distributed.get_rank()
    pl = sbpflow.placement.all("cpu")
    xt, wt = torch.ones(4, 4), torch.full((4, 4), 0.5)
    xl, wl = sbpflow.from_torch(xt), sbpflow.from_torch(wt)
    xg = sbpflow.tensor(xt, placement=pl, sbp=split(0))
    wg = sbpflow.tensor(wt, placement=pl, sbp=split(0))
    with torch.no_grad():
        t = per_op_us(lambda: chain(xt, wt))
        loc = per_op_us(lambda: chain(xl, wl))
        glo = per_op_us(lambda: chain(xg, wg))
        graph = ChainGraph()
        gra = per_op_us(lambda: graph(xg, wg))
        program = next(iter(graph._programs.values()))
        flat = [xg.to_local().to_torch(), wg.to_local().to_torch()]
        rep = per_op_us(lambda: program.fn(*flat))  # the per-rank program alone
    if rank == 0:
        print(f"dispatch bench: {N_OPS}-op chain, 4x4 fp32, {pl.size} rank(s), torch "
              f"{torch.__version__}")
        print(f"  torch          {t:7.2f} us/op")
        print(f"  sbpflow local  {loc:7.2f} us/op  (+{loc - t:.2f} over torch; goal <= 10)")
        print(f"  sbpflow global {glo:7.2f} us/op  (+{glo - t:.2f} over torch; goal <= 30)")
        print(f"  sbpflow graph  {rep:7.2f} us/op  (+{rep - t:.2f} over torch; goal <= 2: the "
              f"replayed program)")
        print(f"  graph call     {gra:7.2f} us/op  (+{(gra - rep) * N_OPS:.0f} us per call over "
              f"the program: the cache lookup and the ranks' agreement check, which waits "
              f"for the slowest rank)")


if __name__ == "__main__":
    main()
