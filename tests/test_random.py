"""Random ops (sbpflow.random, dropout) against plain torch on one process: bit for bit
under every 1-D layout on 1, 2 and 4 ranks and a sample of 2x2 layouts (uneven sizes),
the generator in step with torch's; ranks outside the placement; per-shard mode
properties; local mode; seeds and RNG state; the collectives of random ops. Deterministic
creation: test_creation.py."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

import sbpflow
from sbpflow.distributed import CommRecorder
from sbpflow.sbp import broadcast as B
from sbpflow.sbp import partial_sum as P
from sbpflow.sbp import split

S0, S1, S2 = split(0), split(1), split(2)

SEED = 1234


def _inputs():
    """Input values for the ops that take tensors (made before seeding, own generator)."""
    g = torch.Generator().manual_seed(99)
    return {
        "p": torch.rand(7, 5, generator=g),
        "mean": torch.randn(7, 5, generator=g),
        "std": torch.rand(7, 5, generator=g) + 0.5,
        "mean_row": torch.randn(5, generator=g),
        "probs": torch.rand(7, 5, generator=g) + 0.01,
        "probs1": torch.rand(6, generator=g) + 0.01,
        "like": torch.zeros(7, 5),
        "like_int": torch.zeros(7, 5, dtype=torch.int32),
        "x3": torch.randn(6, 5, 3, generator=g),
    }


def _g(name, pl, nd):
    return sbpflow.tensor(_inputs()[name], placement=pl, sbp=nd)


# name -> (sbpflow(pl, nd) -> global tensor, torch() -> tensor, ndim of the laid-out
# tensor, may the layout hold P). For ops with tensor inputs, nd is the input's layout.
RANDOM_CASES = {
    "rand": (lambda pl, nd: sbpflow.rand(7, 5, placement=pl, sbp=nd),
             lambda: torch.rand(7, 5), 2, False),
    "randn_3d": (lambda pl, nd: sbpflow.randn(3, 7, 5, placement=pl, sbp=nd),
                 lambda: torch.randn(3, 7, 5), 3, False),
    "randn_f64": (lambda pl, nd: sbpflow.randn(7, 5, dtype=torch.float64, placement=pl, sbp=nd),
                  lambda: torch.randn(7, 5, dtype=torch.float64), 2, False),
    "randint": (lambda pl, nd: sbpflow.randint(-3, 9, (7, 5), placement=pl, sbp=nd),
                lambda: torch.randint(-3, 9, (7, 5)), 2, False),
    "randperm": (lambda pl, nd: sbpflow.randperm(11, placement=pl, sbp=nd),
                 lambda: torch.randperm(11), 1, False),
    "normal_floats": (lambda pl, nd: sbpflow.normal(0.5, 2.0, (7, 5), placement=pl, sbp=nd),
                      lambda: torch.normal(0.5, 2.0, (7, 5)), 2, False),
    "rand_like": (lambda pl, nd: sbpflow.rand_like(_g("like", pl, nd)),
                  lambda: torch.rand_like(_inputs()["like"]), 2, True),
    "randn_like": (lambda pl, nd: sbpflow.randn_like(_g("like", pl, nd)),
                   lambda: torch.randn_like(_inputs()["like"]), 2, True),
    "randint_like": (lambda pl, nd: sbpflow.randint_like(_g("like_int", pl, nd), 2, 20),
                     lambda: torch.randint_like(_inputs()["like_int"], 2, 20), 2, False),
    "bernoulli": (lambda pl, nd: sbpflow.bernoulli(_g("p", pl, nd)),
                  lambda: torch.bernoulli(_inputs()["p"]), 2, True),
    "bernoulli_method_p": (lambda pl, nd: _g("p", pl, nd).bernoulli(0.3),
                           lambda: _inputs()["p"].bernoulli(0.3), 2, True),
    "normal_tensors": (lambda pl, nd: sbpflow.normal(_g("mean", pl, nd), _g("std", pl, nd)),
                       lambda: torch.normal(_inputs()["mean"], _inputs()["std"]), 2, True),
    "normal_tensor_float": (lambda pl, nd: sbpflow.normal(_g("mean", pl, nd), 0.1),
                            lambda: torch.normal(_inputs()["mean"], 0.1), 2, True),
    "normal_float_tensor": (lambda pl, nd: sbpflow.normal(2.0, _g("std", pl, nd)),
                            lambda: torch.normal(2.0, _inputs()["std"]), 2, True),
    "normal_broadcast": (lambda pl, nd: sbpflow.normal(
        _g("mean_row", pl, (B,) * pl.ndim), _g("std", pl, nd)),
        lambda: torch.normal(_inputs()["mean_row"], _inputs()["std"]), 2, True),
    "multinomial": (lambda pl, nd: sbpflow.multinomial(_g("probs", pl, nd), 3),
                    lambda: torch.multinomial(_inputs()["probs"], 3), 2, True),
    "multinomial_repl": (lambda pl, nd: _g("probs", pl, nd).multinomial(9, replacement=True),
                         lambda: _inputs()["probs"].multinomial(9, True), 2, True),
    "multinomial_1d": (lambda pl, nd: sbpflow.multinomial(_g("probs1", pl, nd), 4),
                       lambda: torch.multinomial(_inputs()["probs1"], 4), 1, True),
    # torch draws dropout's mask in the input's memory order: views (attention's
    # transposed output) must follow it on every layout (a P input stays P: tested below)
    "dropout": (lambda pl, nd: sbpflow.nn.functional.dropout(_g("mean", pl, nd), 0.4),
                lambda: torch.nn.functional.dropout(_inputs()["mean"], 0.4), 2, False),
    "dropout_transposed": (
        lambda pl, nd: sbpflow.nn.functional.dropout(_g("x3", pl, nd).transpose(0, 1), 0.5),
        lambda: torch.nn.functional.dropout(_inputs()["x3"].transpose(0, 1), 0.5), 3, False),
    "dropout_permuted": (
        lambda pl, nd: sbpflow.nn.functional.dropout(_g("x3", pl, nd).permute(2, 0, 1), 0.5),
        lambda: torch.nn.functional.dropout(_inputs()["x3"].permute(2, 0, 1), 0.5), 3, False),
    "multinomial_out_s1": (lambda pl, nd: sbpflow.multinomial(_g("probs", pl, nd), 5,
                                                              sbp=(S1,) * pl.ndim),
                           lambda: torch.multinomial(_inputs()["probs"], 5), 2, True),
}


def _layouts_1d(ndim, partial):
    return [(split(d),) for d in range(ndim)] + [(B,)] + ([(P,)] if partial else [])


SAMPLE_2X2 = [(S0, S0), (S0, S1), (S1, S0), (B, S1), (S1, B), (B, B), (S0, P), (P, B)]


def _layouts_2x2(ndim, partial, every=False):
    if every:
        one = [split(d) for d in range(ndim)] + [B] + ([P] if partial else [])
        return list(itertools.product(one, repeat=2))
    return [nd for nd in SAMPLE_2X2 if all(not s.is_split() or s.dim < ndim for s in nd)
            and (partial or P not in nd)]


def _check_random(names, mesh, every=False):
    pl = sbpflow.placement("cpu", mesh)
    failures = []
    for name in names:
        make, ref_fn, ndim, partial = RANDOM_CASES[name]
        layouts = (_layouts_1d(ndim, partial) if pl.ndim == 1
                   else _layouts_2x2(ndim, partial, every))
        for nd in layouts:
            sbpflow.manual_seed(SEED)
            out = make(pl, nd)
            after = torch.rand(2)  # the generator advanced as torch's did
            torch.manual_seed(SEED)
            ref = ref_fn()
            ref_after = torch.rand(2)
            got = torch.from_numpy(out.numpy())
            problems = []
            if any(s.is_partial() for s in out.sbp):
                problems.append("output is P")
            if tuple(out.to_local().shape) != pl.shard_shape(tuple(ref.shape), out.sbp):
                problems.append(f"local shape {tuple(out.to_local().shape)}")
            if out.dtype != ref.dtype or got.shape != ref.shape or not torch.equal(got, ref):
                problems.append(f"value ({out.dtype} {tuple(got.shape)} vs {ref.dtype} "
                                f"{tuple(ref.shape)})")
            if not torch.equal(after, ref_after):
                problems.append("generator out of step")
            if problems:
                failures.append(f"{name} {nd} -> {out.sbp}: {', '.join(problems)}")
    return failures


def _mesh(world):
    return list(range(world))


@pytest.mark.parametrize("world", [1, 2, 4])
def test_random_ops_bit_exact_every_1d_layout(dist_run, world):
    results = dist_run(world, _check_random, sorted(RANDOM_CASES), _mesh(world))
    assert results[0] == [], "\n".join(results[0])
    assert all(r == results[0] for r in results)


def test_random_ops_bit_exact_2x2_sampled_layouts(dist_run):
    results = dist_run(4, _check_random, sorted(RANDOM_CASES), [[0, 1], [2, 3]])
    assert results[0] == [], "\n".join(results[0])


@pytest.mark.exhaustive
def test_random_ops_bit_exact_2x2_every_layout(dist_run):
    results = dist_run(4, _check_random, sorted(RANDOM_CASES), [[0, 1], [2, 3]], True,
                       timeout=900)
    assert results[0] == [], "\n".join(results[0])


def _random_on_sub_placement():
    # Ranks 2 and 3 are outside the placement: they hold empty shards, but draw too, so
    # every rank's generator stays in step and the members' value is torch's.
    pl = sbpflow.placement("cpu", [0, 1])
    sbpflow.manual_seed(5)
    x = sbpflow.randn(7, 5, placement=pl, sbp=S0)
    p = sbpflow.tensor(_inputs()["p"], placement=pl, sbp=S1)
    b = p.bernoulli()
    m = sbpflow.multinomial(sbpflow.tensor(_inputs()["probs"], placement=pl, sbp=S0), 2)
    after = torch.rand(3)
    torch.manual_seed(5)
    ref = torch.randn(7, 5)
    ref_b = torch.bernoulli(_inputs()["p"])
    ref_m = torch.multinomial(_inputs()["probs"], 2)
    assert torch.equal(after, torch.rand(3))
    assert torch.equal(torch.from_numpy(x.numpy()), ref)
    assert torch.equal(torch.from_numpy(b.numpy()), ref_b)
    assert torch.equal(torch.from_numpy(m.numpy()), ref_m)
    return tuple(x.to_local().shape)


def test_random_ops_ranks_outside_placement_stay_in_step(dist_run):
    shapes = dist_run(4, _random_on_sub_placement)
    assert shapes == [(4, 5), (3, 5), (0, 0), (0, 0)]


# ---------------------------------------------------------------------- per-shard mode

PER_SHARD_OPS = {
    "randn": lambda pl, nd: sbpflow.randn(9, 6, placement=pl, sbp=nd),
    "rand": lambda pl, nd: sbpflow.rand(9, 6, placement=pl, sbp=nd),
    "randint": lambda pl, nd: sbpflow.randint(0, 1000, (9, 6), placement=pl, sbp=nd),
    "normal": lambda pl, nd: sbpflow.normal(1.0, 2.0, (9, 6), placement=pl, sbp=nd),
    "bernoulli": lambda pl, nd: sbpflow.bernoulli(
        sbpflow.full((9, 6), 0.5, placement=pl, sbp=nd)),
    "normal_tensor": lambda pl, nd: sbpflow.normal(
        sbpflow.zeros(9, 6, placement=pl, sbp=nd),
        sbpflow.ones(6, placement=pl, sbp=(B,) * pl.ndim)),
    "dropout": lambda pl, nd: sbpflow.ops.dropout(sbpflow.ones(9, 6, placement=pl, sbp=nd),
                                                  0.5),
    "multinomial": lambda pl, nd: sbpflow.multinomial(
        sbpflow.ones(9, 6, placement=pl, sbp=nd), 4, replacement=True),
}


def _per_shard(mesh, layouts):
    """Per rank: {(op, layout): (local, local again with the same seed, next draw's local,
    the global value)}, plus whether the generators stayed in step."""
    pl = sbpflow.placement("cpu", mesh)
    out = {}
    for name, make in sorted(PER_SHARD_OPS.items()):
        for nd in layouts:
            if name == "multinomial" and S1 in nd:
                continue
            runs = []
            for _ in range(2):
                sbpflow.manual_seed(3)
                with sbpflow.random.per_shard():
                    a = make(pl, nd)
                    b = make(pl, nd)
                runs.append((a, b))
            (a, b), (a2, _) = runs
            assert sbpflow.random.is_per_shard() is False
            out[(name, nd)] = (a.to_local().to_torch(), a2.to_local().to_torch(),
                               b.to_local().to_torch(), torch.from_numpy(a.numpy()),
                               tuple(v for r in pl.shard_slices(a.shape, a.sbp)
                                     for v in (r.start, r.stop)))
    # Inside per_shard(False) the layout-invariant rule holds again.
    sbpflow.manual_seed(8)
    with sbpflow.random.per_shard(), sbpflow.random.per_shard(False):
        x = sbpflow.randn(9, 6, placement=pl, sbp=layouts[0])
    torch.manual_seed(8)
    exact = torch.equal(torch.from_numpy(x.numpy()), torch.randn(9, 6))
    return out, torch.rand(4), exact


def _check_per_shard(results):
    problems = []
    per_rank = [r[0] for r in results]
    if not all(torch.equal(r[1], results[0][1]) for r in results):
        problems.append("generators out of step after per-shard draws")
    if not all(r[2] for r in results):
        problems.append("per_shard(False) is not layout invariant")
    for key in per_rank[0]:
        shards = [r[key] for r in per_rank]
        for rank, (a, a2, b, _, _) in enumerate(shards):
            if not torch.equal(a, a2):
                problems.append(f"{key} rank {rank}: not reproducible")
            if a.numel() > 4 and torch.equal(a, b):
                problems.append(f"{key} rank {rank}: two draws are equal")
        by_region = {}
        for rank, (a, _, _, _, region) in enumerate(shards):
            by_region.setdefault(region, []).append((rank, a))
        for region, held in by_region.items():  # same region (B ranks): same values
            if not all(torch.equal(a, held[0][1]) for _, a in held):
                problems.append(f"{key}: ranks {[r for r, _ in held]} disagree on {region}")
        regions = list(by_region.values())
        for (ra, a), (rb, b) in itertools.combinations([h[0] for h in regions], 2):
            n = min(a.numel(), b.numel())
            if n > 4 and torch.equal(a.reshape(-1)[:n], b.reshape(-1)[:n]):
                problems.append(f"{key}: ranks {ra} and {rb} drew the same shard")
        if len(regions) > 1 and key[0] != "dropout":
            torch.manual_seed(3)
            ref = PER_SHARD_REF[key[0]]()
            if torch.equal(shards[0][3], ref):
                problems.append(f"{key}: equals the one-process draw (per-shard should not)")
    return problems


PER_SHARD_REF = {
    "randn": lambda: torch.randn(9, 6), "rand": lambda: torch.rand(9, 6),
    "randint": lambda: torch.randint(0, 1000, (9, 6)),
    "normal": lambda: torch.normal(1.0, 2.0, (9, 6)),
    "bernoulli": lambda: torch.bernoulli(torch.full((9, 6), 0.5)),
    "normal_tensor": lambda: torch.normal(torch.zeros(9, 6), torch.ones(6)),
    "multinomial": lambda: torch.multinomial(torch.ones(9, 6), 4, True),
}


def test_per_shard_mode_1d(dist_run):
    results = dist_run(4, _per_shard, [0, 1, 2, 3], [(S0,), (S1,), (B,)])
    problems = _check_per_shard(results)
    assert problems == [], "\n".join(problems)


def test_per_shard_mode_2x2(dist_run):
    results = dist_run(4, _per_shard, [[0, 1], [2, 3]], [(S0, B), (B, S1), (S0, S1),
                                                          (S1, S1), (B, B)])
    problems = _check_per_shard(results)
    assert problems == [], "\n".join(problems)


def _per_shard_dropout_on_p():
    # A P input's ranks hold the same region, so they draw the same mask: the output stays
    # a valid P (its sum is dropout of the sum).
    pl = sbpflow.placement.all("cpu")
    x = sbpflow.from_torch(torch.ones(6, 4)).to_global(pl, P)  # every summand is ones
    sbpflow.manual_seed(1)
    with sbpflow.random.per_shard():
        y = sbpflow.ops.dropout(x, 0.5)
    return y.sbp, y.to_local().to_torch()


def test_per_shard_dropout_on_partial_input(dist_run):
    results = dist_run(2, _per_shard_dropout_on_p)
    assert results[0][0] == (P,)
    assert torch.equal(results[0][1], results[1][1]) and 0 < results[0][1].sum() < 48


# ---------------------------------------------------------------------- local mode


def test_local_ops_match_torch():
    inp = _inputs()
    cases = [
        (lambda: sbpflow.randn(4, 3), lambda: torch.randn(4, 3)),
        (lambda: sbpflow.randperm(9), lambda: torch.randperm(9)),
        (lambda: sbpflow.normal(1.0, 0.5, (3, 2)), lambda: torch.normal(1.0, 0.5, (3, 2))),
        (lambda: sbpflow.normal(sbpflow.from_torch(inp["mean"]), 2.0),
         lambda: torch.normal(inp["mean"], 2.0)),
        (lambda: sbpflow.from_torch(inp["p"]).bernoulli(),
         lambda: inp["p"].bernoulli()),
        (lambda: sbpflow.bernoulli(sbpflow.from_torch(inp["p"]), 0.2),
         lambda: torch.bernoulli(inp["p"], 0.2)),
        (lambda: sbpflow.from_torch(inp["probs"]).multinomial(2),
         lambda: inp["probs"].multinomial(2)),
        (lambda: sbpflow.multinomial(sbpflow.from_torch(inp["probs1"]), 8, True),
         lambda: torch.multinomial(inp["probs1"], 8, True)),
        (lambda: sbpflow.rand_like(sbpflow.zeros(2, 3)), lambda: torch.rand(2, 3)),
        (lambda: sbpflow.randint_like(sbpflow.zeros(2, 3), 5),
         lambda: torch.randint_like(torch.zeros(2, 3), 5)),
        (lambda: sbpflow.arange(2, 11, 3), lambda: torch.arange(2, 11, 3)),
        (lambda: sbpflow.arange(0.5, 3), lambda: torch.arange(0.5, 3)),
        (lambda: sbpflow.linspace(-1, 1, 6), lambda: torch.linspace(-1, 1, 6)),
        (lambda: sbpflow.eye(3, 4, dtype=torch.float64), lambda: torch.eye(3, 4,
                                                                           dtype=torch.float64)),
        (lambda: sbpflow.full_like(sbpflow.zeros(2, 2), 7), lambda: torch.full((2, 2), 7.0)),
    ]
    for i, (ours, theirs) in enumerate(cases):
        torch.manual_seed(i)
        a = ours()
        torch.manual_seed(i)
        b = theirs()
        assert a.is_local and a.dtype == b.dtype and torch.equal(a.to_torch(), b), i
    assert sbpflow.empty(2, 3).shape == (2, 3)
    assert sbpflow.empty_like(sbpflow.zeros(4, dtype=torch.int64)).dtype == torch.int64
    x = sbpflow.arange(3.0, requires_grad=True)
    (x * x).sum().backward()
    assert torch.equal(x.grad.to_torch(), torch.tensor([0.0, 2.0, 4.0]))
    g = torch.Generator().manual_seed(4)
    a = sbpflow.randperm(6, generator=g).to_torch()
    assert torch.equal(a, torch.randperm(6, generator=torch.Generator().manual_seed(4)))


def test_seed_and_rng_state():
    sbpflow.manual_seed(77)
    assert sbpflow.initial_seed() == 77 == torch.initial_seed()
    state = sbpflow.get_rng_state()
    a = sbpflow.randn(3).to_torch()
    sbpflow.set_rng_state(state)
    assert torch.equal(sbpflow.randn(3).to_torch(), a)
    s = sbpflow.seed()
    assert sbpflow.initial_seed() == s


def _seed_agrees():
    s = sbpflow.seed()
    return s, torch.rand(2)


def test_seed_agrees_across_ranks(dist_run):
    results = dist_run(2, _seed_agrees)
    assert results[0][0] == results[1][0] and torch.equal(results[0][1], results[1][1])


# ---------------------------------------------------------------------- collectives

# (op, per-shard mode) -> collectives it may run, written from the rules: random creation
# draws locally; sampling from a split tensor gathers it (layout invariant) or draws from
# the shard (per-shard mode, no collective).
def _collectives():
    pl = sbpflow.placement.all("cpu")
    p = sbpflow.full((6, 4), 0.5, placement=pl, sbp=S0)
    table = [
        ("randn S0", lambda: sbpflow.randn(6, 4, placement=pl, sbp=S0), False, []),
        ("randint B", lambda: sbpflow.randint(0, 5, (6, 4), placement=pl, sbp=B), False, []),
        ("randperm S0", lambda: sbpflow.randperm(6, placement=pl, sbp=S0), False, []),
        ("bernoulli S0", lambda: p.bernoulli(), False, ["all_gather"]),
        ("bernoulli S0", lambda: p.bernoulli(), True, []),
        ("bernoulli(0.3) S0", lambda: p.bernoulli(0.3), False, []),
        ("multinomial S0", lambda: p.multinomial(2), False, ["all_gather"]),
        ("multinomial S0", lambda: p.multinomial(2), True, []),
        ("normal S0", lambda: sbpflow.normal(p, p), True, []),
    ]
    problems = []
    for name, make, per_shard, want in table:
        with sbpflow.random.per_shard(per_shard), CommRecorder() as rec:
            out = make()
        if rec.kinds() != want or any(s.is_partial() for s in out.sbp):
            problems.append(f"{name} per_shard={per_shard}: {rec.kinds()} -> {out.sbp}")
    return problems


def test_collectives_of_random_ops(dist_run):
    results = dist_run(2, _collectives)
    assert results[0] == [], "\n".join(results[0])


def _dropout_bit_exact(world_layouts):
    pl = sbpflow.placement.all("cpu")
    torch.manual_seed(0)
    xv = torch.randn(7, 5)
    for layout in world_layouts:
        sbpflow.manual_seed(11)
        x = sbpflow.tensor(xv, placement=pl, sbp=layout, requires_grad=True)
        y = sbpflow.ops.dropout(x, p=0.3)
        y.backward(sbpflow.ones(7, 5, placement=pl, sbp=y.sbp))
        xr = xv.clone().requires_grad_(True)
        torch.manual_seed(11)
        yr = torch.nn.functional.dropout(xr, 0.3, True)
        yr.sum().backward()
        assert y.sbp == (layout,)
        assert np.array_equal(y.numpy(), yr.detach().numpy()), layout  # bit for bit
        assert np.array_equal(x.grad.numpy(), xr.grad.numpy()), layout
    return "ok"


@pytest.mark.parametrize("world", [1, 2, 4])
def test_dropout_layout_invariant_bit_exact(dist_run, world):
    dist_run(world, _dropout_bit_exact, [S0, S1, B, P])


def test_dropout_local_and_errors():
    torch.manual_seed(2)
    a = sbpflow.ops.dropout(sbpflow.ones(4, 4), 0.5).to_torch()
    torch.manual_seed(2)
    assert torch.equal(a, torch.nn.functional.dropout(torch.ones(4, 4), 0.5, True))
    x = sbpflow.ones(3)
    assert sbpflow.ops.dropout(x, 0.5, training=False) is x
    with pytest.raises(ValueError, match="between 0 and 1"):
        sbpflow.ops.dropout(x, 1.5)
