"""Layout invariance in fp16/bf16 with large values (issue 10, item 6).

Where partial sums of half-precision values meet across ranks (a sum over a split dim, a
split-K matmul, P -> B / P -> S boxing, data-parallel gradient sums), sbpflow accumulates
in float32 and casts once, as torch accumulates on one device. The values here are chosen
so that fp16 partials overflow (|partial| > 65504) while the total is finite: without the
float32 path the result is inf/nan where one-process torch gives a number.

The second half (issue 20, item 3) sweeps every registered global algorithm and the
reductions composed of them (norm, var/std, normalize, softmax, cross entropy, cumsum...)
in fp16 and bf16 on 1 and 2 ranks (4 too in the exhaustive run: ``pytest -m exhaustive``).
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


# =============================================================================================
# Every global algorithm in fp16 and bf16 (issue 20, item 3). A reduction or scan whose global
# form combines per-shard results (the algorithms of the op registry, and the compositions
# built on them: norm, var/std, normalize, logsumexp, cross entropy, ...) must accumulate as
# torch's kernel does on one process: in float32 for fp16/bf16, the result rounded once to
# the input dtype. The inputs are traps for a half-precision accumulator:
#
# * ``squares``: |x| about 300 (fp16; bf16: about 2**60): squares overflow fp16;
# * ``offset``: a large mean and a small spread (2048 + 2k in fp16, 256 + 2k in bf16): the
#   mean is not representable, so a two-pass variance in half precision is off by a lot;
# * ``cancel``: along dim 1 (length 8) a first half of large positives and a second half of
#   large negatives, total small: fp16 half-sums overflow (~1.2e5); bf16 half-sums are odd
#   numbers near 800, which bf16 cannot hold (rounded twice, the total is off by ~1);
# * ``wide``: 70000 classes of near-equal logits: a softmax's sum of exponentials overflows
#   fp16 when the per-shard sums are added in fp16;
# * ``distinct``: distinct values spread over the dtype's range (no ties: indices agree);
# * ``mild``: values in [0.5, 2] (products; torch's prod accumulates in the input dtype).
#
# The registered global algorithms are enumerated from the registry: a case list that does
# not reach one of them fails, naming it (see test_every_global_algorithm_is_swept).

def _half_kind(kind: str, shape, dtype, g):
    """A tensor of ``kind`` (see above), exactly representable in ``dtype``."""
    import torch

    fp16 = dtype == torch.float16
    n = 1
    for s in shape:
        n *= s
    if kind == "squares":
        sign = torch.randint(0, 2, shape, generator=g) * 2 - 1
        mag = torch.rand(shape, generator=g)
        v = sign * ((mag * 100 + 250) if fp16 else (mag + 1) * 2.0 ** 60)
    elif kind == "offset":
        v = (2048.0 if fp16 else 256.0) + 2 * torch.randint(0, 4, shape, generator=g)
    elif kind == "cancel":
        rows, width = shape
        h = width // 2
        if fp16:  # multiples of 16 near 3e4 (exact in fp16)
            pos = 30000 - 16 * torch.randint(0, 8, (rows, h), generator=g)
            neg = -(30000 - 16 * torch.randint(0, 8, (rows, h), generator=g))
        else:  # bf16: even numbers near 256 (exact), one small odd (pos) / even (neg) each
            pos = 256 + 2 * torch.randint(0, 8, (rows, h), generator=g)
            neg = -(256 + 2 * torch.randint(0, 8, (rows, h), generator=g))
            pos[:, -1] = 2 * torch.randint(0, 4, (rows,), generator=g) + 1
            neg[:, -1] = -2 * torch.randint(0, 4, (rows,), generator=g)
        v = torch.cat([pos, neg], dim=1).float()
    elif kind == "wide":
        v = torch.randint(0, 4, shape, generator=g) / 1024.0
    elif kind == "distinct":
        if n > (1024 if fp16 else 256):
            raise ValueError(f"distinct: {n} elements are too many for {dtype}")
        k = torch.randperm(n, generator=g).reshape(shape) - n // 2
        v = k * (64.0 if fp16 else 2.0 ** 100)
    elif kind == "mild":
        v = torch.rand(shape, generator=g) * 1.5 + 0.5
    elif kind == "const300":
        v = torch.full(shape, 300.0 if fp16 else 2.0 ** 70)
    else:
        raise ValueError(kind)
    return v.float().to(dtype)


def _hin(kind, shape, *layouts):
    """A half-precision input of ``kind`` tried in ``layouts`` (1-D SBPs)."""
    return ("half", kind, tuple(shape), layouts)


def _hints(shape, high, *layouts):
    """An int64 input in [0, high) tried in ``layouts``."""
    return ("int", high, tuple(shape), layouts)


def _hf(x):
    """``sbpflow.nn.functional`` or ``torch.nn.functional``, as fits ``x``."""
    import torch

    return sbpflow.nn.functional if isinstance(x, sbpflow.Tensor) else torch.nn.functional


def _hlib(x):
    import torch

    return sbpflow if isinstance(x, sbpflow.Tensor) else torch


def _dropout_seeded(x):
    import torch

    torch.manual_seed(20)
    return _hf(x).dropout(x, 0.25)


_SPB = (split(0), split(1), B, P)   # every 1-D layout of a 2-D float input
_SB = (split(0), split(1), B)

# name -> (fn, inputs, tolerance factor k: |got - want| <= k eps |want| (+ a floor)[, oracle])
# The oracle is torch on one process in the half dtype; "float32": torch in float32, the
# result rounded to the half dtype once (where torch's CPU kernel does not accumulate in
# float itself).
HALF_CASES = {
    # sums (the partial-sum kernels' fp32 path) and the scans
    "sum_dim": (lambda x: x.sum(1), [_hin("cancel", (3, 8), *_SPB)], 4),
    "sum_all": (lambda x: x.sum(), [_hin("cancel", (3, 8), *_SPB)], 4),
    "mean_dim": (lambda x: x.mean(1), [_hin("cancel", (3, 8), *_SPB)], 4),
    "nansum_dim": (lambda x: x.nansum(1), [_hin("cancel", (3, 8), *_SB)], 4),
    "nanmean_dim": (lambda x: x.nanmean(1), [_hin("cancel", (3, 8), *_SB)], 4),
    "matmul_split_k": (lambda x, w: x @ w, [_hin("cancel", (3, 8), split(1), B, P),
                                            _hin("mild", (8, 2), split(0), B)], 4),
    "cumsum": (lambda x: x.cumsum(1), [_hin("cancel", (3, 8), *_SPB)], 4),
    "cumsum_inplace": (lambda x: x.clone().cumsum_(1), [_hin("cancel", (3, 8), split(1))], 4),
    "cumprod": (lambda x: x.cumprod(1), [_hin("mild", (3, 8), *_SB)], 8),
    "logcumsumexp": (lambda x: x.logcumsumexp(1), [_hin("squares", (3, 8), *_SB)], 4),
    "prod_dim": (lambda x: x.prod(1), [_hin("mild", (3, 8), *_SB)], 16),
    "prod_all": (lambda x: x.prod(), [_hin("mild", (3, 8), *_SB)], 32),
    # norms, variance
    "norm_fro": (lambda x: x.norm(), [_hin("squares", (3, 8), *_SPB)], 4),
    "norm_2_dim": (lambda x: x.norm(2, dim=1), [_hin("squares", (3, 8), *_SPB)], 4),
    "norm_1_dim": (lambda x: x.norm(1, dim=1), [_hin("squares", (3, 8), *_SB)], 4),
    "norm_3_dim": (lambda x: x.norm(3, dim=1), [_hin("squares", (3, 8), *_SB)], 4),
    "norm_inf_dim": (lambda x: x.norm(float("inf"), dim=1), [_hin("squares", (3, 8), *_SB)], 4),
    "norm_0_dim": (lambda x: x.norm(0, dim=1), [_hin("squares", (3, 8), *_SB)], 4),
    "norm_const_1x8": (lambda x: x.norm(), [_hin("const300", (1, 8), split(1), B)], 4),
    "normalize": (lambda x: _hf(x).normalize(x, dim=1), [_hin("squares", (3, 8), *_SPB)], 4),
    "normalize_const_1x8": (lambda x: _hf(x).normalize(x, dim=1),
                            [_hin("const300", (1, 8), split(1), B)], 4),
    "cosine_similarity": (lambda x, y: _hf(x).cosine_similarity(x, y, dim=1),
                          [_hin("squares", (3, 8), *_SB), _hin("squares", (3, 8), *_SB)], 8),
    "pairwise_distance": (lambda x, y: _hf(x).pairwise_distance(x, y),
                          [_hin("squares", (3, 8), *_SB), _hin("squares", (3, 8), *_SB)], 4),
    "std_squares": (lambda x: x.std(1), [_hin("squares", (3, 8), *_SPB)], 4),
    "std_all": (lambda x: x.std(), [_hin("squares", (3, 8), *_SB)], 4),
    "var_offset": (lambda x: x.var(1), [_hin("offset", (3, 8), *_SPB)], 4),
    "std_offset": (lambda x: x.std(1, correction=0), [_hin("offset", (3, 8), *_SB)], 4),
    "var_mean": (lambda x: _hlib(x).var_mean(x, 1), [_hin("offset", (3, 8), *_SB)], 4),
    "std_mean": (lambda x: _hlib(x).std_mean(x, 1), [_hin("squares", (3, 8), *_SB)], 4),
    # torch's CPU batch_norm keeps its fp16/bf16 statistics in the half dtype (its CUDA
    # kernel and its float32 path do not): the oracle is torch in float32, rounded once
    "batch_norm": (lambda x: _hf(x).batch_norm(x, None, None, training=True),
                   [_hin("offset", (8, 3), *_SB)], 8, "float32"),
    "batch_norm_squares": (lambda x: _hf(x).batch_norm(x, None, None, training=True),
                           [_hin("squares", (8, 3), *_SPB)], 8, "float32"),
    # softmax family
    "logsumexp": (lambda x: x.logsumexp(1), [_hin("squares", (3, 8), *_SPB)], 4),
    # 70000 classes over split dim 0 (torch's CPU log_softmax over the *last* dim sums
    # fp16 in fp16: inf); the other layouts run torch's kernel, as the small cases do
    "softmax_wide": (lambda x: x.softmax(0), [_hin("wide", (70000, 2), split(0))], 4),
    "log_softmax_wide": (lambda x: x.log_softmax(0), [_hin("wide", (70000, 2), split(0))], 4),
    "cross_entropy_wide": (lambda x, t: _hf(x).cross_entropy(x, t),
                           [_hin("wide", (1, 70000, 2), split(1)), _hints((1, 2), 70000, B)],
                           4),
    "cross_entropy_sum": (lambda x, t: _hf(x).cross_entropy(x, t, reduction="sum"),
                          [_hin("squares", (4, 8), *_SPB), _hints((4,), 8, split(0), B)], 4),
    # selections (exact in any dtype: no sums)
    "amax": (lambda x: x.amax(1), [_hin("distinct", (3, 8), *_SPB)], 0),
    "amin_all": (lambda x: x.amin(), [_hin("distinct", (3, 8), *_SB)], 0),
    "max_dim": (lambda x: tuple(x.max(1)), [_hin("distinct", (3, 8), *_SPB)], 0),
    "min_dim": (lambda x: tuple(x.min(1)), [_hin("distinct", (3, 8), *_SB)], 0),
    "max_all": (lambda x: x.max(), [_hin("distinct", (3, 8), *_SB)], 0),
    "argmin": (lambda x: x.argmin(1), [_hin("distinct", (3, 8), *_SB)], 0),
    "aminmax": (lambda x: tuple(_hlib(x).aminmax(x, dim=1)), [_hin("distinct", (3, 8), *_SB)],
                0),
    "topk": (lambda x: tuple(x.topk(3, dim=1)), [_hin("distinct", (3, 8), *_SPB)], 0),
    "sort": (lambda x: tuple(x.sort(1, descending=True)), [_hin("distinct", (3, 8), *_SB)], 0),
    "embedding": (lambda i, w: _hf(w).embedding(i, w),
                  [_hints((5,), 8, split(0), B), _hin("squares", (8, 3), *_SPB)], 0),
    # a bag's mean over its ids (column-split tables run the registered op)
    "embedding_bag": (lambda i, w: _hf(w).embedding_bag(i, w, mode="mean"),
                      [_hints((5, 3), 8, split(0), B), _hin("squares", (8, 3), *_SB)], 4),
    "dropout": (_dropout_seeded, [_hin("squares", (3, 8), *_SPB)], 4),
}


def _half_case_inputs(name: str, dtype):
    import zlib

    import torch

    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    values, layouts = [], []
    for spec in HALF_CASES[name][1]:
        kind, arg, shape, lay = spec
        if kind == "half":
            values.append(_half_kind(arg, shape, dtype, g))
        else:
            values.append(torch.randint(0, arg, shape, generator=g))
        layouts.append(lay)
    return values, layouts


def _half_combos(name: str, layouts, every: bool) -> list[tuple]:
    """Every combination of the inputs' layouts, or (not ``every``) a covering few: every
    layout of every input at least once, the others' drawn in turn."""
    import itertools

    if every:
        return list(itertools.product(*layouts))
    width = max(len(lay) for lay in layouts)
    return sorted({tuple(lay[(i + j) % len(lay)] for j, lay in enumerate(layouts))
                   for i in range(width)}, key=str)


def _half_compare(got, want, dtype, k: float) -> str | None:
    """``None`` when ``got`` (an sbpflow tensor) matches torch's ``want``: the same dtype
    and shape, the same non-finite entries, integer outputs equal, floating ones within
    ``k`` eps relative (at least ``k eps^2`` of the largest magnitude, and two steps of the
    dtype's subnormals)."""
    import torch

    if got.dtype != want.dtype or tuple(got.shape) != tuple(want.shape):
        return f"{got.dtype} {tuple(got.shape)} where torch gives {want.dtype} " \
               f"{tuple(want.shape)}"
    mine = torch.tensor(got.tolist(), dtype=torch.float64).reshape(want.shape)
    ref = want.double()
    if not want.is_floating_point():
        return None if torch.equal(mine, ref) else \
            f"{mine.flatten()[:6].tolist()} where torch gives {ref.flatten()[:6].tolist()}"
    fin = torch.isfinite(ref)
    if not torch.equal(torch.isfinite(mine), fin) or \
            not torch.equal(mine[~fin].nan_to_num(), ref[~fin].nan_to_num()):
        bad = (torch.isfinite(mine) != fin).nonzero()[:3].tolist()
        return f"non-finite entries differ (at {bad}): {mine.flatten()[:6].tolist()} where " \
               f"torch gives {ref.flatten()[:6].tolist()}"
    if not fin.any():
        return None
    info = torch.finfo(dtype)
    scale = float(ref[fin].abs().max())
    tol = k * info.eps * ref[fin].abs().clamp(min=info.eps * scale) + \
        2 * info.smallest_normal * info.eps
    err = (mine[fin] - ref[fin]).abs()
    if bool((err <= tol).all()):
        return None
    i = int((err - tol).argmax())
    return f"error {float(err[i]):.4g} > {float(tol[i]):.4g}: {float(mine[fin][i])!r} where " \
           f"torch gives {float(ref[fin][i])!r}"


def _half_sweep_body(dtype_name: str, every: bool):
    """Rank body: every case of HALF_CASES on placement.all('cpu'); returns (problems, the
    registered ops that ran as global algorithms)."""
    import torch

    from sbpflow.ops.dispatch import observe
    from sbpflow.ops.registry import get_op

    dtype = getattr(torch, dtype_name)
    pl = sbpflow.placement.all("cpu")
    problems, reached = [], set()
    for name, (fn, _, k, *oracle) in HALF_CASES.items():
        values, layouts = _half_case_inputs(name, dtype)
        if oracle == ["float32"]:
            want = fn(*(v.float() if v.dtype == dtype else v for v in values))
            want = tuple(w.to(dtype) if w.dtype == torch.float32 else w for w in want) \
                if isinstance(want, tuple) else want.to(dtype)
        else:
            want = fn(*(v.clone() for v in values))
        wants = want if isinstance(want, tuple) else (want,)
        for combo in _half_combos(name, layouts, every):
            where = f"{dtype_name} {name} {[repr(s) for s in combo]}"
            try:
                xs = [sbpflow.tensor(v, placement=pl, sbp=s) for v, s in zip(values, combo)]
                with observe() as records:
                    got = fn(*xs)
                reached |= {r.op for r in records if get_op(r.op).algorithm is not None}
                gots = got if isinstance(got, tuple) else (got,)
                for i, (o, w) in enumerate(zip(gots, wants)):
                    err = _half_compare(o, w, dtype, k)
                    if err:
                        problems.append(f"{where} output {i}: {err}")
            except Exception as e:  # noqa: BLE001 - report every case, not the first crash
                problems.append(f"{where}: {type(e).__name__}: {e}")
    return problems, sorted(reached)


def _global_algorithms() -> set:
    from sbpflow.ops.registry import REGISTRY

    return {name for name, spec in REGISTRY.items() if spec.algorithm is not None}


def _check_half_sweep(results):
    problems, reached = results[0]
    assert problems == [], f"{len(problems)} mismatches:\n" + "\n".join(problems)
    missing = _global_algorithms() - set(reached)
    assert not missing, (f"registered global algorithms {sorted(missing)} are not reached by "
                         f"any case of HALF_CASES (test_half_precision.py): add a case that "
                         f"runs each in fp16/bf16 over a split dim")
    assert all(r == results[0] for r in results)


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_every_global_algorithm_in_half_precision_matches_torch(dist_run, world, dtype):
    """Each case in a covering few layouts (every layout of every input at least once)."""
    _check_half_sweep(dist_run(world, _half_sweep_body, dtype, False))


@pytest.mark.exhaustive
@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_every_global_algorithm_in_half_precision_every_layout(dist_run, world, dtype):
    """Each case in every combination of its inputs' layouts."""
    _check_half_sweep(dist_run(world, _half_sweep_body, dtype, True))
