"""Boxing overhead: sbpflow layout changes vs the raw torch.distributed collective.

For a 16 MB fp32 tensor (2048 x 2048) on the ranks of the launch, times

===============  =====================================  ================================
sbpflow          ``x.to_global(sbp=...)``               raw torch.distributed, same data
===============  =====================================  ================================
P -> B           all-reduce (out of place)              ``all_reduce`` (in place)
P -> S(0)        reduce-scatter                         ``reduce_scatter_tensor``
S(0) -> B        all-gather                             ``all_gather_into_tensor``
S(0) -> S(1)     all-to-all (+ packing of dim 1 parts)  ``all_to_all_single`` (contiguous)
===============  =====================================  ================================

and prints the median time of each and the ratio sbpflow / raw (goal <= 1.1). The two
are interleaved rep by rep so machine noise hits both alike. Two changes do a memory
pass the raw call does not: P -> B is out of place (the P input stays valid, so its
buffer is copied before the in-place all-reduce), and S(0) -> S(1) packs the strided
dim-1 blocks into one send buffer (the raw call sends contiguous row blocks, which is
not the same data movement). The ``copy ms`` column times that local pass alone and
``vs raw+copy`` divides by raw + copy. Not a test.

Run (2 ranks on one machine)::

    sbpflow launch --nproc-per-node 2 bench/boxing_bench.py [--reps 20] [--mb 16] [--cuda]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import sbpflow
from sbpflow.sbp import broadcast as B
from sbpflow.sbp import partial_sum as P
from sbpflow.sbp import split

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()
    dist.barrier()


def _timed(fn, device) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=20, help="timed repetitions per case")
    ap.add_argument("--mb", type=float, default=16, help="tensor size in MB (fp32)")
    ap.add_argument("--cuda", action="store_true", help="cuda placement (NCCL)")
    args = ap.parse_args()
    sbpflow.distributed.init(debug=False)
    n = sbpflow.distributed.get_world_size()
    rank = sbpflow.distributed.get_rank()
    if n < 2:
        raise SystemExit("run on 2+ ranks: sbpflow launch --nproc-per-node 2 bench/boxing_bench.py")
    pl = sbpflow.placement.all("cuda" if args.cuda else "cpu")
    device = pl.device
    side = int((args.mb * 2**20 / 4) ** 0.5) // n * n
    shape = (side, side)

    full = sbpflow.randn(*shape, placement=pl, sbp=B)
    x_p = full.to_global(sbp=P)
    x_s0 = full.to_global(sbp=split(0))
    loc_full = full.to_local().to_torch().contiguous()
    loc_s0 = x_s0.to_local().to_torch().contiguous()
    out_rs = torch.empty_like(loc_s0)
    out_ag = torch.empty_like(loc_full)
    out_a2a = torch.empty_like(loc_s0)
    buf = loc_full.clone()

    cols = loc_s0.shape[1] // n
    cases = [
        ("P -> B", lambda: x_p.to_global(sbp=B), "all_reduce", lambda: dist.all_reduce(buf),
         lambda: loc_full.clone()),
        ("P -> S(0)", lambda: x_p.to_global(sbp=split(0)), "reduce_scatter",
         lambda: _reduce_scatter(out_rs, loc_full), None),
        ("S(0) -> B", lambda: x_s0.to_global(sbp=B), "all_gather",
         lambda: _all_gather(out_ag, loc_s0), None),
        ("S(0) -> S(1)", lambda: x_s0.to_global(sbp=split(1)), "all_to_all",
         lambda: dist.all_to_all_single(out_a2a, loc_s0),
         lambda: loc_s0.unflatten(1, (n, cols)).movedim(1, 0).contiguous()),
    ]
    if rank == 0:
        print(f"boxing bench: {shape} fp32 ({loc_full.nbytes / 2**20:.1f} MiB) on {n} ranks, "
              f"{pl.type}/{'nccl' if args.cuda else 'gloo'}, {args.reps} reps, torch "
              f"{torch.__version__}")
        print(f"{'layout change':<14}{'sbpflow ms':>12}{'raw':>16}{'raw ms':>10}{'ratio':>8}"
              f"{'copy ms':>10}{'vs raw+copy':>13}")
    with torch.no_grad():
        for name, ours, raw_name, raw, copy in cases:
            ours()
            raw()  # warm up both (plans, groups, buffers)
            t_ours, t_raw, t_copy = [], [], []
            for _ in range(args.reps):
                t_ours.append(_timed(ours, device))
                t_raw.append(_timed(raw, device))
                if copy is not None:
                    t_copy.append(_timed(copy, device))
            a, b = statistics.median(t_ours) * 1e3, statistics.median(t_raw) * 1e3
            c = statistics.median(t_copy) * 1e3 if t_copy else 0.0
            if rank == 0:
                extra = f"{c:>10.2f}{a / (b + c):>13.2f}" if t_copy else f"{'-':>10}{'-':>13}"
                print(f"{name:<14}{a:>12.2f}{raw_name:>16}{b:>10.2f}{a / b:>8.2f}{extra}",
                      flush=True)


if __name__ == "__main__":
    main()
