"""A tiny multi-rank script that tests/test_launch.py runs under ``sbpflow launch``.

Each rank all-reduces ``rank + 1`` over the world and prints one line::

    rank=R world=W local_rank=L threads=T sum=S

It exits 1 when the sum is not ``W * (W + 1) / 2``. ``--fail-rank R --exit-code C`` makes
rank ``R`` exit with code ``C`` after the collective (to test exit-code propagation).
"""

from __future__ import annotations

import argparse
import sys

import torch

import sbpflow.distributed as dist
from sbpflow.distributed import _comm


def main(argv: list[str] | None = None) -> int:
    """Run the check on this rank; return the process exit code."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--fail-rank", type=int, default=None)
    parser.add_argument("--exit-code", type=int, default=3)
    args = parser.parse_args(argv)

    rank, world, local_rank = dist.get_rank(), dist.get_world_size(), dist.get_local_rank()
    ranks = tuple(range(world))
    dist.ensure_groups([ranks])
    total = _comm.all_reduce(torch.tensor([float(rank + 1)]), ranks)
    s = int(total.item())
    # One write per line: torchrun runs python -u, where print() writes the text and the
    # newline separately, so lines of concurrent ranks could interleave.
    sys.stdout.write(f"rank={rank} world={world} local_rank={local_rank} "
                     f"threads={torch.get_num_threads()} sum={s}\n")
    sys.stdout.flush()
    dist.barrier()
    # Without this, gloo ranks of torch 2.13 may abort at interpreter exit
    # ("terminate called without an active exception", SIGABRT).
    dist.destroy()
    if s != world * (world + 1) // 2:
        print(f"rank={rank}: wrong sum {s}, expected {world * (world + 1) // 2}",
              file=sys.stderr, flush=True)
        return 1
    if args.fail_rank == rank:
        return args.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
