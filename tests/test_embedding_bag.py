"""EmbeddingBag and the multi-table collection against one-process torch: values and
gradients for every table layout (B, S(0) rows, S(1) columns) on 2 and 4 ranks, the
collectives of the row-sharded lookup (recorder: count and bytes), sparse gradients and
the sparse optimizers, bad input."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as TF

import sbpflow
import sbpflow.nn.functional as F
from sbpflow.distributed import CommRecorder
from sbpflow.sbp import broadcast as B
from sbpflow.sbp import split

S0, S1 = split(0), split(1)
LAYOUTS = {"B": B, "S0": S0, "S1": S1}


def _close(got, want, rtol=1.3e-6, atol=1e-5):
    """torch.testing.assert_close's float32 tolerances, without importing torch.testing
    (seconds per rank process on this machine)."""
    got, want = got.detach(), want.detach()
    if got.shape != want.shape or not torch.allclose(got, want, rtol=rtol, atol=atol):
        diff = (got - want).abs().max() if got.shape == want.shape else None
        raise AssertionError(f"not close: shapes {tuple(got.shape)} {tuple(want.shape)}, "
                             f"max abs diff {diff}")


def _rank_bags(rank: int, V: int, nbags: int = 3, seed: int = 0):
    """Rank ``rank``'s own bags: 1-D ids (repeats, an empty bag) and offsets."""
    g = torch.Generator().manual_seed(1000 * seed + rank)
    lens = torch.randint(0, 5, (nbags,), generator=g)
    lens[rank % nbags] = 0  # an empty bag on every rank
    ids = torch.randint(0, V, (int(lens.sum()),), generator=g)
    if ids.numel() > 1:
        ids[-1] = ids[0]  # a repeated id
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)[:-1]])
    return ids, offsets


def _all_bags(n: int, V: int, nbags: int = 3, seed: int = 0):
    ids, offs, base = [], [], 0
    for r in range(n):
        i, o = _rank_bags(r, V, nbags, seed)
        ids.append(i)
        offs.append(o + base)
        base += i.numel()
    return torch.cat(ids), torch.cat(offs)


def _bag_case(layout: str, mode: str, V: int, D: int, sparse: bool, psw: bool, padding_idx):
    torch.set_num_threads(1)
    n, rank = sbpflow.distributed.get_world_size(), sbpflow.distributed.get_rank()
    pl = sbpflow.placement("cpu", list(range(n)))
    g = torch.Generator().manual_seed(V * 31 + D)
    W = torch.randn(V, D, generator=g)
    all_ids, all_offs = _all_bags(n, V)
    all_w = torch.rand(all_ids.shape, generator=g) if psw else None
    G = torch.randn(all_offs.numel(), D, generator=g)
    # oracle: torch on one process
    Wt = W.clone().requires_grad_(True)
    wt = all_w.clone().requires_grad_(True) if psw else None
    ref = TF.embedding_bag(all_ids, Wt, all_offs, mode=mode, per_sample_weights=wt,
                           padding_idx=padding_idx)
    (ref * G).sum().backward()
    # sbpflow: this rank's own bags against a global table
    ids, offs = _rank_bags(rank, V)
    lo = sum(_rank_bags(r, V)[0].numel() for r in range(rank))
    w = sbpflow.tensor(W, placement=pl, sbp=LAYOUTS[layout], requires_grad=True)
    pw = None
    if psw:
        pw = sbpflow.from_torch(all_w[lo:lo + ids.numel()].clone()).requires_grad_(True)
    if layout == "S1":  # column split: 2-D bags (padded with padding_idx)
        return None
    out = F.embedding_bag(sbpflow.from_torch(ids), w, sbpflow.from_torch(offs), mode=mode,
                          sparse=sparse, per_sample_weights=pw, padding_idx=padding_idx)
    res = [tuple(out.shape) == tuple(ref.shape), out.sbp == (S0,)]
    _close(torch.from_numpy(out.numpy()), ref.detach(), rtol=1e-5,
                               atol=1e-6)
    (out * sbpflow.tensor(G, placement=pl, sbp=S0)).sum().backward()
    gl = w.grad.to_local().to_torch()
    res.append(gl.is_sparse == sparse)
    want = Wt.grad[pl.shard_slices((V, D), w.sbp)]
    _close(gl.to_dense() if sparse else gl, want, rtol=1e-5, atol=1e-6)
    if psw:
        _close(pw.grad.to_torch(), wt.grad[lo:lo + ids.numel()],
                                   rtol=1e-5, atol=1e-6)
    return res


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("layout", ["S0", "B"])
def test_bag_layouts(dist_run, n, layout):
    for mode, sparse, psw, pad in [("sum", False, True, None), ("mean", layout == "S0", False, 3),
                                   ("max", False, False, None)]:
        got = dist_run(n, _bag_case, layout, mode, 13, 4, sparse, psw, pad)
        assert all(r is None or all(r) for r in got), (mode, got)


# ---------------------------------------------------------------- the collection
TABLES = [dict(name="user", num_embeddings=1000, embedding_dim=4, pooling="sum"),
          dict(name="item", num_embeddings=37, embedding_dim=3, pooling="mean",
               feature_names=("item", "history"), padding_idx=0),
          dict(name="genre", num_embeddings=10, embedding_dim=2, pooling="sum")]
PLANS = {
    "rule": {},  # 1000 rows: row_wise (bytes >= row_wise_min_bytes below), others table_wise
    "rows": {"user": "row_wise", "item": "row_wise", "genre": "row_wise"},
    "mixed": {"user": "column_wise", "item": "replicated", "genre": "row_wise"},
}


def _features(rank: int, nbags: int = 3, seed: int = 0, dense_2d=False):
    g = torch.Generator().manual_seed(7919 * seed + rank)
    user = torch.randint(0, 1000, (nbags, 2), generator=g)
    user[0, 1] = user[0, 0]  # repeated id in a bag
    item, item_off = _rank_bags(rank, 37, nbags, seed + 1)
    hist = torch.randint(0, 37, (nbags, 3), generator=g)
    hist[1, 2] = 0  # padding
    genre, genre_off = _rank_bags(rank, 10, nbags, seed + 2)
    gw = torch.rand(genre.shape, generator=g)
    return {"user": user, "item": (item, item_off), "history": hist,
            "genre": (genre, genre_off, gw)}


def _oracle_pool(W, cfg, feat):
    ids, offs, psw = (feat, None, None) if isinstance(feat, torch.Tensor) else \
        ((*feat, None) if len(feat) == 2 else feat)
    return TF.embedding_bag(ids, W, offs, mode=cfg["pooling"], per_sample_weights=psw,
                            padding_idx=cfg.get("padding_idx"))


def _collection_case(plan: str, sparse: bool, concat: bool):
    torch.set_num_threads(1)
    n, rank = sbpflow.distributed.get_world_size(), sbpflow.distributed.get_rank()
    pl = sbpflow.placement("cpu", list(range(n)))
    torch.manual_seed(0)
    ebc = sbpflow.nn.EmbeddingBagCollection(TABLES, sparse=sparse and plan != "mixed",
                                            row_wise_min_bytes=1000 * 4 * 4)
    Ws = {c["name"]: ebc.embedding_bags[c["name"]].weight.to_torch().detach().clone()
          .requires_grad_(True) for c in TABLES}
    ebc.shard(pl, PLANS[plan])
    feats_all = [_features(r) for r in range(n)]
    g = torch.Generator().manual_seed(5)
    dims = {"user": 4, "item": 3, "history": 3, "genre": 2}
    Gs = {f: torch.randn(3 * n, d, generator=g) for f, d in dims.items()}
    # oracle
    ref = {}
    for c in TABLES:
        for f in c.get("feature_names", (c["name"],)):
            ref[f] = torch.cat([_oracle_pool(Ws[c["name"]], c, fa[f]) for fa in feats_all])
    sum((ref[f] * Gs[f]).sum() for f in ref).backward()
    # sbpflow
    with CommRecorder(include_metadata=True) as rec:
        out = ebc(feats_all[rank], concat=concat)
    kinds = [k for k in rec.kinds() if k != "check"]  # (agreement-check fingerprints)
    if concat:
        want = torch.cat([ref[f] for f in dims], 1)
        _close(torch.from_numpy(out.numpy()), want.detach())
        G = torch.cat([Gs[f] for f in dims], 1)
        loss = (out * sbpflow.tensor(G, placement=pl, sbp=S0)).sum()
    else:
        for f, o in out.items():
            assert o.sbp == (S0,) and tuple(o.shape) == (3 * n, dims[f])
            _close(torch.from_numpy(o.numpy()), ref[f].detach())
        loss = sum((out[f] * sbpflow.tensor(Gs[f], placement=pl, sbp=S0)).sum() for f in dims)
    fwd = rec.count("all_to_all")
    if plan != "mixed":  # counts (+ range check, batch sizes) in one all-gather, 2 all-to-alls
        assert kinds == ["all_gather", "all_to_all", "all_to_all"], kinds
    with CommRecorder() as rec:
        loss.backward()
    bwd = rec.count("all_to_all")
    held = {}
    for c in TABLES:
        w = ebc.embedding_bags[c["name"]].weight
        if w.placement.coord() is None:
            held[c["name"]] = 0
            continue
        gl = w.grad.to_local().to_torch() if w.grad is not None else None
        sl = w.placement.shard_slices(tuple(w.shape), w.sbp)
        want = Ws[c["name"]].grad[sl]
        held[c["name"]] = want.shape[0] if w.sbp == (S0,) else -1
        if gl is None:
            assert float(want.abs().sum()) == 0.0
            continue
        assert gl.is_sparse == (sparse and plan != "mixed"), c["name"]
        _close(gl.to_dense() if gl.is_sparse else gl, want,
                                   rtol=1e-5, atol=1e-6)
    return fwd, bwd, held


@pytest.mark.parametrize("n", [2, 4])
def test_collection_every_plan(dist_run, n):
    for plan, sparse, concat in [("rule", True, False), ("rows", False, True),
                                 ("mixed", False, False)]:
        res = dist_run(n, _collection_case, plan, sparse, concat)
        fwd, bwd, held = res[0]
        if plan == "mixed":  # + the column-wise output's S(1) -> S(0) all-to-all each way
            assert (fwd, bwd) == (3, 3), (plan, fwd, bwd)
        else:
            assert (fwd, bwd) == (2, 2), (plan, fwd, bwd)
        if plan == "rule" and n == 4:  # table-wise: some ranks hold no row of a table
            assert [r[2]["genre"] for r in res].count(0) == 3, res


# ---------------------------------------------------------------- sparse updates
def _make_opt(name, params, torch_side: bool):
    import sbpflow.optim as so
    if name == "sgd":
        return (torch.optim.SGD if torch_side else so.SGD)(params, lr=0.5)
    if name == "adagrad":
        return (torch.optim.Adagrad if torch_side else so.Adagrad)(params, lr=0.3)
    if name == "adam":
        return (torch.optim.SparseAdam if torch_side else so.SparseAdam)(params, lr=0.05)
    # adamw: the oracle is torch's SparseAdam after decaying the touched rows by hand
    if torch_side:
        return torch.optim.SparseAdam(params, lr=0.05)
    return so.SparseAdamW(params, lr=0.05, weight_decay=0.1)


def _optim_case(name: str, plan: str, steps: int = 3):
    torch.set_num_threads(1)
    n, rank = sbpflow.distributed.get_world_size(), sbpflow.distributed.get_rank()
    pl = sbpflow.placement("cpu", list(range(n)))
    torch.manual_seed(0)
    ebc = sbpflow.nn.EmbeddingBagCollection(TABLES, sparse=True,
                                            row_wise_min_bytes=1000 * 4 * 4)
    Ws = [ebc.embedding_bags[c["name"]].weight.to_torch().detach().clone()
          .requires_grad_(True) for c in TABLES]
    W0 = [w.detach().clone() for w in Ws]
    ebc.shard(pl, PLANS[plan])
    opt = _make_opt(name, ebc.parameters(), False)
    ref = _make_opt(name, Ws, True)
    touched = [torch.zeros(w.shape[0], dtype=torch.bool) for w in Ws]
    for step in range(steps):
        feats_all = [_features(r, seed=step + 1) for r in range(n)]
        loss_ref = 0
        for c, W in zip(TABLES, Ws):
            for f in c.get("feature_names", (c["name"],)):
                pooled = torch.cat([
                    TF.embedding_bag(_bag_args(fa[f])[0], W, _bag_args(fa[f])[1],
                                     mode=c["pooling"], sparse=True,
                                     per_sample_weights=_bag_args(fa[f])[2],
                                     padding_idx=c.get("padding_idx")) for fa in feats_all])
                loss_ref = loss_ref + (pooled ** 2).sum()
        ref.zero_grad()
        loss_ref.backward()
        for t, W in enumerate(Ws):
            rows = W.grad.coalesce().indices()[0]
            touched[t][rows] = True
            if name == "adamw":
                with torch.no_grad():
                    W[rows] *= 1 - 0.05 * 0.1
        ref.step()
        out = ebc(feats_all[rank])
        loss = sum((o ** 2).sum() for o in out.values())
        opt.zero_grad()
        loss.backward()
        opt.step()
    ok = []
    for c, W, w0, tch in zip(TABLES, Ws, W0, touched):
        w = ebc.embedding_bags[c["name"]].weight
        if w.placement.coord() is None:
            continue
        sl = w.placement.shard_slices(tuple(w.shape), w.sbp)[0]
        mine = w.to_local().to_torch().detach()
        t_mine, w_ref, w_init = tch[sl], W.detach()[sl], w0[sl]
        _close(mine[t_mine], w_ref[t_mine], rtol=1e-5, atol=1e-6)
        ok.append(bool(torch.equal(mine[~t_mine], w_init[~t_mine])))  # bit-identical
        ok.append(bool((mine[t_mine] != w_init[t_mine]).any()) or not t_mine.any())
    return ok


def _bag_args(feat):
    if isinstance(feat, torch.Tensor):
        return feat, None, None
    return (feat[0], feat[1], feat[2] if len(feat) == 3 else None)


def _psw(feat):
    return _bag_args(feat)[2]


@pytest.mark.parametrize("name", ["sgd", "adagrad", "adam", "adamw"])
def test_sparse_optimizers_touch_only_looked_up_rows(dist_run, name):
    res = dist_run(2, _optim_case, name, "rule")
    assert all(all(r) for r in res), res


# ---------------------------------------------------------------- collectives
def _exchange_bytes(V: int):
    """Collectives of a row-split lookup of the same ids in a table of V rows."""
    torch.set_num_threads(1)
    n, rank = sbpflow.distributed.get_world_size(), sbpflow.distributed.get_rank()
    pl = sbpflow.placement("cpu", list(range(n)))
    D = 4
    w = sbpflow.zeros(V, D, placement=pl, sbp=S0).requires_grad_(True)
    ids, offs = _rank_bags(rank, 50, nbags=4, seed=3)  # ids < 50 <= V
    ids = torch.cat([ids, ids[:3]])  # more repeats
    with CommRecorder() as fwd:
        out = F.embedding_bag(sbpflow.from_torch(ids), w, sbpflow.from_torch(offs),
                              mode="sum", sparse=True)
    loss = out.sum()
    with CommRecorder() as bwd:
        loss.backward()
    a2a = [r.bytes for r in fwd.records if r.kind == "all_to_all"]
    a2a_b = [r.bytes for r in bwd.records if r.kind == "all_to_all"]
    return (fwd.kinds(), bwd.kinds(), a2a, a2a_b, ids.unique().numel(),
            w.grad.to_local().to_torch()._nnz())


def test_lookup_collectives_scale_with_unique_ids(dist_run):
    small, big = dist_run(2, _exchange_bytes, 50), dist_run(2, _exchange_bytes, 100_000)
    for (fk, bk, a2a, a2a_b, k, _), (fk2, bk2, a2a2, a2a_b2, k2, _) in zip(small, big):
        # one all-gather of counts, two all-to-alls forward (ids, rows), two backward
        assert fk == ["all_gather", "all_to_all", "all_to_all"], fk
        assert bk == ["all_to_all", "all_to_all"], bk
        # this rank sends its K unique ids (int64) and receives their rows back; the bytes
        # it sends are the ids and the rows others asked of it: nothing grows with V
        assert a2a[0] == 8 * k and a2a_b[0] == 8 * k, (a2a, k)
        assert a2a_b[1] == 4 * 4 * k, (a2a_b, k)  # row gradients of its K unique ids
        assert (fk2, bk2) == (fk, bk)
        assert (a2a[0], a2a_b) == (a2a2[0], a2a_b2) and k == k2, (a2a, a2a2)
    # forward, each owner sends the rows asked of it (which rank owns an id depends on V,
    # the total does not): 4 float32 per unique id of every rank
    for res in (small, big):
        assert sum(r[2][1] for r in res) == 4 * 4 * sum(r[4] for r in res), res


# ---------------------------------------------------------------- local: exactly torch
@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_local_embedding_bag_is_torch(mode):
    torch.manual_seed(1)
    kw = dict(mode=mode, padding_idx=2, include_last_offset=True)
    ref = torch.nn.EmbeddingBag(9, 3, **kw)
    m = sbpflow.nn.EmbeddingBag(9, 3, **kw)
    with torch.no_grad():
        m.weight.to_torch().copy_(ref.weight)
    ids = torch.tensor([1, 2, 2, 8, 0, 5, 2])
    offs = torch.tensor([0, 3, 3, 5, 7])  # an empty bag, a bag of padding and ids
    psw = torch.rand(7) if mode == "sum" else None
    want = ref(ids, offs, psw)
    got = m(sbpflow.from_torch(ids), sbpflow.from_torch(offs),
            None if psw is None else sbpflow.from_torch(psw))
    assert torch.equal(got.to_torch(), want)
    want.sum().backward()
    got.sum().backward()
    assert torch.equal(m.weight.grad.to_torch(), ref.weight.grad)
    # 2-D input, sparse gradient (not with max: torch's rule)
    sparse = mode != "max"
    ref2 = torch.nn.EmbeddingBag.from_pretrained(ref.weight.detach(), freeze=False, mode=mode,
                                                 sparse=sparse)
    m2 = sbpflow.nn.EmbeddingBag.from_pretrained(sbpflow.from_torch(ref.weight.detach()),
                                                 freeze=False, mode=mode, sparse=sparse)
    x = torch.tensor([[1, 4], [4, 4], [0, 8]])
    ref2(x).pow(2).sum().backward()
    m2(sbpflow.from_torch(x)).pow(2).sum().backward()
    g = m2.weight.grad.to_torch()
    assert g.is_sparse == sparse and torch.equal(g.to_dense(), ref2.weight.grad.to_dense())


# ---------------------------------------------------------------- column split, 2-D ids
def _columns_case(ids_layout: str, mode: str):
    torch.set_num_threads(1)
    n = sbpflow.distributed.get_world_size()
    pl = sbpflow.placement("cpu", list(range(n)))
    g = torch.Generator().manual_seed(11)
    W = torch.randn(37, 5, generator=g)  # 5 columns over 2 or 4 ranks: uneven
    X = torch.randint(0, 37, (2 * n, 3), generator=g)
    X[0, 1] = X[0, 0]
    G = torch.randn(2 * n, 5, generator=g)
    Wt = W.clone().requires_grad_(True)
    ref = TF.embedding_bag(X, Wt, mode=mode, padding_idx=4)
    (ref * G).sum().backward()
    outs = []
    for layout in ("S1", "S0", "B"):
        w = sbpflow.tensor(W, placement=pl, sbp=LAYOUTS[layout], requires_grad=True)
        x = sbpflow.tensor(X, placement=pl, sbp=LAYOUTS[ids_layout])
        out = F.embedding_bag(x, w, mode=mode, padding_idx=4)
        _close(torch.from_numpy(out.numpy()), ref)
        (out * sbpflow.tensor(G, placement=pl, sbp=out.sbp)).sum().backward()
        _close(torch.from_numpy(w.grad.numpy()), Wt.grad)
        outs.append(str(out.sbp))
    return outs


@pytest.mark.parametrize("n", [2, 4])
def test_global_2d_ids_every_table_layout(dist_run, n):
    for ids_layout in ("S0", "B"):
        for mode in ("sum", "mean", "max"):
            res = dist_run(n, _columns_case, ids_layout, mode)
            want = ["(S(1),)", f"({'S(0)' if ids_layout == 'S0' else 'B'},)"] * 1
            assert res[0][0] == want[0] and res[0][1] == res[0][2] == want[1], res[0]


def _ragged_broadcast_case():
    """Global 1-D ids with offsets laid out B (torch's ragged form; issue 21): every
    table layout, every mode, per_sample_weights, an empty bag, include_last_offset."""
    torch.set_num_threads(1)
    n = sbpflow.distributed.get_world_size()
    pl = sbpflow.placement("cpu", list(range(n)))
    g = torch.Generator().manual_seed(5)
    W = torch.randn(37, 5, generator=g)
    ids = torch.randint(0, 37, (11,), generator=g)
    offsets = torch.tensor([0, 3, 3, 7])  # bag 1 is empty
    psw = torch.rand(11, generator=g)
    G = torch.randn(4, 5, generator=g)
    outs = []
    for mode, weights, last in (("sum", False, False), ("mean", False, False),
                                ("max", False, False), ("sum", True, False),
                                ("sum", False, True)):
        offs = torch.cat([offsets, torch.tensor([11])]) if last else offsets
        Wt = W.clone().requires_grad_(True)
        ref = TF.embedding_bag(ids, Wt, offs, mode=mode, include_last_offset=last,
                               per_sample_weights=psw if weights else None)
        (ref * G).sum().backward()
        for layout in ("S1", "S0", "B"):
            w = sbpflow.tensor(W, placement=pl, sbp=LAYOUTS[layout], requires_grad=True)
            out = F.embedding_bag(
                sbpflow.tensor(ids, placement=pl, sbp=B), w,
                sbpflow.tensor(offs, placement=pl, sbp=B), mode=mode, include_last_offset=last,
                per_sample_weights=sbpflow.tensor(psw, placement=pl, sbp=B) if weights else None)
            _close(torch.from_numpy(out.numpy()), ref)
            (out * sbpflow.tensor(G, placement=pl, sbp=out.sbp)).sum().backward()
            _close(torch.from_numpy(w.grad.numpy()), Wt.grad)
            outs.append((layout, str(out.sbp)))
    return outs


def test_global_1d_ids_with_offsets_laid_out_broadcast(dist_run):
    for outs in dist_run(2, _ragged_broadcast_case):
        assert all(sbp == ("(S(1),)" if layout == "S1" else "(B,)") for layout, sbp in outs)


# ---------------------------------------------------------------- bad input
def _errors():
    torch.set_num_threads(1)
    n, rank = sbpflow.distributed.get_world_size(), sbpflow.distributed.get_rank()
    pl = sbpflow.placement("cpu", list(range(n)))
    torch.manual_seed(0)
    ebc = sbpflow.nn.EmbeddingBagCollection(TABLES, pl, row_wise_min_bytes=1000 * 4 * 4)
    msgs = []
    feats = _features(rank)
    if rank == 1:  # an id out of range on one rank only: every rank raises
        feats["genre"] = (torch.tensor([3, 12, 1]), torch.tensor([0, 1, 1]),
                          torch.ones(3))
    try:
        ebc(feats)
    except IndexError as e:
        msgs.append(str(e))
    w = sbpflow.zeros(10, 3, placement=pl, sbp=S0, requires_grad=True)
    ids = sbpflow.from_torch(torch.tensor([1, 2, -1 if rank == 0 else 3]))
    try:
        F.embedding_bag(ids, w, sbpflow.from_torch(torch.tensor([0])), mode="sum")
    except IndexError as e:
        msgs.append(str(e))
    i1, o1 = sbpflow.from_torch(torch.tensor([1, 2, 3])), sbpflow.from_torch(torch.tensor([0]))
    cases = [
        dict(offsets=sbpflow.from_torch(torch.tensor([1, 2])), mode="sum"),  # not from 0
        dict(offsets=sbpflow.from_torch(torch.tensor([0, 2, 1])), mode="sum"),  # decreasing
        dict(offsets=None, mode="sum"),  # 1-D ids without offsets
        dict(offsets=o1, mode="max", per_sample_weights=sbpflow.ones(3)),
        dict(offsets=o1, mode="avg"),
    ]
    for kw in cases:
        try:
            F.embedding_bag(i1, w, **kw)
        except (ValueError, NotImplementedError) as e:
            msgs.append(f"{type(e).__name__}: {e}")
    try:
        F.embedding_bag(sbpflow.from_torch(torch.tensor([[1, 2]])), w, o1)
    except ValueError as e:
        msgs.append(str(e))
    try:  # features with different bag counts
        bad = _features(rank)
        bad["user"] = bad["user"][:2]
        ebc(bad)
    except ValueError as e:
        msgs.append(str(e))
    # bad bags on one rank only: every rank raises (none waits for the collective timeout)
    for call in (lambda o: F.embedding_bag(i1, w, o, mode="sum"),
                 lambda o: ebc(dict(_features(rank), item=(torch.tensor([1, 2, 3]),
                                                           o.to_torch())))):
        try:
            call(sbpflow.from_torch(torch.tensor([0, 1, 2] if rank == 0 else [0, 3, 1])))
        except ValueError as e:
            msgs.append(str(e))
    return msgs


def test_bad_input_raises_on_every_rank(dist_run):
    res = dist_run(2, _errors)
    for rank, msgs in enumerate(res):
        assert len(msgs) == 11, msgs
        for m in msgs[9:]:
            assert ("offsets[1] = 3 > offsets[2] = 1" in m) if rank == 1 else \
                ("the input of rank(s) [1] is invalid" in m), m
        assert "id 12 of table 'genre' (on rank 1) is out of range for its 10 rows" in msgs[0]
        assert "id -1" in msgs[1] and "(on rank 0)" in msgs[1] and "10 rows" in msgs[1]
        assert "offsets[0] has to be 0" in msgs[2] and "got 1" in msgs[2]
        assert "offsets[1] = 2 > offsets[2] = 1" in msgs[3]
        assert "offsets has to be a 1D Tensor but got None" in msgs[4]
        assert msgs[5].startswith("NotImplementedError") and "mode='max'" in msgs[5]
        assert "'avg'" in msgs[6]
        assert "offsets has to be None" in msgs[7]
        assert "same number of bags" in msgs[8] and "'user': 2" in msgs[8]


def _replicated_errors():
    """Bad ids or bags on rank 1 only, with replicated (B) tables: what each rank raised,
    and the collectives of a good lookup."""
    torch.set_num_threads(1)
    n, rank = sbpflow.distributed.get_world_size(), sbpflow.distributed.get_rank()
    pl = sbpflow.placement("cpu", list(range(n)))
    torch.manual_seed(0)
    w = sbpflow.randn(10, 3, placement=pl, sbp=B, requires_grad=True)
    rep = sbpflow.nn.EmbeddingBagCollection(TABLES, pl, sharding={
        "user": "replicated", "item": "replicated", "genre": "replicated"})
    mixed = sbpflow.nn.EmbeddingBagCollection(TABLES, pl, sharding=PLANS["mixed"])
    ids, offs = sbpflow.from_torch(torch.tensor([1, 2, 3])), torch.tensor([0, 1, 2])
    x = sbpflow.tensor(torch.tensor([[1, 2], [3, 3], [0, 9], [4, 5]]), placement=pl, sbp=S0)
    if rank == 1:
        x._local[0, 1] = 12  # rank 1's shard of global ids
    bad_offs = sbpflow.from_torch(offs if rank == 0 else torch.tensor([0, 3, 1]))
    feats = _features(rank)
    bad_genre = dict(feats, genre=(torch.tensor([3, 12, 1]), torch.tensor([0, 1, 1]),
                                   torch.ones(3)) if rank == 1 else feats["genre"])
    bad_item = dict(feats, item=(torch.tensor([1, 40, 3]), torch.tensor([0, 1, 1]))
                    if rank == 1 else feats["item"])
    bad_bags = dict(feats, item=(torch.tensor([1, 2, 3]), bad_offs.to_torch()))
    calls = [lambda: F.embedding_bag(ids, w, bad_offs, mode="sum"),
             lambda: F.embedding_bag(x, w, mode="sum"),
             lambda: rep(bad_bags),
             lambda: rep(bad_genre),
             lambda: mixed(bad_item)]  # replicated item: checked with row-wise genre's counts
    msgs = []
    for call in calls:
        try:
            call()
            msgs.append("no error")
        except (ValueError, IndexError) as e:
            msgs.append(f"{type(e).__name__}: {e}")
    kinds = []
    for call in (lambda: F.embedding_bag(ids, w, sbpflow.from_torch(offs), mode="sum"),
                 lambda: rep(feats)):
        with CommRecorder(include_metadata=True) as rec:
            out = call()
        kinds.append([k for k in rec.kinds() if k != "check"])
    assert out["genre"].shape == (3 * n, 2)
    return msgs, kinds


def test_replicated_tables_raise_bad_input_on_every_rank(dist_run):
    """A bad id or bag on one rank with a replicated table raises the real cause on every
    rank (issue 20: the others got a mismatch at their next collective): the rank joins
    the lookup's one all-gather with an error flag, as the row-split exchange does."""
    res = dist_run(2, _replicated_errors)
    for rank, (msgs, kinds) in enumerate(res):
        for i in (0, 2):  # bad offsets: rank 1 raises its own error, rank 0 names rank 1
            assert ("offsets[1] = 3 > offsets[2] = 1" in msgs[i]) if rank == 1 else \
                ("the input of rank(s) [1] is invalid" in msgs[i]), (i, msgs[i])
        assert msgs[1].startswith("IndexError: embedding_bag: id 12 ") and \
            "(on rank 1) is out of range for its 10 rows" in msgs[1], msgs[1]
        assert msgs[3].startswith("IndexError: EmbeddingBagCollection: id 12 of table "
                                  "'genre' (on rank 1) is out of range for its 10 rows"), msgs[3]
        assert msgs[4].startswith("IndexError: EmbeddingBagCollection: id 40 of table "
                                  "'item' (on rank 1) is out of range for its 37 rows"), msgs[4]
        # per-rank ids on a B table: the id check and the bag counts in one all-gather
        assert kinds == [["all_gather"], ["all_gather"]], kinds


# ---------------------------------------------------------------- nn.Graph
class _LookupStep(sbpflow.nn.Graph):
    """One SGD (lr 1) step of ``sum(bag(x, psw) * g)``: returns the pooled bags."""

    def __init__(self, m, opt):
        super().__init__()
        self.m = m
        self.add_optimizer(opt)

    def build(self, x, psw, g):
        out = self.m(x, per_sample_weights=psw)
        (out * g).sum().backward()
        return out


def _graph_case(mesh: tuple):
    """Global 2-D bags inside nn.Graph (the registered ``nn.embedding_bag``): every table
    layout on every mesh axis, every mode, weights, a padding id; the pooled bags and the
    weight after one SGD step against torch's. Returns the output layouts."""
    torch.set_num_threads(1)
    n = sbpflow.distributed.get_world_size()
    pl = sbpflow.placement("cpu", torch.arange(n).reshape(mesh))
    g = torch.Generator().manual_seed(2)
    V, D = 11, 4
    W = torch.randn(V, D, generator=g)
    X = torch.randint(0, V, (8, 3), generator=g)
    X[1] = 4  # a bag of padding ids only: zeros, no gradient
    P = torch.rand(8, 3, generator=g)
    G = torch.randn(8, D, generator=g)
    layouts = [(S0,), (S1,), (B,)] if len(mesh) == 1 else [(S0, S1), (S1, S0), (B, S0),
                                                            (S0, S0)]
    seen = []
    for mode in ("sum", "mean", "max"):
        psw = mode == "sum"
        Wt = W.clone().requires_grad_(True)
        ref = TF.embedding_bag(X, Wt, mode=mode, per_sample_weights=P if psw else None,
                               padding_idx=4)
        (ref * G).sum().backward()
        for layout in layouts:
            m = sbpflow.nn.EmbeddingBag(V, D, mode=mode, padding_idx=4)
            with torch.no_grad():
                m.weight.copy_(sbpflow.tensor(W))
            m = m.to_global(pl, layout)
            step = _LookupStep(m, sbpflow.optim.SGD(m.parameters(), lr=1.0))
            data = [(S0,) + (B,) * (len(mesh) - 1)] * 3
            x, p, gg = (sbpflow.tensor(t, placement=pl, sbp=sb) for t, sb in zip((X, P, G), data))
            out = step(x, p if psw else None, gg)
            _close(torch.from_numpy(out.numpy()), ref)
            _close(torch.from_numpy(m.weight.numpy()), W - Wt.grad)
            seen.append((mode, str(layout), str(out.sbp)))
    return seen


@pytest.mark.parametrize("mesh", [(2,), (2, 2)])
def test_graph_mode(dist_run, mesh):
    seen = dist_run(math.prod(mesh), _graph_case, mesh)[0]
    assert len(seen) == 3 * (3 if len(mesh) == 1 else 4), seen


def _graph_bad_id_case(op: str):
    """A graph step (row-split table) called with good ids, then with an id past the
    table: the program checks its ids at every call (the check was once pruned as dead
    code after the first call, and the bad id silently pooled nothing)."""
    torch.set_num_threads(1)
    pl = sbpflow.placement("cpu", [0, 1])
    m = (sbpflow.nn.EmbeddingBag(10, 3, mode="mean") if op == "bag" else
         sbpflow.nn.Embedding(10, 3)).to_global(pl, S0)
    step = _LookupStep(m, sbpflow.optim.SGD(m.parameters(), lr=0.1)) if op == "bag" else \
        _EmbedStep(m, sbpflow.optim.SGD(m.parameters(), lr=0.1))
    ids = torch.tensor([[1, 2], [3, 3], [0, 9], [4, 5]])
    g = sbpflow.tensor(torch.ones(4, 3), placement=pl, sbp=S0)
    step(sbpflow.tensor(ids, placement=pl, sbp=S0), None, g)
    ids[2, 1] = 10
    try:
        step(sbpflow.tensor(ids, placement=pl, sbp=S0), None, g)
    except RuntimeError as e:
        return str(e)
    return None


class _EmbedStep(_LookupStep):
    def build(self, x, psw, g):
        out = self.m(x).sum(1)
        (out * g).sum().backward()
        return out


@pytest.mark.parametrize("op", ["bag", "embedding"])
def test_graph_checks_ids_at_every_call(dist_run, op):
    for msg in dist_run(2, _graph_bad_id_case, op):  # every rank: the ids are gathered
        assert msg is not None and "out of range for 10 embeddings" in msg, msg


def _mesh_eager_case():
    """Eagerly on a 2-D mesh (the registered op: the per-rank exchange is 1-D only)."""
    torch.set_num_threads(1)
    pl = sbpflow.placement("cpu", [[0, 1], [2, 3]])
    g = torch.Generator().manual_seed(3)
    W = torch.randn(9, 4, generator=g)
    X = torch.randint(0, 9, (4, 2), generator=g)
    G = torch.randn(4, 4, generator=g)
    Wt = W.clone().requires_grad_(True)
    ref = TF.embedding_bag(X, Wt, mode="mean")
    (ref * G).sum().backward()
    w = sbpflow.tensor(W, placement=pl, sbp=(S0, S1), requires_grad=True)
    out = F.embedding_bag(sbpflow.tensor(X, placement=pl, sbp=(S0, B)), w, mode="mean")
    _close(torch.from_numpy(out.numpy()), ref)
    (out * sbpflow.tensor(G, placement=pl, sbp=out.sbp)).sum().backward()
    _close(torch.from_numpy(w.grad.numpy()), Wt.grad)
    return str(out.sbp), str(w.grad.sbp)


def test_split_table_on_a_2d_mesh_eagerly(dist_run):
    out_sbp, grad_sbp = dist_run(4, _mesh_eager_case)[0]
    assert (out_sbp, grad_sbp) == ("(P, S(1))", "(S(0), S(1))")  # the rows pooled per rank


@pytest.mark.exhaustive
@pytest.mark.parametrize("n", [2, 4])
def test_bag_layouts_sweep(dist_run, n):
    for layout in ("S0", "B"):
        for mode in ("sum", "mean", "max"):
            for sparse in ((False, True) if layout == "S0" and mode != "max" else (False,)):
                for psw in ((False, True) if mode == "sum" else (False,)):
                    for pad in (None, 0, 12):
                        for V in (3, 13, 200):  # V=3 on 4 ranks: a rank holds no row
                            pad_v = None if pad is None else min(pad, V - 1)
                            got = dist_run(n, _bag_case, layout, mode, V, 3, sparse, psw,
                                           pad_v)
                            assert all(r is None or all(r) for r in got), (layout, mode, got)


@pytest.mark.exhaustive
@pytest.mark.parametrize("n", [2, 4])
def test_collection_sweep(dist_run, n):
    for plan in PLANS:
        for sparse in (False, True):
            for concat in (False, True):
                fwd, bwd, _ = dist_run(n, _collection_case, plan, sparse, concat)[0]
                assert (fwd, bwd) == ((3, 3) if plan == "mixed" else (2, 2))


def _init_case():
    torch.set_num_threads(1)
    n = sbpflow.distributed.get_world_size()
    pl = sbpflow.placement("cpu", list(range(n)))
    torch.manual_seed(3)
    local = sbpflow.nn.EmbeddingBagCollection(TABLES)
    torch.manual_seed(3)
    sharded = sbpflow.nn.EmbeddingBagCollection(TABLES, pl, row_wise_min_bytes=1000 * 4 * 4)
    same = []
    for c in TABLES:
        w = sharded.embedding_bags[c["name"]].weight
        want = local.embedding_bags[c["name"]].weight.to_torch()
        same.append(bool(torch.equal(torch.from_numpy(w.numpy()), want)))
    return same, {k: v[0] for k, v in sharded.plan.items()}


def test_collection_built_sharded_holds_torch_init(dist_run):
    for same, plan in dist_run(4, _init_case):
        assert same == [True, True, True]
        assert plan == {"user": "row_wise", "item": "table_wise", "genre": "table_wise"}
