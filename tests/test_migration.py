"""Migration: the nanoGPT-style model file written for PyTorch runs under sbpflow with
only its import lines switched, with sbpflow tensors all the way through (training steps
equal to torch's, param groups, AdamW, top-k sampling with torch.multinomial)."""

from __future__ import annotations

import numpy as np
import torch
from _models import GPT_TP_PLAN, load_gpt

import sbpflow
from sbpflow.nn.parallel import parallelize_module
from sbpflow.sbp import broadcast as B

CFG = dict(block_size=16, vocab_size=40, n_layer=2, n_head=4, n_embd=32, dropout=0.1)


def _pair():
    tg, sg = load_gpt("torch"), load_gpt("sbpflow")
    torch.manual_seed(0)
    tm = tg.GPT(tg.GPTConfig(**CFG))
    sbpflow.manual_seed(0)
    sm = sg.GPT(sg.GPTConfig(**CFG))
    return tm, sm


def _steps(sm, tm, pl=None, steps=4):
    g = torch.Generator().manual_seed(3)
    topt = tm.configure_optimizers(0.1, 3e-3, (0.9, 0.95), "cpu")
    sopt = sm.configure_optimizers(0.1, 3e-3, (0.9, 0.95), "cpu")
    assert isinstance(sopt, sbpflow.optim.AdamW) and len(sopt.param_groups) == 2
    losses = []
    for step in range(steps):
        x = torch.randint(0, CFG["vocab_size"], (4, 16), generator=g)
        y = torch.randint(0, CFG["vocab_size"], (4, 16), generator=g)
        torch.manual_seed(step)  # dropout masks: layout-invariant, equal to torch's
        _, tl = tm(x, y)
        sbpflow.manual_seed(step)
        if pl is None:
            logits, sl = sm(sbpflow.tensor(x), sbpflow.tensor(y))
        else:
            with sbpflow.default_placement(pl):
                logits, sl = sm(sbpflow.tensor(x, placement=pl, sbp=B),
                                sbpflow.tensor(y, placement=pl, sbp=B))
        assert isinstance(logits, sbpflow.Tensor) and isinstance(sl, sbpflow.Tensor)
        for opt, loss in ((topt, tl), (sopt, sl)):
            opt.zero_grad()
            loss.backward()
            opt.step()
        losses.append((sl.item(), tl.item()))
    for a, b in losses:
        assert abs(a - b) <= 1e-5 * abs(b), losses
    return losses


def test_gpt_file_runs_unchanged_under_sbpflow():
    tm, sm = _pair()
    assert sm.get_num_params() == tm.get_num_params()
    assert sm.transformer.wte.weight is sm.lm_head.weight  # tying survived
    _steps(sm, tm)
    sm.eval()
    sbpflow.manual_seed(5)
    out = sm.generate(sbpflow.zeros(2, 1, dtype=sbpflow.long), 6, temperature=0.8, top_k=5)
    tm.eval()
    torch.manual_seed(5)
    ref = tm.generate(torch.zeros(2, 1, dtype=torch.long), 6, temperature=0.8, top_k=5)
    assert isinstance(out, sbpflow.Tensor) and tuple(out.shape) == (2, 7)
    assert np.array_equal(out.numpy(), ref.numpy())  # sampling follows torch's draws


def _tp_steps():
    pl = sbpflow.placement.all("cpu")
    tm, sm = _pair()
    parallelize_module(sm, pl, GPT_TP_PLAN)
    return _steps(sm, tm, pl)


def test_gpt_file_tensor_parallel_on_2_ranks(dist_run):
    dist_run(2, _tp_steps)
