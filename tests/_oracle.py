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

Per-rank bodies must be module-level functions; a test file defines its ``CASES`` and a
two-line body calling :func:`sweep_1d` / :func:`sweep_2x2` with them.
"""

from __future__ import annotations

import itertools
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

import sbpflow
from sbpflow.sbp import broadcast as B
from sbpflow.sbp import partial_sum as P
from sbpflow.sbp import split

__all__ = ["Input", "ints", "lib", "run_case", "sweep_1d", "sweep_2x2", "sweep_2x2_covering",
           "layouts_of"]


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
