"""nn.Graph on the model zoo's BERT and ResNet (issue 11's equivalence gate; GPT is
tests/test_graph.py): bert-mini and resnet18-digits, made small, trained 20 steps as a
graph give the eager losses, parameters and buffers (1e-5 relative, test_graph's
``_close``), and eager follows one-process plain PyTorch (the model file's torch twin,
losses within 1e-4), in

* DP(2) for both (and the eager run follows torch); TP(2) and DP x TP (2x2, 4 ranks)
  for bert-mini (its Megatron plan).
  resnet18-digits has no tensor-parallel plan (the zoo registers it data parallel only:
  a convolution's activations dwarf its weights), so it runs no TP case;
* ZeRO stage 1, 2 and 3 on DP(2), against the eager data-parallel run;
* gradient accumulation over 4 micro-batches on DP(2), against eager accumulation over
  the same micro-batches (test_graph's ``_eager_accumulate``; BatchNorm's statistics and
  BERT's masked-token mean are per micro-batch, so the whole batch's step is not the
  oracle here);
* activation checkpointing of every block: bert-mini's encoder blocks on TP(2) with
  dropout 0.1 (the recomputation redraws the forward's masks and re-runs the Megatron
  all-reduces), resnet18-digits' BasicBlocks on DP(2) (their BatchNorm layers must not
  update the running statistics a second time when recomputed).

Both train with AdamW as ``sbpflow train`` sets it up for their task (lr 1e-3 / 2e-3,
betas (0.9, 0.95), weight decay on matrices): test_graph's lr 1e-2 makes this BERT's
training chaotic (eager DP(2) and one-process torch part by 2% within 20 steps), which
no equivalence test can check. The default suite runs bert-mini DP and resnet18-digits
DP; the rest is ``exhaustive`` (each graph case costs a trace of the whole step). The
eager runs are shared between the cases that use them (one per model, layout and
options, per session).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _models import world_placement
from test_graph import _close, _run
from test_models import BERT_SMALL, _images, _loss, _mlm_batch

import sbpflow
from sbpflow import models
from sbpflow.apps.train import TASK_DEFAULTS
from sbpflow.nn.parallel import parallelize_module

STEPS = 20
EXH = pytest.mark.exhaustive


class _ZooCase:
    """A model of ``sbpflow.models`` as test_graph's ``_run`` trains it (its GPTCase's
    interface): small config ``small``, AdamW as ``sbpflow train`` sets it up, the
    task's loss."""

    name = ""
    small: dict = {}

    @property
    def spec(self):
        return models.get(self.name)

    def config(self, dropout: float) -> dict:
        return dict(self.small)

    def setup(self, layout: str, dropout: float = 0.0):
        sbpflow.manual_seed(0)
        m = self.spec.build(**self.config(dropout))
        pl = world_placement("dp" if layout == "one" else layout)
        parallelize_module(m, pl, self.spec.plan("tp" if layout in ("tp", "dp_tp") else "dp"),
                           tp_axis=-1)
        return m, pl, self.optimizer(sbpflow, m)

    def optimizer(self, lib, m):
        """AdamW as ``sbpflow train`` builds it for the task (its learning rate, weight
        decay on the matrices only, betas (0.9, 0.95)); ``lib`` sbpflow or torch."""
        d = TASK_DEFAULTS[self.spec.task]
        params = list(m.parameters())
        groups = [{"params": [p for p in params if p.ndim >= 2],
                   "weight_decay": d["weight_decay"]},
                  {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
        return lib.optim.AdamW(groups, lr=d["lr"], betas=(0.9, 0.95))

    def loss(self, m, x, y):
        return _loss(self.spec.task, m, x, y, sbpflow.nn.functional)

    def torch_run(self):
        """The same training in plain PyTorch on one process (the file's torch twin, the
        same initialisation): (losses, state_dict as numpy)."""
        torch.manual_seed(0)
        tm = self.spec.build_torch(**self.config(0.0))
        opt = self.optimizer(torch, tm)
        losses = []
        for x, y in self.batches():
            opt.zero_grad()
            loss = _loss(self.spec.task, tm, x, y, torch.nn.functional)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses, {k: v.detach().numpy() for k, v in tm.state_dict().items()}


class BertCase(_ZooCase):
    """bert-mini with test_models' BERT_SMALL (2 blocks, 32 positions) at half width
    (hidden 64, 4 heads, MLP 128), batches of 8 sequences of 16 tokens, ~30% of them
    masked (labelled)."""

    name = "bert-mini"
    small = dict(BERT_SMALL, hidden=64, intermediate=128)

    def config(self, dropout: float) -> dict:
        return dict(self.small, dropout=dropout)

    def batches(self):
        return [_mlm_batch(100 + i, 256, (8, 16)) for i in range(STEPS)]

    def blocks(self, m):
        return list(m.blocks)


class ResNetCase(_ZooCase):
    """resnet18-digits shortened to one BasicBlock per stage (4 blocks: the first without,
    the others with a downsampling shortcut; 11 BatchNorm layers) at width 8, on batches
    of 16 random 8x8 one-channel images (each DP rank's micro-batch of 2 still gives every
    BatchNorm layer more than one value per channel)."""

    name = "resnet18-digits"
    small = dict(width=8, layers=(1, 1, 1, 1))

    def config(self, dropout: float) -> dict:
        assert dropout == 0.0, "ResNet has no dropout"
        return dict(self.small)

    def batches(self):
        return [_images(100 + i, (16, 1, 8, 8)) for i in range(STEPS)]

    def blocks(self, m):
        return [blk for layer in (m.layer1, m.layer2, m.layer3, m.layer4) for blk in layer]


CASES = {"bert": BertCase(), "resnet": ResNetCase()}

_EAGER: dict = {}  # (model, layout, options) -> rank 0's eager result, once per session
_TORCH: dict = {}


def _world(layout: str) -> int:
    return 4 if layout == "dp_tp" else 2


def _eager(dist_run, model: str, layout: str, opts: dict | None = None):
    key = (model, layout, tuple(sorted((opts or {}).items())))
    if key not in _EAGER:
        _EAGER[key] = dist_run(_world(layout), _run, layout, "eager", opts, CASES[model],
                               timeout=600)[0]
    return _EAGER[key]


def _graph(dist_run, model: str, layout: str, opts: dict | None = None):
    return dist_run(_world(layout), _run, layout, "graph", opts, CASES[model], timeout=600)[0]


def _torch(model: str):
    if model not in _TORCH:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            _TORCH[model] = CASES[model].torch_run()
        finally:
            torch.set_num_threads(threads)
    return _TORCH[model]


# ====================================================================== layouts


@pytest.mark.parametrize("model, layout", [
    ("bert", "dp"), pytest.param("resnet", "dp", marks=EXH),
    pytest.param("bert", "tp", marks=EXH), pytest.param("bert", "dp_tp", marks=EXH)])
def test_graph_gives_the_eager_step_which_follows_torch(dist_run, model, layout):
    eager = _eager(dist_run, model, layout)
    graph = _graph(dist_run, model, layout)
    _close(graph, eager)
    want_losses, want_state = _torch(model)
    assert want_losses[-1] < want_losses[0]  # it trains
    for i, (a, b) in enumerate(zip(eager[0], want_losses)):
        assert abs(a - b) <= 1e-4 * abs(b), (i, a, b)
    assert set(eager[1]) == set(want_state)  # the same parameters and buffers
    if model == "resnet":  # BatchNorm's running statistics and counts are in the state
        with pytest.raises(ValueError, match="has no 'tp' plan"):
            CASES["resnet"].spec.plan("tp")  # data parallel only: no TP cases
        assert int(graph[1]["bn1.num_batches_tracked"]) == STEPS
        assert np.any(graph[1]["layer4.0.bn2.running_var"] != 1.0)


# ====================================================================== passes


@pytest.mark.parametrize("model", ["bert", "resnet"])
@pytest.mark.parametrize("stage", [1, 2, 3])
@EXH
def test_zero_stages_give_the_data_parallel_step(dist_run, model, stage):
    _close(_graph(dist_run, model, "dp", dict(zero=stage)), _eager(dist_run, model, "dp"))


@pytest.mark.parametrize("model", ["bert", "resnet"])
@EXH
def test_gradient_accumulation_gives_the_eager_accumulation(dist_run, model):
    opts = dict(acc=4)
    _close(_graph(dist_run, model, "dp", opts), _eager(dist_run, model, "dp", opts))


@pytest.mark.parametrize("model, layout, dropout", [("bert", "tp", 0.1), ("resnet", "dp", 0.0)])
@EXH
def test_activation_checkpointing_gives_the_eager_step(dist_run, model, layout, dropout):
    eager = _eager(dist_run, model, layout, dict(dropout=dropout) if dropout else None)
    graph = _graph(dist_run, model, layout, dict(ckpt=True, dropout=dropout))
    _close(graph, eager)
    if model == "resnet":  # one running-statistics update per step, none by recomputing
        assert int(graph[1]["layer2.0.bn1.num_batches_tracked"]) == STEPS
