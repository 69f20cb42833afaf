"""The program verifier (sbpflow.graph.verify): hand-built per-rank programs with each kind
of violation are caught, their safe twins pass, and the programs nn.Graph compiles pass
it (every graph test of the suite compiles with the verifier on; here one ZeRO-3 +
checkpointing program is checked with its report)."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx

from sbpflow.graph import GraphError, verify

F = torch.ops._c10d_functional
A = torch.ops.aten


class _P:
    """A program under construction: ``add(target, *args)`` appends a node whose
    ``meta["val"]`` is computed on meta tensors, as the tracer records it."""

    def __init__(self) -> None:
        self.g = fx.Graph()

    def input(self, name: str, shape=(4,)):
        n = self.g.placeholder(name)
        n.meta["val"] = torch.empty(shape, device="meta")
        return n

    def add(self, target, *args):
        n = self.g.call_function(target, args)
        vals = fx.node.map_arg(args, lambda a: a.meta["val"])
        if target in (F.all_gather_into_tensor.default,):
            x = vals[0]
            n.meta["val"] = x.new_empty((x.shape[0] * args[1], *x.shape[1:]))
        elif getattr(target, "namespace", None) == "_c10d_functional":
            n.meta["val"] = vals[0].new_empty(vals[0].shape)
        else:
            n.meta["val"] = target(*vals)
        return n

    def done(self, *outs) -> fx.GraphModule:
        self.g.output(list(outs))
        return fx.GraphModule(torch.nn.Module(), self.g)


def _gather(p: _P, x):
    return p.add(F.all_gather_into_tensor.default, x, 2, "0")


def _safe() -> _P:
    """y = x + 1; start a gather of y; compute on x; wait; use the result and y."""
    p = _P()
    x = p.input("x")
    y = p.add(A.add.Tensor, x, 1)
    ag = _gather(p, y)
    z = p.add(A.mul.Tensor, x, 2)
    w = p.add(F.wait_tensor.default, ag)
    s = p.add(A.add.Tensor, w, 1)
    return p, (x, y, ag, z, w, s)


def test_a_safe_program_passes_and_reports_what_it_checked():
    p, (x, y, ag, z, w, s) = _safe()
    extra = p.add(A.add.Tensor, y, z)  # y referenced after the wait: alive
    rep = verify.verify(p.done(s, extra))
    assert rep.collectives == 1 and rep.problems == [] and rep.seconds >= 0


def test_a_write_to_an_in_flight_input_is_caught_through_a_view():
    p = _P()
    x = p.input("x")
    y = p.add(A.add.Tensor, x, 1)
    ag = _gather(p, y)
    v = p.add(A.slice.Tensor, y, 0, 0, 2)  # a view of the gathered input
    p.add(A.add_.Tensor, v, 1.0)  # written while the gather reads it
    w = p.add(F.wait_tensor.default, ag)
    gm = p.done(w, y)
    with pytest.raises(GraphError, match=r"%add__tensor = aten\.add_\.Tensor\(\.\.\.\) writes "
                                         r"the input of the in-flight "
                                         r"%all_gather_into_tensor_default"):
        verify.verify(gm)


def test_a_read_of_an_in_flight_output_is_caught():
    p = _P()
    x = p.input("x")
    ag = p.add(F.all_reduce.default, x, "sum", "0")
    v = p.add(A.view.default, ag, [2, 2])  # a view: no read yet
    s = p.add(A.sum.default, v)  # reads the all-reduce's buffer before the wait
    w = p.add(F.wait_tensor.default, ag)
    with pytest.raises(GraphError, match=r"%sum_default = aten\.sum\.default\(\.\.\.\) reads the "
                                         r"output of the in-flight %all_reduce_default = "
                                         r".* before its wait %wait_tensor_default"):
        verify.verify(p.done(w, s))


def test_an_in_place_collective_forbids_reads_of_its_buffer_too():
    p = _P()
    x = p.input("x")
    y = p.add(A.clone.default, x)
    ar = p.add(F.all_reduce_.default, y, "sum", "0")
    s = p.add(A.sum.default, y)  # y is the all-reduce's output while it runs
    w = p.add(F.wait_tensor.default, ar)
    with pytest.raises(GraphError, match="reads the output of the in-flight %all_reduce__default"):
        verify.verify(p.done(w, s))


def test_a_buffer_last_used_before_its_wait_is_caught_and_hold_fixes_it():
    p, (x, y, ag, z, w, s) = _safe()  # y's last use is the start
    gm = p.done(s, z)
    with pytest.raises(GraphError, match=r"a buffer of the in-flight "
                                         r"%all_gather_into_tensor_default .*\(%add_tensor\) "
                                         r"is last referenced before its wait "
                                         r"%wait_tensor_default"):
        verify.verify(gm)
    gm = verify.hold(gm)
    holds = [n for n in gm.graph.nodes if n.target is verify.HOLD]
    assert len(holds) == 1 and holds[0].args[0] == [w, y]  # after the wait, ordered by it
    assert holds[0].prev is w
    assert verify.verify(gm).problems == []


def test_a_removed_wait_and_a_wait_of_nothing_are_caught():
    p = _P()
    x = p.input("x")
    _gather(p, x)  # started, never waited
    w = p.add(F.wait_tensor.default, x)  # waits a value no collective started
    with pytest.raises(GraphError) as e:
        verify.verify(p.done(w))
    msg = str(e.value)
    assert "%all_gather_into_tensor_default = _c10d_functional.all_gather_into_tensor." \
           "default(...) has 0 waits (none)" in msg, msg
    assert "waits %x, which no collective started" in msg, msg


def test_two_waits_of_one_start_are_caught():
    p = _P()
    x = p.input("x")
    ag = _gather(p, x)
    w1 = p.add(F.wait_tensor.default, ag)
    w2 = p.add(F.wait_tensor.default, ag)
    with pytest.raises(GraphError, match=r"has 2 waits \(%wait_tensor_default, "
                                         r"%wait_tensor_default_1\)"):
        verify.verify(p.done(w1, w2))


def test_report_mode_lists_every_problem_without_raising():
    p = _P()
    x = p.input("x")
    y = p.add(A.add.Tensor, x, 1)
    ag = _gather(p, y)
    p.add(A.mul_.Tensor, y, 2.0)
    w = p.add(F.wait_tensor.default, ag)
    rep = verify.verify(p.done(w), raise_errors=False)
    assert len(rep.problems) == 2, rep.problems  # the write, and y freed before the wait
    assert any("writes the input" in m for m in rep.problems)


def _order_body(swap_on_rank1: bool):
    """Each rank builds a program of an all-reduce and an all-gather on the world group;
    rank 1 swaps them when asked. Returns ("ok", seconds) or ("raised", message)."""
    import sbpflow.distributed as sd
    from sbpflow.distributed import _state

    torch.set_num_threads(1)
    world = tuple(range(sd.get_world_size()))
    sd.ensure_groups([world])
    name = _state.group_of(world).group_name
    p = _P()
    x = p.input("x")
    ops = [lambda: p.add(F.all_reduce.default, x, "sum", name),
           lambda: p.add(F.all_gather_into_tensor.default, x, 2, name)]
    if swap_on_rank1 and sd.get_rank() == 1:
        ops.reverse()
    starts = [op() for op in ops]
    waits = [p.add(F.wait_tensor.default, s) for s in starts]
    gm = p.done(*waits)
    try:
        return "ok", verify.check_order(gm)
    except GraphError as e:
        return "raised", str(e)


def test_collective_order_is_compared_across_ranks(dist_run):
    assert [r[0] for r in dist_run(2, _order_body, False)] == ["ok", "ok"]
    out = dist_run(2, _order_body, True)
    for status, msg in out:  # every rank raises, naming the group and the first difference
        assert status == "raised", msg
        assert "the collectives of group [0,1]: #0 is all_reduce((4,):float32" in msg, msg
        assert "but all_gather_into_tensor((4,):float32; [2]) on rank 1" in msg, msg


def test_a_violation_names_the_users_source_line_where_the_trace_recorded_it():
    """With ``graph.config.record_stack_traces`` the nodes carry their Python stack and a
    violation names the user's line (frames in torch and sbpflow skipped); without, the
    message says how to get it."""
    import os

    def program(stack: str | None) -> fx.GraphModule:
        p = _P()
        x = p.input("x")
        ag = p.add(F.all_reduce.default, x, "sum", "0")
        s = p.add(A.sum.default, ag)
        if stack is not None:
            s.meta["stack_trace"] = stack
        w = p.add(F.wait_tensor.default, ag)
        return p.done(w, s)

    torch_dir = os.path.dirname(torch.__file__)
    stack = (f'  File "/home/u/train.py", line 12, in step\n    loss = y.sum()\n'
             f'  File "{torch_dir}/_tensor.py", line 40, in sum\n    return f()\n')
    with pytest.raises(GraphError, match=r"%sum_default = aten\.sum\.default\(\.\.\.\) "
                                         r'\[File "/home/u/train\.py", line 12, in step\]'):
        verify.verify(program(stack))
    with pytest.raises(GraphError, match=r"set graph\.config\.record_stack_traces = True"):
        verify.verify(program(None))


def test_record_stack_traces_puts_the_users_lines_on_the_program():
    import sbpflow
    from sbpflow import nn

    class Step(sbpflow.nn.Graph):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def build(self, x):
            return (x * self.m.w).sum()  # the user's line

    m = nn.Linear(4, 4)
    m.w = nn.Parameter(sbpflow.ones(4))
    for record in (False, True):
        g = Step(m)
        g.config.record_stack_traces = record
        g(sbpflow.ones(2, 4))
        gm = next(iter(g._programs.values())).gm
        sites = [verify._site(n) for n in gm.graph.nodes if n.op == "call_function"]
        if record:
            assert any("test_verify.py" in s and "build" in s for s in sites), sites
        else:
            assert not any(sites), sites
