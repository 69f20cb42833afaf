"""Pipeline schedules as data (sbpflow.runtime.schedules), without ranks: every schedule
simulates without deadlock or is refused with a clear error, the simulated bubble is the
papers' formula, ZB-H1 holds 1F1B's activations, a hand-broken schedule is reported as a
deadlock naming its ranks, and the old schedules' compute orders are actors.plan's."""

from __future__ import annotations

import itertools

import pytest

from sbpflow.runtime import actors
from sbpflow.runtime.schedules import (
    COMPUTE,
    SCHEDULES,
    Action,
    ScheduleError,
    build,
    simulate,
)


def _refusal(schedule: str, p: int, m: int, v: int) -> str | None:
    """The error message's key words when the schedule cannot run these counts."""
    if v > 1 and schedule == "zero_bubble":
        return "ZB-V"
    if v > 1 and schedule != "interleaved":
        return "needs the 'interleaved' schedule"
    if schedule == "interleaved" and m % p:
        return "multiple of the pipeline ranks"
    return None


GRID = list(itertools.product(sorted(SCHEDULES), (2, 4), (1, 2, 4, 8), (1, 2)))


@pytest.mark.parametrize("schedule,p,m,v", GRID)
def test_every_schedule_runs_each_task_once_or_is_refused(schedule, p, m, v):
    refusal = _refusal(schedule, p, m, v)
    if refusal:
        with pytest.raises(ValueError, match=refusal):
            build(schedule, p, m, v)
        return
    plan = build(schedule, p, m, v)
    timeline = simulate(plan)
    assert [len(row) for row in timeline.intervals] == [len(row) for row in plan]
    kinds = "FBW" if schedule == "zero_bubble" else "FB"
    got = [(a.kind, a.stage, a.micro_batch) for row in plan for a in row if a.kind in COMPUTE]
    want = [(k, s, mb) for k in kinds for s in range(p * v) for mb in range(m)]
    assert sorted(got) == sorted(want)
    for r, row in enumerate(plan):
        assert all(a.stage % p == r for a in row if a.kind != "UPDATE")
        assert row[-1] == Action("UPDATE", None, None)


def test_receives_sit_right_before_their_consumer_and_sends_right_after_their_producer():
    for row in build("interleaved", 2, 4, 2):
        for i, a in enumerate(row):
            if a.kind.startswith("RECV"):
                nxt = row[i + 1]
                assert (nxt.kind, nxt.stage, nxt.micro_batch) == (a.kind[-1], a.stage,
                                                                   a.micro_batch)
            if a.kind.startswith("SEND"):
                prev = row[i - 1]
                assert (prev.kind, prev.stage, prev.micro_batch) == (a.kind[-1], a.stage,
                                                                     a.micro_batch)
    assert all(a.kind in COMPUTE + ("UPDATE",) for a in build("1f1b", 1, 4)[0])


@pytest.mark.parametrize("schedule,p,m", [(s, p, m) for s in ("1f1b", "gpipe")
                                          for p in (2, 4) for m in (1, 2, 4, 8)])
def test_1f1b_and_gpipe_bubble_is_p_minus_1_over_m(schedule, p, m):
    # F = 1, the full backward B + W = 2: idle / compute = (p - 1) / m (Huang et al. 2019;
    # Narayanan et al. 2021, section 2.2), on every rank
    t = simulate(build(schedule, p, m), forward=1.0, backward=1.0, weight=1.0)
    assert t.bubbles == pytest.approx([(p - 1) / m] * p)
    assert t.makespan == pytest.approx(3 * (m + p - 1))


@pytest.mark.parametrize("p,m,v", [(p, m, v) for p in (2, 4) for m in (4, 8, 16)
                                   for v in (1, 2, 3) if m % p == 0])
def test_interleaved_bubble_is_p_minus_1_over_v_m(p, m, v):
    # per chunk F = 1, B = 2; the ratio does not depend on the scale (Narayanan et al.
    # 2021, section 2.2: (p - 1) / (v m))
    t = simulate(build("interleaved", p, m, v))
    assert t.bubble == pytest.approx((p - 1) / (v * m))


@pytest.mark.parametrize("p,m", [(2, 2), (2, 8), (3, 7), (4, 4), (4, 8)])
@pytest.mark.parametrize("f,b,w", [(1, 1, 1), (1, 1, 0.5), (2, 1, 1), (1, 2, 1), (1.5, 1, 1)])
def test_zb_h1_idles_p_minus_1_times_f_plus_b_minus_w_and_1f1b_f_plus_b_plus_w(p, m, f, b, w):
    # Qi et al. 2024, section 2.1 / Table 2, for m >= p and T_W <= T_F: ZB-H1's bubble
    # (p - 1)(T_F + T_B - T_W), 1F1B's (p - 1)(T_F + T_B + T_W); a third with equal times
    zb = simulate(build("zero_bubble", p, m), f, b, w)
    ob = simulate(build("1f1b", p, m), f, b, w)
    assert zb.idle == pytest.approx([(p - 1) * (f + b - w)] * p)
    assert ob.idle == pytest.approx([(p - 1) * (f + b + w)] * p)
    assert zb.busy == ob.busy == pytest.approx([m * (f + b + w)] * p)
    if (f, b, w) == (1, 1, 1):
        assert zb.bubble == pytest.approx(ob.bubble / 3)


@pytest.mark.parametrize("p,m", [(2, 1), (4, 1), (4, 2), (4, 3)])
def test_zb_h1_with_fewer_micro_batches_than_ranks_still_beats_1f1b(p, m):
    zb, ob = simulate(build("zero_bubble", p, m)), simulate(build("1f1b", p, m))
    assert zb.makespan < ob.makespan


@pytest.mark.parametrize("p,m", [(2, 1), (2, 8), (4, 2), (4, 3), (4, 8)])
def test_zb_h1_holds_as_many_micro_batches_as_1f1b(p, m):
    want = [min(p - r, m) for r in range(p)]
    assert simulate(build("zero_bubble", p, m)).peak_in_flight == want
    assert simulate(build("1f1b", p, m)).peak_in_flight == want
    assert simulate(build("gpipe", p, m)).peak_in_flight == [m] * p


def test_a_receive_before_the_send_it_enables_deadlocks_naming_both_ranks():
    # rank 0 waits for the gradient before it sends the activation that rank 1 needs
    plan = [[Action("F", 0, 0), Action("RECV_B", 0, 0, 1), Action("SEND_F", 0, 0, 1),
             Action("B", 0, 0), Action("UPDATE", None, None)],
            [Action("RECV_F", 1, 0, 0), Action("F", 1, 0), Action("B", 1, 0),
             Action("SEND_B", 1, 0, 0), Action("UPDATE", None, None)]]
    with pytest.raises(ScheduleError, match="deadlock") as err:
        simulate(plan)
    msg = str(err.value)
    assert "rank 0 at #1 RECV_B0@0<-r1: waits for SEND_B0@1->r0, on rank 1" in msg
    assert "rank 1 at #0 RECV_F0@1<-r0: waits for SEND_F0@0->r1, on rank 0" in msg


def test_a_task_before_its_own_input_deadlocks_and_says_so():
    plan = [[Action("B", 0, 0), Action("F", 0, 0), Action("UPDATE", None, None)]]
    with pytest.raises(ScheduleError, match=r"waits for F0@0, later in rank 0's own list"):
        simulate(plan)


@pytest.mark.parametrize("edit,match", [
    (lambda p: p[0].remove(Action("SEND_F", 0, 1, 1)), "no SEND_F1@0"),
    (lambda p: p[1].remove(Action("RECV_F", 1, 1, 0)), "no RECV_F1@1"),
    (lambda p: p[1].remove(Action("B", 1, 0)), "B0@1 is in no rank's list"),
    (lambda p: p[0].append(Action("UPDATE", None, None)), "2 UPDATEs"),
    (lambda p: p[0].insert(0, Action("F", 1, 0)), "stage 1 runs on ranks"),
    (lambda p: p[1].__setitem__(0, Action("RECV_F", 1, 0, 1)), "neighbouring stages"),
])
def test_unmatched_or_missing_actions_are_named(edit, match):
    plan = build("1f1b", 2, 2)
    edit(plan)
    with pytest.raises(ScheduleError, match=match):
        simulate(plan)


@pytest.mark.parametrize("schedule,p,m,v", [("1f1b", 4, 8, 1), ("gpipe", 2, 4, 1),
                                            ("interleaved", 4, 8, 2), ("zero_bubble", 4, 8, 1)])
def test_transfers_lengthen_the_step_and_it_still_finishes(schedule, p, m, v):
    plan = build(schedule, p, m, v)
    free, slow = simulate(plan), simulate(plan, transfer=0.5)
    assert slow.makespan > free.makespan
    assert slow.busy == free.busy


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "zero_bubble"])
def test_one_micro_batch_crosses_the_pipeline_twice_per_step(schedule):
    # m = 1: the forward chain, then the backward chain, each with p - 1 transfers; the
    # first stage's W (zero-bubble) or its whole backward comes last
    p, t = 4, 0.25
    chains = p * 1.0 + p * 1.0 + (1.0 if schedule == "zero_bubble" else p * 1.0)
    assert simulate(build(schedule, p, 1), transfer=t).makespan == pytest.approx(
        chains + 2 * (p - 1) * t)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "interleaved"])
def test_compute_orders_are_actors_plans(schedule):
    for p, m, v in itertools.product(range(1, 5), range(1, 9), (1, 2)):
        if _refusal(schedule, p, m, v):
            continue
        old = [[(t.kind, t.stage, t.micro_batch) for t in row]
               for row in actors.plan(schedule, p, m, v)]
        new = [[(a.kind, a.stage, a.micro_batch) for a in row if a.kind in COMPUTE]
               for row in build(schedule, p, m, v)]
        assert new == old, (schedule, p, m, v)


@pytest.mark.parametrize("args,match", [
    (("zigzag", 2, 4), r"one of \['1f1b', 'gpipe', 'interleaved', 'zero_bubble'\]"),
    (("1f1b", 0, 4), r"\{'ranks': 0\} must be integers >= 1"),
    (("gpipe", 2, 0), "micro_batches"), (("1f1b", 2, 4, 0), "virtual_stages"),
    (("1f1b", 2, 4, 2), "needs the 'interleaved' schedule"),
    (("interleaved", 2, 5, 2), r"multiple of the pipeline ranks \(2\).*"
                               r"set_gradient_accumulation_steps\(6\)"),
    (("zero_bubble", 2, 4, 2), "ZB-V is not"), (("1f1b", 2.0, 4), "integers")])
def test_bad_schedules_are_refused(args, match):
    with pytest.raises(ValueError, match=match):
        build(*args)


def test_actions_and_timelines_print():
    assert str(Action("F", 1, 3)) == "F3@1"
    assert str(Action("SEND_F", 1, 3, 2)) == "SEND_F3@1->r2"
    assert str(Action("RECV_B", 0, 3, 1)) == "RECV_B3@0<-r1"
    assert str(Action("UPDATE", None, None)) == "UPDATE"
    rows = str(simulate(build("zero_bubble", 2, 2))).splitlines()
    assert rows[1].split() == ["rank", "0", "F0", "F1", ".", "B0", "W0", "B1", "W1"]
    assert rows[2].split() == ["rank", "1", ".", "F0", "B0", "F1", "B1", "W0", "W1"]
    assert "bubble (idle / compute) 0.167" in rows[3]  # (p - 1) / (3 m)
    gp = str(simulate(build("gpipe", 2, 1))).splitlines()
    assert gp[1].split() == ["rank", "0", "F0", ".", ".", ".", "B0", "--"]
    assert "F0@2" in str(simulate(build("interleaved", 2, 2, 2)))  # several stages a rank


def test_simulate_takes_each_stage_its_own_durations():
    """Per-stage durations (what the planner prices a pipeline with): two stages, the
    second twice as slow, 1F1B over four micro-batches, worked out by hand: the second
    rank is busy from its first forward (t = 1) without a gap (forward 2, backward 4 per
    micro-batch) and rank 0's last backward follows it: 1 + 4 x 6 + 2 = 27. Per-boundary
    transfer times delay each receive; a sequence of the wrong length is refused."""
    t = simulate(build("1f1b", 2, 4), forward=[1.0, 2.0], backward=[2.0, 4.0],
                 weight=[0.0, 0.0])
    assert t.makespan == pytest.approx(27.0) and t.busy == [12.0, 24.0]
    slow = simulate(build("1f1b", 2, 4), forward=[1.0, 2.0], backward=[2.0, 4.0],
                    weight=0.0, transfer=[0.5])
    assert slow.makespan > t.makespan
    with pytest.raises(ValueError, match="one per stage"):
        simulate(build("1f1b", 2, 4), forward=[1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="stage boundary"):
        simulate(build("1f1b", 2, 4), transfer=[1.0, 1.0])
    for bad, msg in (({"forward": [-1.0, 1.0]}, "finite and >= 0, got -1.0"),
                     ({"backward": float("nan")}, "finite and >= 0, got nan"),
                     ({"transfer": [-0.5]}, "finite and >= 0"),
                     ({"forward": {0: 1.0, 1: 2.0}}, "a number or a list of 2"),
                     ({"weight": None}, "a number or a list of 2")):
        with pytest.raises(ValueError, match=msg):
            simulate(build("1f1b", 2, 4), **bad)
