"""sbpflow.save / sbpflow.load: sharded safetensors + JSON, resharding on load (2x2 mesh ->
2 ranks -> 1 process), per-rank file sizes about the shard bytes, atomic commits under
SIGKILL at random points, and PyTorch/safetensors interchange."""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time

import numpy as np
import pytest
import torch
from _pool import run_isolated

import sbpflow
from sbpflow import nn
from sbpflow.sbp import broadcast as B
from sbpflow.sbp import partial_sum as P
from sbpflow.sbp import split

S0, S1 = split(0), split(1)


def _values(scale: float = 1.0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return {"w_rows": torch.randn(10, 6, generator=g) * scale,
            "w_cols": torch.randn(6, 9, generator=g) * scale,
            "w_rep": torch.randn(4, 4, generator=g) * scale,
            "w_part": torch.randn(7, 3, generator=g) * scale,
            "ids": torch.arange(12).reshape(3, 4) * int(scale)}


class _Model(nn.Module):
    def __init__(self, pl, layouts):
        super().__init__()
        for name, v in _values().items():
            t = sbpflow.tensor(v * 0, placement=pl, sbp=layouts[name])
            if name.startswith("w_") and name != "w_part":  # P: a buffer (not optimizable)
                setattr(self, name, nn.Parameter(t))
            else:
                self.register_buffer(name, t)


LAYOUTS_2X2 = {"w_rows": (S0, S0), "w_cols": (B, S1), "w_rep": (B, B), "w_part": (P, S0),
               "ids": (S1, B)}
LAYOUTS_2 = {"w_rows": S1, "w_cols": B, "w_rep": S0, "w_part": S0, "ids": P}


def _save_2x2(path):
    pl = sbpflow.placement("cpu", [[0, 1], [2, 3]])
    m = _Model(pl, LAYOUTS_2X2)
    m.load_state_dict(_values())
    opt = sbpflow.optim.AdamW(m.parameters(), lr=0.1)
    loss = sum((p * p).sum().to_global(sbp=(B, B)) for p in m.parameters())
    loss.backward()
    opt.step()
    sbpflow.save({"model": m.state_dict(), "optim": opt.state_dict(), "step": 7,
                  "note": ("a", 1.5, None)}, path)
    expect = {k: v.numpy() for k, v in m.state_dict().items()}
    exp_avg = {i: st["exp_avg"].numpy() for i, st in opt.state_dict()["state"].items()}
    return expect, exp_avg


def _load_2(path, expect, exp_avg):
    pl = sbpflow.placement.all("cpu")
    m = _Model(pl, LAYOUTS_2)
    ck = sbpflow.load(path)
    assert ck["step"] == 7 and ck["note"] == ("a", 1.5, None)
    m.load_state_dict(ck["model"])
    for k, v in m.state_dict().items():
        assert v.sbp == ((LAYOUTS_2[k]),), k
        assert np.array_equal(v.numpy(), expect[k]), k
    opt = sbpflow.optim.AdamW(m.parameters(), lr=0.1)
    opt.load_state_dict(ck["optim"])
    for i, st in opt.state_dict()["state"].items():
        assert np.array_equal(st["exp_avg"].numpy(), exp_avg[i])
    return "ok"


def test_save_2x2_load_on_2_and_1(dist_run, tmp_path):
    path = str(tmp_path / "ckpt")
    expect, exp_avg = dist_run(4, _save_2x2, path)[0]
    dist_run(2, _load_2, path, expect, exp_avg)
    # One process, no process group: whole values.
    ck = sbpflow.load(path)
    for k, v in ck["model"].items():
        assert np.array_equal(v.numpy(), expect[k]), k
    # Each rank's file holds about its shard bytes: (S0,S0) w_rows gives 10*6/4 rows...
    folder = os.path.join(path, open(os.path.join(path, "LATEST")).read().strip())
    sizes = [os.path.getsize(os.path.join(folder, f"rank-{r:05d}.safetensors"))
             for r in range(4)]
    meta = json.load(open(os.path.join(folder, "meta.json")))
    stored, whole = [0] * 4, 0
    for rec in meta["tensors"].values():
        item = torch.empty((), dtype=getattr(torch, rec["dtype"])).element_size()
        whole += item * int(np.prod(rec["shape"]))
        for piece in rec["pieces"]:
            stored[piece["rank"]] += item * int(np.prod([b - a for a, b in piece["ranges"]]))
    assert sum(stored) == whole  # every element written exactly once: B and P included
    for r in range(4):
        assert stored[r] <= sizes[r] <= stored[r] + 4096, (r, stored, sizes)
        assert stored[r] < 0.5 * sum(stored), stored  # nobody holds everything


def _save_versions(path, n):
    pl = sbpflow.placement.all("cpu")
    for step in range(n):
        m = _Model(pl, LAYOUTS_2)
        m.load_state_dict(_values(step + 1.0))
        sbpflow.save({"model": m.state_dict(), "step": step}, path, keep=2)
    return "ok"


def test_versions_and_keep(dist_run, tmp_path):
    path = str(tmp_path / "ck")
    dist_run(2, _save_versions, path, 3)
    assert sorted(d for d in os.listdir(path) if not d.startswith(".")) == [
        "LATEST", "v000002", "v000003"]
    ck = sbpflow.load(path)
    assert ck["step"] == 2
    assert np.array_equal(ck["model"]["w_rows"].numpy(), _values(3.0)["w_rows"].numpy())


def _save_then_die(path, victim, delay, big):
    pl = sbpflow.placement.all("cpu")
    g = torch.Generator().manual_seed(0)
    w = sbpflow.tensor(torch.randn(big, 64, generator=g), placement=pl, sbp=S0)
    sbpflow.save({"w": w, "step": 0}, path)
    if sbpflow.distributed.get_rank() == victim:
        def die():
            time.sleep(delay)
            os.kill(os.getpid(), signal.SIGKILL)

        threading.Thread(target=die, daemon=True).start()
    for step in range(1, 200):
        sbpflow.save({"w": w * step, "step": step}, path)
    return "survived"


@pytest.mark.parametrize("seed", range(4))
def test_sigkill_during_save_leaves_previous_loadable(tmp_path, seed):
    rng = random.Random(seed)
    path = str(tmp_path / "ck")
    victim, delay = rng.randrange(2), rng.uniform(0.0, 0.4)
    outcomes = run_isolated(2, _save_then_die, path, victim, delay, 20000, timeout=60,
                            env={"SBPFLOW_TIMEOUT": "3"})
    assert outcomes[victim].status != "ok", outcomes  # it really died mid-run
    ck = sbpflow.load(path)
    step = ck["step"]
    w0 = torch.randn(20000, 64, generator=torch.Generator().manual_seed(0))
    assert torch.equal(ck["w"].full(), w0 * max(step, 1)), step


def test_torch_and_safetensors_files(tmp_path):
    t = torch.nn.Linear(4, 3)
    torch.save(t.state_dict(), tmp_path / "m.pt")
    ck = sbpflow.load(tmp_path / "m.pt")
    assert torch.equal(ck["weight"].to_torch(), t.weight.detach())
    sd = {"a": sbpflow.ones(2, 3), "b": sbpflow.tensor([1, 2])}
    sbpflow.save(sd, tmp_path / "x.safetensors")
    back = sbpflow.load(tmp_path / "x.safetensors")
    assert torch.equal(back["a"].to_torch(), torch.ones(2, 3))
    sbpflow.save(sd, tmp_path / "x.pt")
    assert torch.equal(torch.load(tmp_path / "x.pt", weights_only=True)["b"], torch.tensor([1, 2]))
    with pytest.raises(FileNotFoundError, match="no complete sbpflow checkpoint"):
        os.makedirs(tmp_path / "empty")
        sbpflow.load(tmp_path / "empty")
    with pytest.raises(TypeError, match="cannot store a set"):
        sbpflow.save({"x": {1, 2}}, tmp_path / "bad")
    with pytest.raises(TypeError, match="flat dict of tensors"):
        sbpflow.save({"x": {"y": sbpflow.ones(1)}}, tmp_path / "nested.safetensors")


def test_torch_state_dict_into_sbpflow_module_and_back(tmp_path):
    torch.manual_seed(0)
    t = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    torch.save(t.state_dict(), tmp_path / "t.pt")
    s = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3))
    s.load_state_dict(sbpflow.load(tmp_path / "t.pt"))
    x = torch.randn(2, 4)
    assert np.allclose(s(sbpflow.tensor(x)).numpy(), t(x).detach().numpy(), atol=1e-6)
    sbpflow.save(s.state_dict(), tmp_path / "s.safetensors")  # export back to torch
    t2 = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    from safetensors.torch import load_file

    t2.load_state_dict(load_file(tmp_path / "s.safetensors"))
    assert torch.equal(t2[0].weight, t[0].weight)
