"""The op oracle shared by the op test files: run a case on global tensors of given
layouts and compare values and gradients with plain torch on one process.

A case is ``(fn, inputs)`` or ``(fn, inputs, opts)``:

* ``fn(*tensors)`` works on torch tensors and sbpflow tensors alike (write
  ``sbpflow.xxx if isinstance(a, sbpflow.Tensor) else torch.xxx`` where needed, or use
  :func:`lib`); it returns one tensor, or a tuple whose first element is compared and
  differentiated (e.g. ``max(dim)`` values and indices: the rest are compared by value);
* ``inputs``: per input, a shape (float32 ``randn``, differentiable, layouts: every split,
  B and P) or an :class:`Input` (its own generator, differentiable or not, and layouts);
* ``opts``: ``rtol``/``atol`` (default 1e-5).

A family test file (``test_ops_<family>.py``) defines its ``CASES`` table (groups of cases
with their sweep density set by :func:`policy`) and gets its sweep tests from
:func:`sweep_tests`; the rank body :func:`run_sweep` loads the table by module name.
"""

from __future__ import annotations

import importlib
import itertools
import math
import sys
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest
import torch

import sbpflow
import sbpflow.nn.functional as SF
from sbpflow.sbp import broadcast as B
from sbpflow.sbp import partial_sum as P
from sbpflow.sbp import split

S0, S1, S2, S3 = split(0), split(1), split(2), split(3)

__all__ = ["Input", "ints", "lib", "run_case", "sweep_1d", "sweep_2x2", "sweep_2x2_covering",
           "layouts_of", "policy", "sweep_tests", "all_cases", "check_local"]


@dataclass(frozen=True)
class Input:
    """An input that is not a plain float ``randn``.

    ``make(generator) -> torch.Tensor``; ``grad``: differentiate it; ``layouts``: the
    1-D SBPs to try (default: every split, B, and P when it is float and ``grad``)."""

    make: Callable[[torch.Generator], torch.Tensor]
    grad: bool = True
    layouts: tuple | None = None


def ints(shape, high: int, low: int = 0) -> Input:
    """An int64 input in ``[low, high)`` (indices, targets): not differentiated, never P."""
    return Input(lambda g: torch.randint(low, high, shape, generator=g), grad=False)


def lib(x):
    """``sbpflow`` for sbpflow tensors, ``torch`` for torch tensors (for top-level calls)."""
    return sbpflow if isinstance(x, sbpflow.Tensor) else torch


def _spec(inp) -> Input:
    if isinstance(inp, Input):
        return inp
    return Input(lambda g, s=tuple(inp): torch.randn(s, generator=g))


def layouts_of(inp, value: torch.Tensor) -> list:
    """The 1-D SBPs to try for one input."""
    spec = _spec(inp)
    if spec.layouts is not None:
        return list(spec.layouts)
    out = [split(d) for d in range(value.ndim)] + [B]
    if spec.grad and value.is_floating_point():
        out.append(P)
    return out


def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def _values(case_name: str, inputs):
    g = torch.Generator().manual_seed(zlib.crc32(case_name.encode()))
    return [_spec(i).make(g) for i in inputs], g


def run_case(name: str, case, pl, nd_layouts) -> list[str]:
    """Failures (strings) of ``case`` on placement ``pl`` for each input layout in
    ``nd_layouts`` (a list of per-input nd-SBP tuples)."""
    fn, inputs = case[0], case[1]
    opts = case[2] if len(case) > 2 else {}
    tol = dict(rtol=opts.get("rtol", 1e-5), atol=opts.get("atol", 1e-5))
    values, g = _values(name, inputs)
    grads = [_spec(i).grad and v.is_floating_point() for i, v in zip(inputs, values)]
    ref_in = [v.clone().requires_grad_(r) for v, r in zip(values, grads)]
    ref_all = fn(*ref_in)
    ref = _first(ref_all)
    differentiable = ref.requires_grad
    weight = torch.randn(ref.shape, generator=g) if ref.is_floating_point() else None
    if differentiable:
        (ref * weight).sum().backward()
    failures = []
    for layout in nd_layouts:
        try:
            xs = [sbpflow.tensor(v, placement=pl, sbp=s, requires_grad=r)
                  for v, s, r in zip(values, layout, grads)]
            out_all = fn(*xs)
            out = _first(out_all)
            problems = []
            want_local = pl.shard_shape(tuple(ref.shape), out.sbp)
            if tuple(out.to_local().shape) != want_local:
                problems.append(f"local shape {tuple(out.to_local().shape)} != {want_local}")
            pairs = list(zip(out_all, ref_all)) if isinstance(ref_all, (tuple, list)) else [
                (out, ref)]
            for o, r in pairs:
                if o.dtype != r.dtype or not np.allclose(o.numpy(), r.detach().numpy(), **tol,
                                                         equal_nan=True):
                    problems.append(f"value {o.dtype} vs {r.dtype}")
            if differentiable:
                out.backward(sbpflow.tensor(weight, placement=pl, sbp=out.sbp))
                for i, (x, r) in enumerate(zip(xs, ref_in)):
                    if r.grad is None:
                        continue
                    if x.grad is None:
                        problems.append(f"grad {i} missing")
                    elif not np.allclose(x.grad.numpy(), r.grad.numpy(), **tol):
                        problems.append(f"grad {i}")
            if problems:
                failures.append(f"{name} {layout} -> {out.sbp}: {', '.join(problems)}")
        except Exception as e:  # noqa: BLE001 - report every layout, not the first crash
            failures.append(f"{name} {layout}: {type(e).__name__}: {e}")
    return failures


def sweep_1d(cases: dict, names) -> list[str]:
    """Every combination of 1-D input layouts on ``placement.all('cpu')``."""
    pl = sbpflow.placement.all("cpu")
    failures = []
    for name in names:
        values, _ = _values(name, cases[name][1])
        per_input = [layouts_of(i, v) for i, v in zip(cases[name][1], values)]
        layouts = [tuple((s,) for s in combo) for combo in itertools.product(*per_input)]
        failures += run_case(name, cases[name], pl, layouts)
    return failures


def _per_input_2x2(cases: dict, name: str) -> list[list]:
    """Per input of case ``name``: its 2-D layouts (pairs of 1-D ones)."""
    values, _ = _values(name, cases[name][1])
    return [list(itertools.product(layouts_of(i, v), repeat=2))
            for i, v in zip(cases[name][1], values)]


def _draw(rng, per_input) -> list:
    return [opts[rng.integers(len(opts))] for opts in per_input]


def sweep_2x2_covering(cases: dict, names, extra: int = 0) -> list[str]:
    """On a 2x2 mesh: every 2-D layout of every input at least once (the other inputs'
    layouts drawn at random, seeded by the case name), plus ``extra`` random combinations
    per case; for cases whose full product of layouts is too large to run."""
    pl = sbpflow.placement("cpu", [[0, 1], [2, 3]])
    failures = []
    for name in names:
        per_input = _per_input_2x2(cases, name)
        rng = np.random.default_rng(zlib.crc32(name.encode()))

        combos = set()
        for i, opts in enumerate(per_input):
            for layout in opts:
                combo = _draw(rng, per_input)
                combo[i] = layout
                combos.add(tuple(combo))
        for _ in range(extra):
            combos.add(tuple(_draw(rng, per_input)))
        failures += run_case(name, cases[name], pl, sorted(combos, key=str))
    return failures


def sweep_2x2(cases: dict, names, per_case: int | None) -> list[str]:
    """On a 2x2 mesh: ``per_case`` sampled combinations of 2-D input layouts per case
    (seeded by the case name), or all of them when ``per_case`` is None."""
    pl = sbpflow.placement("cpu", [[0, 1], [2, 3]])
    failures = []
    for name in names:
        per_input = _per_input_2x2(cases, name)
        combos = list(itertools.product(*per_input))
        if per_case is not None and per_case < len(combos):
            rng = np.random.default_rng(zlib.crc32(name.encode()))
            combos = [combos[i] for i in sorted(rng.choice(len(combos), per_case, replace=False))]
        failures += run_case(name, cases[name], pl, combos)
    return failures


# >>> input makers and helpers shared by the family test files


def _floats(shape, layouts):
    """A float input tried in ``layouts`` only (the cases composed of ops tested elsewhere
    need not run every combination of their inputs' layouts)."""
    return Input(lambda g: torch.randn(shape, generator=g), layouts=layouts)


def _ints_p(shape, high, low=0):
    """An int input that is also tried as P (summands of an integer tensor)."""
    base = ints(shape, high, low)
    return Input(base.make, grad=False, layouts=tuple([split(d) for d in range(len(shape))]
                                                      + [B, P]))


def _nan_at(shape):
    def make(g):
        x = torch.randn(shape, generator=g)
        x[1, 2] = x[4, 0] = x[4, 3] = x[6, 2] = math.nan
        return x
    return Input(make, layouts=(S0, S1, B))


def _nograd(shape, layouts=None):
    return Input(lambda g: torch.randn(shape, generator=g), grad=False, layouts=layouts)


def _with_zeros(shape, p=0.3):
    return Input(lambda g: torch.randn(shape, generator=g) * (torch.rand(shape, generator=g) > p))


def nnf(x):
    """``sbpflow.nn.functional`` for sbpflow tensors, ``torch.nn.functional`` for torch's."""
    return SF if isinstance(x, sbpflow.Tensor) else torch.nn.functional


def some_of(shape, *layouts) -> Input:
    return Input(lambda g: torch.randn(shape, generator=g), layouts=layouts)


def uniform(shape, lo: float, hi: float, grad: bool = True, layouts=None) -> Input:
    return Input(lambda g: torch.rand(shape, generator=g) * (hi - lo) + lo, grad, layouts)


# <<< input makers


# ---------------------------------------------------------------- the family sweeps
# A family test file (``test_ops_<family>.py``) holds a ``CASES`` table and gets its sweep
# tests from :func:`sweep_tests`. Per case, these keys of ``opts`` set how densely it is
# swept (``policy`` adds them to a group of cases):
#
# * ``sample_1d``: ``{world: k}``, about ``k`` 1-D layout combinations covering every layout
#   of every input in the default suite (all of them in the exhaustive one); absent: all
#   of them in the default suite;
# * ``sample_2x2``: sampled 2x2 combinations in the default suite (default 3; the
#   exhaustive suite runs every combination, or a covering set, per ``full_2x2_max``);
# * ``full_2x2_max``: the exhaustive suite runs every 2x2 combination of a case with at
#   most this many (default :data:`FULL_2X2_MAX`), and :func:`sweep_2x2_covering` with
#   ``covering_extra`` random extra combinations for the others (default 8 where the case
#   sets ``full_2x2_max``, else :data:`COVERING_EXTRA`);
# * ``local``: ``"exact"`` (values and gradients bit for bit), ``"close"`` (within
#   ``local_rtol``/``local_atol``, default 1e-5/1e-8; gradients of the sum, or of a random
#   weighting with ``local_weighted``; the default) or ``"values"`` (every output, values
#   only) for the one-process check of sbpflow's local mode.

SWEEP_KEYS = ("sample_1d", "sample_2x2", "full_2x2_max", "covering_extra", "local",
              "local_rtol", "local_atol", "local_weighted")


def policy(table: dict, **opts) -> dict:
    """``table`` with ``opts`` (sweep keys above) added to every case's options (a case's
    own options win)."""
    out = {}
    for name, case in table.items():
        own = case[2] if len(case) > 2 else {}
        out[name] = (case[0], case[1], {**opts, **own})
    return out


def _opts(case) -> dict:
    return case[2] if len(case) > 2 else {}


def _covering_1d(name: str, per_input: list[list], k: int) -> list[tuple]:
    """About ``k`` combinations of per-input layouts (seeded by ``name``) in which every
    layout of every input appears at least once."""
    combos = list(itertools.product(*per_input))
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    order = [combos[i] for i in rng.permutation(len(combos))]
    want = {(i, s) for i, ls in enumerate(per_input) for s in ls}
    picked = []
    for c in order:
        new = set(enumerate(c)) & want
        if new:
            picked.append(c)
            want -= new
    rest = [c for c in order if c not in picked]
    return picked + rest[: max(k - len(picked), 0)]


def sweep_1d_sampled(cases: dict, names, world: int) -> list[str]:
    """The default suite's 1-D sweep: every combination, or the ``sample_1d`` covering
    sample of a case that sets it."""
    pl = sbpflow.placement.all("cpu")
    failures = []
    for name in names:
        k = _opts(cases[name]).get("sample_1d", {}).get(world)
        if k is None:
            failures += sweep_1d(cases, [name])
            continue
        values, _ = _values(name, cases[name][1])
        per_input = [layouts_of(i, v) for i, v in zip(cases[name][1], values)]
        combos = _covering_1d(name, per_input, k)
        failures += run_case(name, cases[name], pl, [tuple((s,) for s in c) for c in combos])
    return failures


# The exhaustive suite's budget (CI runs it within its 90 minutes): every 2x2 combination
# of a case with up to 256 of them (every pair of layouts of a binary op); a three-input
# case (576) gets every layout of every input once plus 32 random combinations.
FULL_2X2_MAX = 256
COVERING_EXTRA = 32


def sweep_2x2_every(cases: dict, names) -> list[str]:
    """The exhaustive suite's 2x2 sweep: every combination, or the covering one for cases
    with more than ``full_2x2_max`` of them."""
    failures = []
    for name in names:
        opts = _opts(cases[name])
        n = math.prod(len(p) for p in _per_input_2x2(cases, name))
        if n <= opts.get("full_2x2_max", FULL_2X2_MAX):
            failures += sweep_2x2(cases, [name], None)
        else:
            extra = opts.get("covering_extra", 8 if "full_2x2_max" in opts else COVERING_EXTRA)
            failures += sweep_2x2_covering(cases, [name], extra=extra)
    return failures


def sweep_2x2_hierarchical(cases: dict, names) -> list[str]:
    """On a 2x2 mesh: both mesh axes splitting the reduced dim (hierarchical: 7 is 4,3 then
    2,2,2,1), or each axis splitting another dim; the per-axis combination must be exact.
    For one-input reductions and scans (``hierarchical`` cases)."""
    pl = sbpflow.placement("cpu", [[0, 1], [2, 3]])
    s0, s1, s2 = split(0), split(1), split(2)
    failures = []
    for name in names:
        layouts = [((s0, s0),), ((s0, s1),), ((s1, s0),), ((P, s0),), ((s0, P),)]
        if cases[name][1][0] in [(3, 7, 5)] or name in ("lse_dims", "norm_p3", "all_int_dims"):
            layouts += [((s2, s0),), ((s1, s1),)]
        values, _ = _values(name, cases[name][1])
        allowed = layouts_of(cases[name][1][0], values[0])
        layouts = [lay for lay in layouts if all(s in allowed for s in lay[0])]
        failures += run_case(name, cases[name], pl, layouts)
    return failures


def check_local(name: str, case) -> list[str]:
    """sbpflow's local mode (plain tensors, one process) against torch for one case, per its
    ``local`` option."""
    fn, inputs, opts = case[0], case[1], _opts(case)
    mode = opts.get("local", "close")
    values, g = _values(name, inputs)
    fails = []
    if mode == "values":
        want = fn(*values)
        got = fn(*(sbpflow.from_torch(v) for v in values))
        pairs = list(zip(got, want)) if isinstance(want, tuple) else [(got, want)]
        for o, w in pairs:
            if not isinstance(o, sbpflow.Tensor) or o.is_global or o.dtype != w.dtype or \
                    not torch.allclose(o.to_torch(), w, equal_nan=True):
                fails.append(f"{name}: value")
        return fails
    exact = mode == "exact"
    tol = dict(rtol=opts.get("local_rtol", 1e-5), atol=opts.get("local_atol", 1e-8))
    grads = [_spec(i).grad and v.is_floating_point() for i, v in zip(inputs, values)]
    ref_in = [v.clone().requires_grad_(r) for v, r in zip(values, grads)]
    xs = [sbpflow.tensor(v, requires_grad=r) for v, r in zip(values, grads)]
    ref, out = _first(fn(*ref_in)), _first(fn(*xs))
    if not out.is_local or out.dtype != ref.dtype:
        return [f"{name}: {out.dtype} vs {ref.dtype}"]
    o, r = out.to_torch().detach(), ref.detach()
    if not (torch.equal(o, r) or (not exact and torch.allclose(o, r, **tol, equal_nan=True))):
        fails.append(f"{name}: value")
    if ref.requires_grad:
        weight = (torch.randn(ref.shape, generator=g) if opts.get("local_weighted")
                  else torch.ones(ref.shape))
        (ref * weight).sum().backward()
        out.backward(sbpflow.from_torch(weight))
        for i, (x, r) in enumerate(zip(xs, ref_in)):
            if r.grad is None:
                continue
            xg = x.grad.to_torch()
            close = not exact and torch.allclose(xg, r.grad, **tol)
            if not (torch.equal(xg, r.grad) or close):
                fails.append(f"{name}: grad {i}")
    return fails


def _cases_of(module: str) -> dict:
    return importlib.import_module(module).CASES


def run_sweep(module: str, kind: str, names, world: int = 4) -> list[str]:
    """Rank body of the family sweeps: the sweep ``kind`` (``"1d"``, ``"1d_every"``,
    ``"2x2_sampled"``, ``"2x2_every"``, ``"2x2_hierarchical"``) over the cases ``names`` of
    the ``CASES`` table of test module ``module``."""
    cases = _cases_of(module)
    shared = sys.modules.get("_oracle")
    if shared is not None and shared.run_sweep is not run_sweep:
        # A rank process loaded this file by path, besides the ``_oracle`` the test module
        # imported: run that one (its Input class is the cases').
        return shared.run_sweep(module, kind, names, world)
    if kind == "1d":
        return sweep_1d_sampled(cases, names, world)
    if kind == "1d_every":
        return sweep_1d(cases, [n for n in names if "sample_1d" in _opts(cases[n])])
    if kind == "2x2_sampled":
        return sum((sweep_2x2(cases, [n], _opts(cases[n]).get("sample_2x2", 3)) for n in names),
                   [])
    if kind == "2x2_every":
        return sweep_2x2_every(cases, names)
    if kind == "2x2_hierarchical":
        return sweep_2x2_hierarchical(cases, names)
    raise ValueError(kind)


def all_cases(*families: str) -> dict:
    """The ``CASES`` tables of the family test files ``test_ops_<family>`` merged (for the
    signature tables that span families)."""
    out = {}
    for family in families:
        out.update(_cases_of(f"test_ops_{family}"))
    return out


def sweep_tests(module: str):
    """The sweep tests of a family test file, whose ``CASES`` table is in ``module``:

    * ``test_1d_layouts_match_torch[world]``: a 1-D mesh of 2 ranks (4 ranks run the
      sampled 2x2 layouts by default, and every 1-D layout in the exhaustive test);
    * ``test_2x2_sampled_layouts_match_torch``: sampled 2x2 layouts;
    * ``test_every_layout_match_torch`` (exhaustive): every 1-D combination of the cases
      sampled by default, and every 2x2 combination (or covering, see ``full_2x2_max``);
    * ``test_local_matches_torch[name]``: each case in local mode (see ``local``).

    Call it after ``CASES`` is defined (the local test is parametrised by its names).

    Use: ``(test_1d_layouts_match_torch, test_2x2_sampled_layouts_match_torch,
    test_every_layout_match_torch, test_local_matches_torch) = oracle.sweep_tests(__name__)``.
    """

    def chunks():  # one dist_run call (and timeout) per 10 cases
        names = sorted(_cases_of(module))
        return [names[i:i + 10] for i in range(0, len(names), 10)]

    def run(dist_run, world, kind, timeout, *args):
        failures = []
        for names in chunks():
            failures += dist_run(world, run_sweep, module, kind, names, *args, timeout=timeout)[0]
        assert failures == [], "\n".join(failures)

    @pytest.mark.parametrize("world", [2])
    def test_1d_layouts_match_torch(dist_run, world):
        run(dist_run, world, "1d", 900, world)

    def test_2x2_sampled_layouts_match_torch(dist_run):
        run(dist_run, 4, "2x2_sampled", 900)

    @pytest.mark.exhaustive
    def test_every_layout_match_torch(dist_run):
        for world in (2, 4):
            run(dist_run, world, "1d_every", 3600, world)
        run(dist_run, 4, "2x2_every", 3600)

    @pytest.mark.parametrize("name", sorted(sys.modules[module].CASES))
    def test_local_matches_torch(name):
        fails = check_local(name, _cases_of(module)[name])
        assert fails == [], fails

    return (test_1d_layouts_match_torch, test_2x2_sampled_layouts_match_torch,
            test_every_layout_match_torch, test_local_matches_torch)
