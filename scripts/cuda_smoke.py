"""One-rank CUDA smoke check: cuda placements, NCCL-backed boxing, cpu <-> cuda moves.

Run on a machine with a GPU (no launcher needed: a plain process is a world of 1)::

    python scripts/cuda_smoke.py

Prints each check and exits non-zero on the first failure. CI never runs it.
"""

from __future__ import annotations

import itertools
import sys

import numpy as np
import torch

import sbpflow
from sbpflow.distributed import CommRecorder
from sbpflow.sbp import broadcast as B
from sbpflow.sbp import partial_sum as P
from sbpflow.sbp import split


def check(name: str, ok: bool) -> None:
    print(f"{'ok  ' if ok else 'FAIL'} {name}", flush=True)
    if not ok:
        sys.exit(1)


def main() -> None:
    if not torch.cuda.is_available():
        print("skipped: no CUDA device here (this script checks the cuda paths on a GPU "
              "machine)")
        return
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}, "
          f"backend {sbpflow.distributed.default_backend()}")
    gpu = sbpflow.placement("cuda", [0])
    cpu = sbpflow.placement("cpu", [0])
    torch.manual_seed(0)
    full = torch.randn(7, 5)
    for src, dst in itertools.product([split(0), split(1), B, P], repeat=2):
        x = sbpflow.tensor(full, placement=gpu, sbp=src, requires_grad=True)
        y = x.to_global(sbp=dst)
        y.backward(sbpflow.ones(7, 5, placement=gpu, sbp=dst))
        check(f"cuda {src!r} -> {dst!r}: value, device, grad",
              np.allclose(y.numpy(), full.numpy()) and y.device.type == "cuda"
              and np.allclose(x.grad.numpy(), 1.0))
    for a, b in [(cpu, gpu), (gpu, cpu)]:
        x = sbpflow.tensor(full, placement=a, sbp=split(0), requires_grad=True)
        with CommRecorder() as rec:
            y = x.to_global(b, B)
        y.backward(sbpflow.tensor(2 * torch.ones(7, 5), placement=b, sbp=B))
        check(f"{a.type} -> {b.type}: device {y.device}, {rec.kinds() or 'no comm'}, grad on "
              f"{x.grad.device}",
              y.device.type == b.type and x.grad.device.type == a.type
              and np.allclose(y.numpy(), full.numpy()) and np.allclose(x.grad.numpy(), 2.0))
    sbpflow.manual_seed(3)
    r = sbpflow.randn(4, 4, placement=gpu, sbp=split(0))
    torch.manual_seed(3)
    check("randn on cuda matches torch.randn on cuda",
          np.array_equal(r.numpy(), torch.randn(4, 4, device="cuda").cpu().numpy()))
    print("cuda smoke: all ok")


if __name__ == "__main__":
    main()
