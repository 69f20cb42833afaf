"""View and shape ops (sbpflow/ops/view): reshape/view/flatten, permute/transpose, squeeze/
unsqueeze, expand/repeat/repeat_interleave, narrow/split/chunk, flip/roll, tril/triu,
diagonal/diag/diag_embed/trace, clone/contiguous, cat/stack.

The cases (``CASES``) run through ``_oracle.sweep_tests``."""

from __future__ import annotations

import _oracle as oracle
import pytest
import torch
from _oracle import S0, lib

import sbpflow
from sbpflow.sbp import broadcast as B


def _cat(ts, dim):
    return (torch.cat if isinstance(ts[0], torch.Tensor) else sbpflow.cat)(ts, dim=dim)


def _stack(ts, dim):
    return (torch.stack if isinstance(ts[0], torch.Tensor) else sbpflow.stack)(ts, dim=dim)


def _weighted(pieces, dim):
    return _cat([p * (k + 1) for k, p in enumerate(pieces)], dim)


CASES = {
    "squeeze_dim": (lambda a: a.squeeze(1) * 2, [(7, 1, 5)]),
    "squeeze_all": (lambda a: a.squeeze(), [(1, 7, 1, 3)]),
    "squeeze_tuple": (lambda a: a.squeeze((0, -2)), [(1, 5, 1, 3)]),
    "unsqueeze": (lambda a: a.unsqueeze(1) + a.unsqueeze(-1).sum(-1).unsqueeze(0), [(7, 5)]),
    "expand": (lambda a: a.expand(3, 7, 5), [(7, 1)]),
    "expand_as": (lambda a, b: a.expand_as(b) * b, [(1, 5), (7, 5)]),
    "repeat": (lambda a: a.repeat(2, 1, 3), [(7, 5)]),
    "unflatten": (lambda a: a.unflatten(1, (2, -1)), [(7, 6)]),
    "split_int": (lambda a: _weighted(a.split(2, dim=1), 1), [(5, 7)]),
    "split_sizes": (lambda a: _weighted(a.split([3, 4], dim=0), 0), [(7, 5)]),
    "chunk": (lambda a: _weighted(a.chunk(3, dim=1), 1), [(5, 7)]),
    "narrow": (lambda a: a.narrow(1, -4, 3), [(5, 7)]),
    "flip": (lambda a: a.flip(0, 2), [(3, 7, 5)]),
    "roll": (lambda a: a.roll(2, 1) + a.roll(3) + a.roll((1, -2), (0, 1)), [(7, 5)]),
    "tril_triu": (lambda a: a.tril(-1) + a.triu(1) * 2, [(3, 5, 4)]),
    "contiguous_clone": (lambda a: a.t().contiguous() + a.t().clone(), [(7, 5)]),
    # Swept more densely: 6 sampled 2x2 combinations per case (3 for the others).
    **oracle.policy({
        "permute": (lambda a: a.permute(2, 0, 1) * 2, [(3, 7, 5)]),
        "reshape_merge_tail": (lambda a: a.reshape(3, 35), [(3, 7, 5)]),
        "reshape_split_tail": (lambda a: a.reshape(7, 5, 1, 1) + 1, [(7, 5)]),
        "view_flatten": (lambda a: a.view(-1, 5).flatten(), [(3, 7, 5)]),
        "reshape_heads": (lambda a: a.reshape(2, 3, 4, 2).transpose(1, 2) * 1, [(2, 3, 8)]),
        "reshape_odd_heads": (lambda a: a.reshape(2, 3, 3, 2), [(2, 3, 6)]),
        "reshape_merge_lead": (lambda a: a.reshape(24, 5) + 1, [(4, 6, 5)]),
        "cat_dim1": (lambda a, b: _cat([a, b * 2], dim=1), [(7, 5), (7, 3)]),
        "cat_dim0": (lambda a, b: _cat([a, b], dim=0) + 1, [(7, 5), (2, 5)]),
        "stack": (lambda a, b: _stack([a, b], dim=1).sum(dim=1), [(7, 5), (7, 5)]),
    }, sample_2x2=6),
    # Local mode: every output's values. Exhaustive 2x2: all combinations up to
    # 36, else a covering set.
    **oracle.policy({
        "ri_int_dim0": (lambda a: a.repeat_interleave(2, dim=0), [(7, 5)]),
        "ri_int_dim1": (lambda a: a.repeat_interleave(3, dim=1) * 2, [(7, 5)]),
        "ri_flat": (lambda a: a.repeat_interleave(2), [(3, 5)]),
        "ri_heads": (lambda k: k.repeat_interleave(2, dim=1), [(2, 4, 3, 2)]),
        "tril_inplace": (lambda a: (a * 1).tril_(-1), [(7, 5)]),
        "diag_vec": (lambda a: lib(a).diag(a, 1), [(5,)]),
        "diag_mat": (lambda a: a.diag(-1) * 2, [(7, 5)]),
        "diagonal_batch": (lambda a: a.diagonal(1, 1, 2), [(3, 7, 5)]),
        "diagonal_outer": (lambda a: a.diagonal(0, 0, 2), [(7, 3, 5)]),
        "trace": (lambda a: a.trace(), [(7, 5)]),
        "diag_embed": (lambda a: a.diag_embed(-1), [(3, 4)]),
        "diag_embed_dims": (lambda a: lib(a).diag_embed(a, 1, 0, 2), [(3, 4)]),
    }, full_2x2_max=36, local="values"),
    # Swept on 1-D meshes only (and a 2x2 covering set when exhaustive).
    **oracle.policy({
        "movedim_tile": (lambda a: a.movedim(0, 2).tile(2, 1, 1) * 1, [(3, 5, 4)]),
        "unbind_select": (lambda a: a.unbind(1)[2] + a.select(0, 1).sum(), [(5, 4)]),
    }, sample_2x2=0, full_2x2_max=36, local_atol=1e-5),
}


(test_1d_layouts_match_torch, test_2x2_sampled_layouts_match_torch,
 test_every_layout_match_torch, test_local_matches_torch) = oracle.sweep_tests(__name__)


def test_local_mode_matches_torch():
    torch.manual_seed(0)
    t = torch.randn(4, 1, 6)
    x = sbpflow.from_torch(t.clone())
    checks = [
        (x.squeeze(1), t.squeeze(1)), (x.unsqueeze(0), t.unsqueeze(0)),
        (x.expand(2, 4, 3, 6), t.expand(2, 4, 3, 6)), (x.repeat(1, 2, 1), t.repeat(1, 2, 1)),
        (x[1:, 0, ::2], t[1:, 0, ::2]), (x[[0, 3]], t[[0, 3]]), (x[x > 0], t[t > 0]),
        (x.flip(2), t.flip(2)), (x.roll(1, 0), t.roll(1, 0)),
        (x.squeeze().tril(1), t.squeeze().tril(1)), (x.narrow(2, 1, 3), t.narrow(2, 1, 3)),
        (sbpflow.sort(x, dim=2).values, t.sort(dim=2).values),
        (x.topk(2, dim=2).indices, t.topk(2, dim=2).indices),
        (sbpflow.one_hot(sbpflow.tensor([0, 2])), torch.nn.functional.one_hot(
            torch.tensor([0, 2]))),
    ]
    for got, want in checks:
        assert torch.equal(got.to_torch(), want)
    assert [p.shape for p in x.split(2, dim=2)] == [p.shape for p in t.split(2, dim=2)]
    assert isinstance(x.topk(1), torch.return_types.topk)
    y = sbpflow.zeros(3, 4)
    y[1, 1:] = sbpflow.tensor([1.0, 2.0, 3.0])
    y[y > 2] = 9.0
    assert y.to_torch().tolist() == [[0, 0, 0, 0], [0, 1, 2, 9], [0, 0, 0, 0]]


def test_local_errors():
    x = sbpflow.zeros(3, 4)
    with pytest.raises(IndexError, match="out of range"):
        x.squeeze(3)
    with pytest.raises(ValueError, match="k=5 is out of range"):
        x.topk(5)
    with pytest.raises(IndexError, match="do not fit"):
        x.narrow(1, 2, 3)
    with pytest.raises(ValueError, match="at least 2 dims"):
        sbpflow.zeros(3).tril()
    with pytest.raises(TypeError, match="only applicable to index tensors"):
        sbpflow.one_hot(x)
    with pytest.raises(ValueError, match="same length"):
        x.roll((1, 2), 0)
    g = sbpflow.ones(2, placement=sbpflow.placement("cpu", [0]), sbp=B)
    with pytest.raises(TypeError, match="x is local and v is global"):
        x[0, :2] = g


def _global_index_errors():
    pl = sbpflow.placement.all("cpu")
    x = sbpflow.zeros(3, 4, placement=pl, sbp=S0)
    out = []
    for bad in [lambda: x[3], lambda: x[0, 0, 0], lambda: x[::-1], lambda: x["a"]]:
        try:
            bad()
        except (IndexError, ValueError, TypeError) as e:
            out.append(type(e).__name__)
    return out


def test_global_index_errors(dist_run):
    assert dist_run(2, _global_index_errors)[0] == ["IndexError", "IndexError", "ValueError",
                                                   "TypeError"]
