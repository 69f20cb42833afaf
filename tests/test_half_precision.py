"""Layout invariance in fp16/bf16 with large values (issue 10, item 6).

Where partial sums of half-precision values meet across ranks (a sum over a split dim, a
split-K matmul, P -> B / P -> S boxing, data-parallel gradient sums), sbpflow accumulates
in float32 and casts once, as torch accumulates on one device. The values here are chosen
so that fp16 partials overflow (|partial| > 65504) while the total is finite: without the
float32 path the result is inf/nan where one-process torch gives a number.
"""

from __future__ import annotations

import pytest

import sbpflow
from sbpflow.sbp import broadcast as B
from sbpflow.sbp import partial_sum as P
from sbpflow.sbp import split

LAYOUTS = {"S0": split(0), "S1": split(1), "B": B}


def _close(mine, ref, dtype) -> str | None:
    import torch

    got = torch.tensor(mine.tolist()).float()  # gathered in its own dtype
    want = ref.float()
    if not torch.isfinite(got).all() and torch.isfinite(want).all():
        return f"non-finite result {got.flatten()[:6].tolist()} where torch gives " \
               f"{want.flatten()[:6].tolist()}"
    # one rounding of the result to the half dtype, plus the operands' own rounding
    tol = 4 * float(torch.finfo(dtype).eps) * float(want.abs().max()) + 1e-3
    err = float((got - want).abs().max())
    return None if err <= tol else f"max error {err:.4g} > {tol:.4g}"


def _cases_body(dtype_name: str):
    import torch

    dtype = getattr(torch, dtype_name)
    pl = sbpflow.placement.all("cpu")
    n = pl.size
    problems = []
    # sum over dim 0 of columns [+6e4 ... , -6e4 ...]: every rank's partial is +-6e4 * k
    col = torch.tensor([6e4] * (2 * n) + [-6e4] * (2 * n))
    x = torch.stack([col, col.flip(0) * 0.5, col * 0.25], dim=1).to(dtype)   # (4n, 3)
    ref_sum = x.sum(0)  # torch: float32 accumulator, one rounding
    for lname, layout in LAYOUTS.items():
        g = sbpflow.tensor(x, placement=pl, sbp=layout)
        for what, mine, ref in (("sum(0)", g.sum(0), ref_sum), ("sum()", g.sum(), x.sum()),
                                ("mean(0)", g.mean(0), x.mean(0))):
            err = _close(mine, ref, dtype)
            if err:
                problems.append(f"{dtype_name} {what} of {lname}: {err}")
        # split-K matmul: (3, 4n) @ (4n, 2), K split
        w = torch.ones(4 * n, 2, dtype=dtype)
        w[:, 1] = 0.5
        gw = sbpflow.tensor(w, placement=pl, sbp=layout)
        xt = sbpflow.tensor(x.t().contiguous(), placement=pl,
                            sbp=split(1) if layout == split(0) else layout)
        err = _close(xt @ gw, x.t().float().matmul(w.float()).to(dtype), dtype)
        if err:
            problems.append(f"{dtype_name} matmul, K laid out {lname}: {err}")
    # P -> B boxing of a user's partial sums: the first half of the ranks hold +6e4, the
    # others -6e4 (total 0; on 4 ranks an fp16 ring sum passes through 1.2e5 = inf)
    r = sbpflow.distributed.get_rank()
    part = torch.full((4,), 6e4 if r < n // 2 else -6e4, dtype=dtype)
    total = torch.zeros(4)
    gp = sbpflow.Tensor(part, pl, (P,), torch.Size([4]))
    for dst in (B, split(0)):
        err = _close(gp.to_global(sbp=dst), total.to(dtype), dtype)
        if err:
            problems.append(f"{dtype_name} P -> {dst!r}: {err}")
    return problems


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_sums_across_ranks_match_one_process_torch(dist_run, world, dtype):
    results = dist_run(world, _cases_body, dtype)
    assert results[0] == [], "\n".join(results[0])
    assert all(r == results[0] for r in results)


def _grad_body():
    import torch

    pl = sbpflow.placement.all("cpu")
    # Data parallel, fp16 parameter: each rank's gradient of w is the sum of its rows of
    # x (+6e4 on the first half of the ranks, -6e4 on the others; total 0). Summed in
    # fp16, the 4-rank all-reduce passes through 1.2e5 = inf.
    n = pl.size
    xv = torch.full((2 * n, 1), 3e4, dtype=torch.float16)
    xv[n:] *= -1
    w = sbpflow.nn.Parameter(sbpflow.tensor(torch.ones(1, 1, dtype=torch.float16),
                                            placement=pl, sbp=B))
    x = sbpflow.tensor(xv, placement=pl, sbp=split(0))
    (x @ w).sum().backward()
    ref = xv.float().sum()  # d/dw sum(x w) = sum(x) = 0
    return float(w.grad.float().item()), float(ref)


def test_fp16_data_parallel_gradient_sum_does_not_overflow(dist_run):
    for got, want in dist_run(4, _grad_body):
        assert got == pytest.approx(want, abs=1e-3), (got, want)
