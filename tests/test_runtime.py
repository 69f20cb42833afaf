"""The pipeline actors' plans (sbpflow.runtime.actors), without ranks: every task once,
an order that a run with real dependencies completes (no deadlock), 1F1B's register
bound, and the theory's bubble when the plans run with the model's durations."""

from __future__ import annotations

import pytest

from sbpflow.runtime import Task, bubble_fraction, plan


def _run(plans, p: int, m: int, v: int) -> tuple[float, dict]:
    """Execute the plans with their dependencies (forward 1/v, backward 2/v time units,
    transfers free): returns (makespan, finish time per task). Asserts no deadlock."""
    n, done, now, idx = p * v, {}, [0.0] * p, [0] * p
    progress = True
    while progress:
        progress = False
        for r in range(p):
            while idx[r] < len(plans[r]):
                t = plans[r][idx[r]]
                deps = []
                if t.kind == "F" and t.stage > 0:
                    deps.append(("F", t.stage - 1, t.micro_batch))
                if t.kind == "B":
                    deps.append(("F", t.stage, t.micro_batch))
                    if t.stage < n - 1:
                        deps.append(("B", t.stage + 1, t.micro_batch))
                if any(d not in done for d in deps):
                    break
                start = max([now[r]] + [done[d] for d in deps])
                now[r] = done[(t.kind, t.stage, t.micro_batch)] = \
                    start + (1.0 if t.kind == "F" else 2.0) / v
                idx[r] += 1
                progress = True
    assert idx == [len(x) for x in plans], f"deadlock at {idx}"
    return max(now), done


CASES = [("1f1b", 2, 4, 1), ("1f1b", 4, 8, 1), ("1f1b", 3, 5, 1), ("gpipe", 2, 4, 1),
         ("gpipe", 4, 8, 1), ("interleaved", 2, 4, 2), ("interleaved", 2, 8, 4),
         ("interleaved", 4, 8, 2), ("interleaved", 4, 16, 2)]


@pytest.mark.parametrize("schedule,p,m,v", CASES)
def test_plans_complete_with_the_theorys_bubble(schedule, p, m, v):
    plans = plan(schedule, p, m, v, 1.0 / v, 2.0 / v)
    want = {Task(k, s, mb) for k in "FB" for s in range(p * v) for mb in range(m)}
    got = [t for r in range(p) for t in plans[r]]
    assert len(got) == len(want) and set(got) == want
    for r in range(p):
        assert all(t.stage % p == r for t in plans[r])
    span, _ = _run(plans, p, m, v)
    bubble = (span - 3 * m) / (3 * m)  # idle over compute, on the busiest rank
    assert bubble == pytest.approx(bubble_fraction(schedule, p, m, v), abs=1e-9)


@pytest.mark.parametrize("p,m", [(2, 8), (4, 8), (4, 3)])
def test_1f1b_holds_at_most_stages_minus_s_and_gpipe_holds_all(p, m):
    for schedule in ("1f1b", "gpipe"):
        for s, tasks in enumerate(plan(schedule, p, m)):
            held = most = 0
            for t in tasks:
                held += 1 if t.kind == "F" else -1
                most = max(most, held)
            assert most == (min(p - s, m) if schedule == "1f1b" else m), (schedule, s)


def test_the_first_stage_runs_1f1b_as_megatron_orders_it():
    names = [str(t) for t in plan("1f1b", 4, 8)[0]]
    assert names[:5] == ["F0@0", "F1@0", "F2@0", "F3@0", "B0@0"]
    assert names[5:8] == ["F4@0", "B1@0", "F5@0"]


@pytest.mark.parametrize("args,match", [
    (("zigzag", 2, 4), "one of"), (("1f1b", 0, 4), ">= 1"), (("1f1b", 2, 4, 2), "interleaved"),
    (("interleaved", 2, 5, 2), "multiple of")])
def test_bad_plans_are_refused(args, match):
    with pytest.raises(ValueError, match=match):
        plan(*args)
