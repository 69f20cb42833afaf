"""Pipeline parallelism: the test GPT split into stages inside an nn.Graph gives the
one-process PyTorch losses with each schedule and layout (PP2, PP4, PP2 x DP2, PP2 x TP2;
the tied embedding crosses stages), dropout included; zero-bubble (ZB-H1, the backward
split into input and weight gradients) gives 1F1B's losses and parameters; random delays
(tests/_delays.py) change nothing; a schedule that deadlocks is refused before any rank
runs; a stage rank that dies makes the other raise naming the transfer; 1F1B bounds the
live activations where GPipe holds all micro-batches'. The default suite runs one case
of each kind; ``-m exhaustive`` the rest."""

from __future__ import annotations

import pytest
import torch
from _delays import random_delays
from _models import GPT_TP_PLAN, load_gpt
from test_graph import _batches

import sbpflow
from sbpflow.graph import GraphModule
from sbpflow.nn.parallel import parallelize_module
from sbpflow.sbp import broadcast as B
from sbpflow.sbp import split

STEPS = 5


def _gpt(framework: str, n_layer: int = 2, dropout: float = 0.0):
    gpt = load_gpt(framework)
    (sbpflow if framework == "sbpflow" else torch).manual_seed(0)
    return gpt.GPT(gpt.GPTConfig(block_size=16, vocab_size=48, n_layer=n_layer, n_head=4,
                                 n_embd=64, dropout=dropout))


def _torch_losses(n_layer=2, steps=STEPS, dropout=0.0, micro=1, state=None, dp=1):
    """One-process PyTorch: the oracle. ``micro`` > 1: gradient accumulation over the
    batch's consecutive ``micro`` parts (each part's dropout masks drawn in turn, as the
    pipeline's forwards draw them); with ``dp`` > 1 micro-batch ``k`` is the ``k``-th part
    of each of the ``dp`` data-parallel shards, as nn.Graph cuts an ``S(0)`` batch
    (``passes.micro_batches``). ``state``: a list to append the final parameters to
    (name -> numpy)."""
    torch.set_num_threads(1)
    m = _gpt("torch", n_layer, dropout)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
    out = []
    for x, y in _batches(steps):
        opt.zero_grad()
        total = 0.0
        parts = [[torch.cat(ps) for ps in zip(*(shard.chunk(micro)
                                                 for shard in t.chunk(dp)))] for t in (x, y)]
        for xk, yk in zip(*parts):
            loss = m(xk, yk)[1] / micro
            loss.backward()
            total += loss.item()
        opt.step()
        out.append(total)
    if state is not None:
        state.append({k: v.detach().numpy().copy() for k, v in m.named_parameters()})
    return out


class _Train(sbpflow.nn.Graph):
    def __init__(self, m, opt, first):
        super().__init__()
        self.model, self.first = m, first
        self.add_optimizer(opt)

    def build(self, x, y):
        with sbpflow.default_placement(self.first):
            loss = self.model(x, y)[1]
        loss.backward()
        return loss


def _stage_of(i: int, n_layer: int, p: int) -> int:
    return i * p // n_layer


def _pipeline_losses(layout: str, schedule: str, micro: int, n_layer: int = 2,
                     steps: int = STEPS, dropout: float = 0.0, jitter_s: float = 0.0,
                     on_step=None, batch: int = 8, program: list | None = None,
                     virtual: int | None = None, oneflow_style: bool = False,
                     state: list | None = None, checkpointing: bool = False):
    """Train ``steps`` steps of the test GPT as a pipeline. ``layout``: ``"pp2"``,
    ``"pp4"`` (one rank per rank group), ``"pp2_dp2"``/``"pp2_tp2"`` (two rank groups of
    two ranks, data or tensor parallel inside each), ``"pp2_dp2_tp2"`` (two groups of a
    2 x 2 mesh). ``virtual``: model chunks (stages) per rank group, 2 by default with the
    interleaved schedule, else 1; stage ``s`` of the ``groups * virtual`` runs on rank
    group ``s % groups`` (OneFlow/Megatron interleaving). Embeddings go on stage 0, the
    blocks spread in order (:func:`_stage_of`), ln_f and lm_head on the last stage: the
    model needs at least ``groups * virtual - 2`` blocks. ``oneflow_style``: OneFlow's
    way: each stage's modules laid out with ``to_global`` first, ``set_stage(s)`` without
    a placement (the dropout, without parameters, takes its stage's), and an interleaved
    schedule without ``virtual_stages`` (inferred from the placements). ``state``: a
    list to append the final parameters to (name -> numpy, the whole values on every
    rank). ``checkpointing``: the blocks' activations recomputed in backward (their
    dropout masks redrawn from the saved generator state). Returns the losses."""
    torch.set_num_threads(1)
    if virtual is None:
        virtual = 2 if schedule == "interleaved" else 1
    groups = 4 if layout == "pp4" else 2  # rank groups (pipeline ranks)
    p = groups * virtual  # stages
    width = {"pp2_dp2": 2, "pp2_tp2": 2, "pp2_dp2_tp2": 4}.get(layout, 1)

    def stage_ranks(s):
        r = list(range((s % groups) * width, (s % groups + 1) * width))
        return [r[:2], r[2:]] if width == 4 else r  # DP x TP: a 2 x 2 mesh per stage

    pls = [sbpflow.placement("cpu", stage_ranks(s)) for s in range(p)]
    m = _gpt("sbpflow", n_layer, dropout)
    if layout in ("pp2_tp2", "pp2_dp2_tp2"):  # the later stages keep the layout on theirs
        parallelize_module(m, pls[0], GPT_TP_PLAN, tp_axis=-1)
    else:
        m.to_global(pls[0], B)
    t = m.transformer
    for blk in t.h if checkpointing else ():
        blk.to(GraphModule).activation_checkpointing = True
    stage_of = {t.wte: 0, t.wpe: 0, t.drop: 0, t.ln_f: p - 1, m.lm_head: p - 1}
    stage_of.update({blk: _stage_of(i, n_layer, p) for i, blk in enumerate(t.h)})
    for mod, s in stage_of.items():
        if oneflow_style and mod is not m.lm_head:
            if s:
                mod.to_global(pls[s], B)
            mod.to(GraphModule).set_stage(s)
        elif oneflow_style:  # lm_head's weight is wte's (tied, on stage 0): name the stage's
            mod.to(GraphModule).set_stage(s, pls[s])
        else:
            mod.to(GraphModule).set_stage(s, pls[s])
    opt = sbpflow.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
    g = _Train(m, opt, pls[0])
    g.config.set_gradient_accumulation_steps(micro)
    g.config.set_pipeline_schedule(schedule, virtual_stages=None if oneflow_style else virtual)
    data = {"pp2_dp2": split(0), "pp2_dp2_tp2": (split(0), B)}.get(layout, B)
    out = []
    with random_delays(jitter_s):  # the program compiles at the first call
        for i, (x, y) in enumerate(_batches(steps, batch)):
            if on_step is not None:
                on_step(i)
            xs = sbpflow.tensor(x, placement=pls[0], sbp=data)
            ys = sbpflow.tensor(y, placement=pls[-1], sbp=data)
            out.append(g(xs, ys).mean().item())  # one loss per micro-batch (OneFlow)
    if program is not None:  # the program, and what print(graph) shows
        program += [next(iter(g._programs.values())).gm, str(g)]
    if state is not None:  # numpy() is collective: every rank gets every stage's values
        state.append({k: v.numpy() for k, v in m.named_parameters()})
    return out


def _close(got, want, rtol=1e-4):
    for a, b in zip(got, want):
        assert abs(a - b) <= rtol * abs(b), (got, want)


@pytest.mark.parametrize("schedule", ["1f1b", pytest.param("gpipe", marks=pytest.mark.exhaustive)])
def test_two_stages_follow_torch(dist_run, schedule):
    """Two stages follow one-process torch; print(graph) shows each rank's schedule."""
    got = dist_run(2, _losses_and_text, "pp2", schedule, 4)
    _close(got[0][0], _torch_losses())
    first, last = got[0][1], got[1][1]
    assert f"2 stages on 2 rank groups, schedule {schedule}, 4 micro-batches; bubble " \
        "(theory) 0.250 of compute; rank 0 runs stage(s) 0" in first, first
    order = {"1f1b": ("F0@0 F1@0 B0@0 F2@0 B1@0 F3@0 B2@0 B3@0 U",
                      "F0@1 B0@1 F1@1 B1@1 F2@1 B2@1 F3@1 B3@1 U"),
             "gpipe": ("F0@0 F1@0 F2@0 F3@0 B0@0 B1@0 B2@0 B3@0 U",
                       "F0@1 F1@1 F2@1 F3@1 B0@1 B1@1 B2@1 B3@1 U")}[schedule]
    assert order[0] in first, first
    assert "rank 1 runs stage(s) 1" in last and order[1] in last, last
    # per micro-batch one activation forward and its gradient back; the tied embedding
    # once per step each way (its copy on stage 1 sums the micro-batches' gradients)
    assert got[0][2] == {"isend": 4 + 1, "irecv": 4 + 1}, got[0][2]
    assert got[1][2] == {"isend": 4 + 1, "irecv": 4 + 1}, got[1][2]


def _losses_and_text(*args):
    """The losses, print(graph) and the program's point-to-point transfers by kind."""
    from sbpflow.graph import passes

    box: list = []
    losses = _pipeline_losses(*args, program=box)
    kinds: dict = {}
    for n in box[0].graph.nodes:
        if n.target is passes._P2P:
            for op in n.args[0]:
                kinds[op] = kinds.get(op, 0) + 1
    return losses, box[1], kinds


def _run_with_state(layout: str, schedule: str, micro: int, n_layer: int = 2,
                    steps: int = STEPS):
    """The losses, the final parameters, print(graph), and the program's task of each
    matrix multiply (``mm``: a backward's input or weight gradient, a forward's
    projections; ``addmm`` is forward only) in program order, runs of one task
    collapsed: ``["F0@1", "B0@1", ...]``."""
    state, box = [], []
    losses = _pipeline_losses(layout, schedule, micro, n_layer, steps, program=box,
                              state=state)
    mms = []
    for n in box[0].graph.nodes:
        lab = n.meta.get("pp_task")
        if lab is not None and n.target is torch.ops.aten.mm.default:
            name = f"{lab[0]}{lab[1]}@{lab[2]}"
            if not mms or mms[-1] != name:
                mms.append(name)
    return losses, state[0], box[1], mms


def _task_order(schedule: str, micro: int) -> tuple[list[str], list[str]]:
    """This rank's program after every pass: the task of each torch op (``aten``) in
    program order, runs of one task collapsed (``["F0@0", "F1@0", "B0@0", ...]``), and the
    schedule's compute tasks in its action list's order."""
    from sbpflow import distributed as sd
    from sbpflow.runtime import schedules

    box: list = []
    _pipeline_losses("pp2", schedule, micro, 2, 1, program=box)
    ran = []
    for n in box[0].graph.nodes:
        lab = n.meta.get("pp_task")
        if lab is None or lab[0] == "U" or getattr(n.target, "namespace", None) != "aten":
            continue
        name = f"{lab[0]}{lab[1]}@{lab[2]}"
        if not ran or ran[-1] != name:
            ran.append(name)
    want = [f"{a.kind}{a.micro_batch}@{a.stage}"
            for a in schedules.build(schedule, 2, micro)[sd.get_rank()]
            if a.kind in ("F", "B", "W")]
    return ran, want


def test_pipeline_program_runs_its_tasks_in_the_schedules_order(dist_run):
    """1F1B on two stages, 4 micro-batches: after every program pass each task's ops
    run together, in the action list's order (F0 F1 B0 F2 B1 F3 B2 B3 on stage 0). The
    overlap pass once sank a backward's compute past the next forward's send (F2 before
    most of B0): stage 0 then held three micro-batches' activations where 1F1B holds
    two (the pipeline's measured peak was 1.3 micro-batches above the schedule's)."""
    for ran, want in dist_run(2, _task_order, "1f1b", 4):
        assert ran == want, (ran, want)


@pytest.mark.exhaustive
@pytest.mark.parametrize("schedule", ["gpipe", "zero_bubble"])
def test_other_schedules_run_their_tasks_in_order(dist_run, schedule):
    """The same for GPipe and ZB-H1 (its W tasks included)."""
    for ran, want in dist_run(2, _task_order, schedule, 4):
        assert ran == want, (ran, want)


def _close_state(got: dict, want: dict, tol: float = 1e-4) -> None:
    """Each parameter within ``tol`` of the oracle's, absolutely or, for a parameter with
    entries above 1, relative to its largest entry. The summation orders differ (a
    tensor-parallel matmul's partial sums, a data-parallel gradient's all-reduce) and
    AdamW divides a gradient by its own root mean square, so an entry whose gradient is
    tiny moves by rounding noise: on PP2 x TP2 some attention weights (entries up to 0.1)
    differ from torch by 1.02e-5 after 5 steps of lr 1e-2, just over 1e-4 of their largest
    entry. Left out: the attention key biases, whose gradient is zero in exact arithmetic,
    so that AdamW turns rounding noise into lr-sized steps of either sign."""
    assert sorted(got) == sorted(want), (sorted(got), sorted(want))
    for k, w in want.items():
        if k.endswith("attn.k.bias"):
            continue
        scale = max(float(abs(w).max()), 1.0)
        assert float(abs(got[k] - w).max()) <= tol * scale, (k, float(abs(got[k] - w).max()))


def test_zero_bubble_two_stages_follow_1f1b_and_torch(dist_run):
    """ZB-H1 on two stages, 4 micro-batches: the losses and parameters after 5 steps are
    1F1B's (the same kernels in another order: equal to the bit) and one-process torch's
    (1e-4). The program runs the zero-bubble action list: the last stage's backward of
    micro-batch k is split into B (what the gradient sent to stage 0 needs: the input
    gradients' matmuls) and W (the weight gradients' matmuls), and W0 runs after F1 and
    B1 (it fills the cool-down's bubble); stage 0 sends nothing back, so its backward is
    all W (B empty). Transfers: those of 1F1B."""
    zb = dist_run(2, _run_with_state, "pp2", "zero_bubble", 4)
    ob = dist_run(2, _run_with_state, "pp2", "1f1b", 4)
    state = []
    want = _torch_losses(micro=4, state=state)
    for rank in range(2):
        assert zb[rank][0] == ob[rank][0], (zb[rank][0], ob[rank][0])
        _close(zb[rank][0], want)
        for k, v in ob[rank][1].items():
            assert (zb[rank][1][k] == v).all(), k
        _close_state(zb[rank][1], state[0])
    first, last = zb[0][2], zb[1][2]
    assert "schedule zero_bubble, 4 micro-batches; bubble (theory) 0.083 of compute" in \
        first, first  # (p - 1) / (3 m): a third of 1F1B's 0.250
    assert "F0@1 B0@1 F1@1 B1@1 W0@1 F2@1 B2@1 W1@1 F3@1 B3@1 W2@1 W3@1 U" in last, last
    assert "RECV_F0@1<-r0 F0@1 B0@1 SEND_B0@1->r0 RECV_F1@1<-r0" in last, last
    assert zb[1][3] == [
        "F0@1", "B0@1", "F1@1", "B1@1", "W0@1", "F2@1", "B2@1", "W1@1", "F3@1", "B3@1",
        "W2@1", "W3@1"], zb[1][3]
    # stage 0's forward has no mm (embeddings, addmm); its backward is all W
    assert zb[0][3] == ["W0@0", "W1@0", "W2@0", "W3@0"], zb[0][3]


def _checkpointed_dropout_losses(schedule: str) -> list:
    return _pipeline_losses("pp2", schedule, 4, 2, 3, 0.1, checkpointing=True)


@pytest.mark.exhaustive
def test_zero_bubble_keeps_the_recomputed_dropout_masks_in_order(dist_run):
    """Activation checkpointing with dropout 0.1: the recomputation in backward restores
    the generator, redraws the masks and resets it; those draws must stay in B (a draw
    moved into W would run after the next forward's and shift every later mask), so
    ZB-H1 gives 1F1B's losses and torch's."""
    zb = dist_run(2, _checkpointed_dropout_losses, "zero_bubble", timeout=600)[0]
    assert zb == dist_run(2, _checkpointed_dropout_losses, "1f1b", timeout=600)[0]
    _close(zb, _torch_losses(steps=3, dropout=0.1, micro=4))


def _deadlocking_schedule() -> str:
    """A schedule registered for the call that deadlocks across the ranks: rank 0 waits
    for micro-batch 0's gradient before its second forward, which rank 1 (all forwards
    first) needs before it runs any backward. Returns the graph's error."""
    from sbpflow.runtime import schedules

    def bad(p, m, v=1):
        return [[a for k in range(m) for a in (schedules.Action("F", 0, k),
                                               schedules.Action("B", 0, k))],
                [schedules.Action(x, 1, k) for x in "FB" for k in range(m)]]

    schedules.SCHEDULES["bad"] = bad
    try:
        _pipeline_losses("pp2", "bad", 4, 2, 1)
    except schedules.ScheduleError as e:
        return str(e)
    finally:
        del schedules.SCHEDULES["bad"]
    return "no error"


def test_a_deadlocking_schedule_is_refused_before_any_rank_runs(dist_run):
    """The plan is simulated when the graph compiles, before tracing: both ranks raise
    ScheduleError naming the stuck actions (no transfer was posted, so nothing hangs)."""
    for msg in dist_run(2, _deadlocking_schedule):
        assert "deadlocks" in msg and "rank 0 at #" in msg and "rank 1 at #" in msg, msg


def test_set_pipeline_schedule_accepts_zero_bubble():
    from sbpflow.graph.config import GraphConfig

    cfg = GraphConfig()
    cfg.set_pipeline_schedule("zero_bubble")
    assert cfg.pipeline_schedule == "zero_bubble"
    with pytest.raises(ValueError, match="zero_bubble"):  # the known ones are listed
        cfg.set_pipeline_schedule("zb-h1")
    with pytest.raises(ValueError, match="needs schedule='interleaved'"):
        cfg.set_pipeline_schedule("zero_bubble", virtual_stages=2)


@pytest.mark.exhaustive
@pytest.mark.parametrize("layout", ["pp4", "pp2_dp2", "pp2_tp2"])
def test_zero_bubble_four_ranks_follow_1f1b_and_torch(dist_run, layout):
    """ZB-H1 on PP4, PP2 x DP2 and PP2 x TP2, 4 micro-batches: every rank's losses and
    parameters after 5 steps are 1F1B's (to the bit) and one-process torch's (1e-4)."""
    n_layer = {"pp4": 4}.get(layout, 2)
    zb = dist_run(4, _run_with_state, layout, "zero_bubble", 4, n_layer, timeout=900)
    ob = dist_run(4, _run_with_state, layout, "1f1b", 4, n_layer, timeout=900)
    state = []
    want = _torch_losses(n_layer, micro=4, state=state, dp=2 if layout == "pp2_dp2" else 1)
    for rank in range(4):
        assert zb[rank][0] == ob[rank][0], (rank, zb[rank][0], ob[rank][0])
        _close(zb[rank][0], want)
        for k, v in ob[rank][1].items():
            assert (zb[rank][1][k] == v).all(), (rank, k)
        _close_state(zb[rank][1], state[0])
        stage = rank if layout == "pp4" else rank // 2
        kinds = {t[0] for t in zb[rank][3]}  # matmuls of B: input gradients, W: weights
        assert {"B", "W"} <= kinds if stage else "B" not in kinds, (rank, zb[rank][3])


@pytest.mark.exhaustive
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "interleaved"])
@pytest.mark.parametrize("layout", ["pp4", "pp2_dp2", "pp2_tp2"])
def test_four_ranks_follow_torch(dist_run, layout, schedule):
    """Four ranks, 4 micro-batches, each schedule: PP4 (interleaved: 8 stages, two per
    rank, one block each), PP2 x DP2 and PP2 x TP2 (interleaved: 4 stages on the two rank
    groups; TP parameters laid out on stage 0's ranks and moved by set_stage)."""
    n_layer = {"pp4": 4}.get(layout, 2) * (2 if schedule == "interleaved" else 1)
    got = dist_run(4, _pipeline_losses, layout, schedule, 4, n_layer, timeout=600)
    want = _torch_losses(n_layer)
    for rank_losses in got:  # every rank returns the loss (.item() of the last stage's)
        _close(rank_losses, want)


@pytest.mark.exhaustive
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "zero_bubble"])
def test_dropout_masks_are_the_micro_batches_masks(dist_run, schedule):
    """Dropout 0.1: every rank draws every micro-batch's masks in forward order (1F1B,
    GPipe and ZB-H1 keep the forwards in order), so the masks are those of one process
    running the micro-batches one after another."""
    got = dist_run(2, _pipeline_losses, "pp2", schedule, 4, 2, STEPS, 0.1)[0]
    _close(got, _torch_losses(dropout=0.1, micro=4))


@pytest.mark.parametrize("schedule,steps", [  # all exhaustive: the default suite's budget
    pytest.param("1f1b", 6, marks=pytest.mark.exhaustive),
    pytest.param("1f1b", 20, marks=pytest.mark.exhaustive),
    pytest.param("gpipe", 20, marks=pytest.mark.exhaustive),
    pytest.param("zero_bubble", 20, marks=pytest.mark.exhaustive)])
def test_random_delays_change_nothing(dist_run, schedule, steps):
    """Each task and transfer first sleeps a random time (up to 20 ms, different on each
    rank and step): ``steps`` steps (20 in the exhaustive run) finish with the losses of
    the run without delays."""
    got = dist_run(2, _pipeline_losses, "pp2", schedule, 4, 2, steps, 0.0, 0.02, timeout=600)
    want = dist_run(2, _pipeline_losses, "pp2", schedule, 4, 2, steps, timeout=600)
    assert got == want


def _die_mid_step(step: int):
    """On rank 1, from step 2 on: exit at the 5th pipeline delay point (mid-step)."""
    import os

    import _delays

    from sbpflow.distributed import get_rank

    if step == 2 and get_rank() == 1:
        calls = [0]

        def draw():
            calls[0] += 1
            if calls[0] == 5:
                os._exit(3)
            return 0.0

        _delays.RNG.random = draw  # the delay points draw from it


def test_a_stage_rank_that_dies_mid_step_raises_collective_error_naming_the_transfer():
    from _pool import run_isolated

    import sbpflow.distributed as sd

    timeout = 5.0
    outcomes = run_isolated(2, _pipeline_losses, "pp2", "1f1b", 4, 2, 4, 0.0, 1e-6,
                            _die_mid_step, timeout=120,
                            env={"SBPFLOW_TIMEOUT": str(timeout), "SBPFLOW_DEBUG": "0"})
    assert outcomes[1].status == "exited" and outcomes[1].exitcode == 3, \
        outcomes[1].describe()
    o = outcomes[0]
    assert o.status == "raised" and isinstance(o.exception, sd.CollectiveError), o.describe()
    msg = str(o.exception)
    assert "rank 1 (stage 1)" in msg and "micro-batch" in msg, msg
    assert o.elapsed < timeout + 10 + 30, o.describe()  # + the first steps' compile


def _peak_live(schedule: str, micro: int) -> int:
    from sbpflow.graph import show

    box: list = []
    _pipeline_losses("pp2", schedule, micro, 2, 1, batch=2 * micro, program=box)
    return show.peak_live_bytes(box[0])


@pytest.mark.exhaustive
def test_1f1b_holds_at_most_stages_micro_batches_where_gpipe_holds_all(dist_run):
    """Micro-batches of 2 sequences, m = 2, 4, 8, two stages: the peak of live values in
    stage 0's program (``show.peak_live_bytes``) stays flat in m under 1F1B (at most 2
    micro-batches' activations) from m = 4 on and grows with m under GPipe (all of them).
    1F1B rises once from m = 2 to 4, by less than a micro-batch: from m = 4 on a backward
    (B1) runs with the gradients accumulated so far live. (Before the overlap pass kept
    to the pipeline's tasks it rose by 1.6 micro-batches, to 0.96x GPipe's at m = 4.)"""
    peaks = {}
    for schedule in ("1f1b", "gpipe"):
        for m in (2, 4, 8):
            peaks[schedule, m] = dist_run(2, _peak_live, schedule, m)[0]
    print(peaks)
    assert peaks["gpipe", 2] <= 1.05 * peaks["1f1b", 2], peaks  # m = stages: the same
    assert peaks["1f1b", 8] <= 1.02 * peaks["1f1b", 4], peaks  # flat in m
    one = (peaks["gpipe", 8] - peaks["gpipe", 4]) / 4  # one micro-batch's activations
    assert one > 0 and peaks["1f1b", 8] <= peaks["gpipe", 8] - 3.5 * one, peaks
    assert peaks["1f1b", 4] - peaks["1f1b", 2] < one, peaks
    assert peaks["gpipe", 4] - peaks["1f1b", 4] > one, peaks  # 2 micro-batches fewer


def _eager_staged_losses(steps: int = STEPS):
    """The same stages without a graph: eagerly the stages run one after another."""
    torch.set_num_threads(1)
    m = _gpt("sbpflow")
    pls = [sbpflow.placement("cpu", [0]), sbpflow.placement("cpu", [1])]
    m.to_global(pls[0], B)
    t = m.transformer
    for mod in (m.lm_head, t.ln_f, t.h[1]):  # the later stage first: the tied weight
        mod.to(GraphModule).set_stage(1, pls[1])  # still goes to the lowest stage
    for mod in (t.wte, t.wpe, t.drop, t.h[0]):
        mod.to(GraphModule).set_stage(0, pls[0])
    assert m.lm_head.weight.placement == pls[0] and t.h[1].mlp.c_fc.weight.placement == pls[1]
    opt = sbpflow.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
    out = []
    for x, y in _batches(steps):
        opt.zero_grad()
        with sbpflow.default_placement(pls[0]):
            loss = m(sbpflow.tensor(x, placement=pls[0], sbp=B),
                     sbpflow.tensor(y, placement=pls[1], sbp=B))[1]
        loss.backward()
        opt.step()
        out.append(loss.item())
    return out


@pytest.mark.exhaustive
def test_stages_run_eagerly_one_after_another(dist_run):
    _close(dist_run(2, _eager_staged_losses)[0], _torch_losses())


def test_oneflow_style_stages_and_inferred_virtual_stages_follow_torch(dist_run):
    """OneFlow's way (issue 21): modules moved with to_global, set_stage(s) without a
    placement, set_pipeline_schedule('interleaved') without virtual_stages: four stages
    on two ranks run interleaved (2 chunks per rank, inferred) and follow torch."""
    got = dist_run(2, _pipeline_losses, "pp2", "interleaved", 4, 4, 3, 0.0, 0.0, None, 8,
                   None, 2, True, timeout=600)[0]  # 3 steps (the interleaved test runs 5)
    _close(got, _torch_losses(4))


def _stage_refusals():
    from sbpflow.graph.config import GraphModule as GM

    pls = [sbpflow.placement("cpu", [0]), sbpflow.placement("cpu", [1])]
    out = []
    mixed = sbpflow.nn.Sequential(sbpflow.nn.Linear(2, 2), sbpflow.nn.Linear(2, 2))
    mixed[0].to_global(pls[0], B)
    mixed[1].to_global(pls[1], B)
    try:
        mixed.to(GM).set_stage(0)
        out.append("no error")
    except ValueError as e:
        out.append(str(e))
    with pytest.warns(DeprecationWarning, match="set_stage"):
        mixed[0].to(GM).stage_id = 0
    out.append(mixed[0].to(GM).stage_id)
    return out


def test_set_stage_without_a_placement_refusals_and_the_deprecated_setter(dist_run):
    msg, sid = dist_run(2, _stage_refusals)[0]
    assert "2 placements" in msg and "set_stage(stage_id, placement)" in msg, msg
    assert sid == 0


@pytest.mark.exhaustive
def test_interleaved_four_stages_on_two_ranks_follow_torch(dist_run):
    """Two model chunks per rank (stages 0 and 2 on rank 0, 1 and 3 on rank 1)."""
    got = dist_run(2, _pipeline_losses, "pp2", "interleaved", 4, 4, timeout=600)[0]
    _close(got, _torch_losses(4))


@pytest.mark.exhaustive
def test_interleaved_dropout_masks_are_the_micro_batches_masks(dist_run):
    """Dropout 0.1 with two chunks per rank: the interleaved order runs the chunks'
    forwards out of the traced order, so the draws are taken ahead in that order
    (passes._hoist_draws): the masks are one process's, micro-batch after micro-batch."""
    got = dist_run(2, _pipeline_losses, "pp2", "interleaved", 4, 4, STEPS, 0.1,
                   timeout=900)[0]
    _close(got, _torch_losses(4, dropout=0.1, micro=4))


@pytest.mark.exhaustive
def test_eight_ranks_dp2_tp2_pp2_follow_torch(dist_run):
    """Two stages, each a 2 x 2 mesh (data parallel x tensor parallel)."""
    got = dist_run(8, _pipeline_losses, "pp2_dp2_tp2", "1f1b", 4, timeout=900)
    for rank_losses in got:
        _close(rank_losses, _torch_losses())


@pytest.mark.exhaustive
def test_interleaved_with_random_delays_changes_nothing(dist_run):
    got = dist_run(2, _pipeline_losses, "pp2", "interleaved", 4, 4, 20, 0.0, 0.02,
                   timeout=900)
    want = dist_run(2, _pipeline_losses, "pp2", "interleaved", 4, 4, 20, timeout=900)
    assert got == want
