"""Predict a graph's training step from its logical graph (``graph.lower()``) and a
hardware profile: the cost model applied op by op, so that two layouts of one model can be
ranked before either runs.

Terms (seconds, this rank):

* ``compute``: each forward op of the logical graph at the larger of its FLOPs on this
  rank's shards (torch's flop counter, recorded by the logical graph) over the achieved
  matmul rate and its shards' bytes (inputs read, output written) over the achieved
  memory bandwidth (:func:`sbpflow.planner.cost.op_time`); backward counted as twice the
  forward (the usual ratio for matmul-dominated models: an input and a weight gradient
  per product);
* ``communication``: every boxing step and every other collective (gradient reductions,
  a global algorithm's own) at :func:`sbpflow.planner.cost.collective_time`'s ring cost
  over its mesh axis, forward and backward as the logical graph records them; no overlap
  with compute assumed.

Left out: the optimizer update, Python and dispatch overhead (a compiled graph has
little), kernel efficiency by size, overlap. The logical graph is one micro-batch's; a
step of ``m`` micro-batches is ``m`` times its forward and backward.
"""

from __future__ import annotations

from .cost import COLLECTIVES, collective_time, op_time, sent_time
from .hardware import Hardware

__all__ = ["predict_memory", "predict_step"]

#: Boxing steps that move no data between ranks (their cost is none).
LOCAL_STEPS = ("slice", "zero_fill", "pad", "")


def _shard_bytes(pl, shape, sbp, dtype) -> int:
    if pl is None or sbp is None:
        n = 1
        for d in shape:
            n *= d
        return n * dtype.itemsize
    n = 1
    for d in pl.shard_shape(tuple(shape), sbp):
        n *= d
    return n * dtype.itemsize


def _op_seconds(lg, node, hw: Hardware, dtype: str) -> float:
    sig = node.signature
    read = sum(_shard_bytes(node.placement, m.shape, s, m.dtype)
               for m, s in zip(node.metas, sig.ins))
    wrote = sum(_shard_bytes(lg.values[v].placement, lg.values[v].shape, lg.values[v].sbp,
                             lg.values[v].dtype) for v in node.outputs if v in lg.values)
    flops = node.flops[node.chosen] or 0
    return op_time(flops, read + wrote, hw, dtype)


def _step_seconds(step, hw: Hardware) -> float:
    """One boxing step: its collective over the mesh axis it acts on (``step.bytes``:
    what each rank sends), or a transfer between placements."""
    if step.collective in LOCAL_STEPS:
        return 0.0
    pl = step.placement
    n = pl.shape[step.axis] if step.axis is not None else pl.size
    link = hw.link(inter_node=n > hw.devices_per_node)
    if step.kind == "transfer" or step.collective in ("send_recv", "transfer"):
        return sent_time("send_recv", step.bytes, 2, link)
    kind = step.collective if step.collective in COLLECTIVES else "all_to_all"
    return sent_time(kind, step.bytes, n, link)


def predict_step(lg, hw: Hardware, dtype: str = "float32", micro_batches: int = 1) -> dict:
    """Seconds of one step of the graph whose logical graph is ``lg``
    (:class:`sbpflow.graph.ir.LogicalGraph`) on ``hw``: ``{"compute", "communication",
    "total"}`` (see the module doc). ``dtype``: the matmuls' dtype name in ``hw``'s
    ``peak_flops``.

    Raises:
        KeyError: ``hw`` lists no peak for ``dtype``.
    """
    from ..graph.ir import BoxingNode, CollectiveNode, OpNode

    compute = comm = 0.0
    for node in lg.nodes:
        if isinstance(node, OpNode) and node.phase == "forward":
            compute += 3 * _op_seconds(lg, node, hw, dtype)  # forward + backward (2x)
        elif isinstance(node, BoxingNode):
            comm += sum(_step_seconds(s, hw) for s in node.plan.steps)
        elif isinstance(node, CollectiveNode):
            n = len(node.ranks) if node.ranks else 1
            kind = node.kind if node.kind in ("all_reduce", "all_gather", "reduce_scatter",
                                              "all_to_all", "broadcast") else "send_recv"
            link = hw.link(inter_node=n > hw.devices_per_node)
            comm += collective_time(kind, node.bytes, max(n, 1) if kind != "send_recv"
                                    else 2, link)
    compute *= micro_batches
    comm *= micro_batches
    return {"compute": compute, "communication": comm, "total": compute + comm}


def predict_memory(lg, state_per_param: float = 2.0) -> dict:
    """Bytes one rank holds at the peak of a step of the graph whose logical graph is
    ``lg``, by term:

    * ``parameters``: every parameter's shard on this rank;
    * ``gradients``: as many (the gradients of the trainable ones, same layouts);
    * ``optimizer``: ``state_per_param`` float32 values per parameter element of this
      rank (2: Adam/AdamW's moments; 1: SGD with momentum; 0: plain SGD);
    * ``activations``: every forward op's output shard of one micro-batch (an upper
      bound of what autograd keeps for backward: views and outputs it frees early are
      counted too).

    ``total`` is their sum. Left out: the allocator's fragmentation and workspace,
    temporaries of backward (a gradient lives while the next is made), buffers. Under
    gradient accumulation one micro-batch's activations are live at a time.
    """
    from ..graph.ir import OpNode

    params = grads = state = 0
    for v in lg.values.values():
        if v.kind != "param":
            continue
        b = _shard_bytes(v.placement, v.shape, v.sbp, v.dtype)
        params += b
        grads += b
        state += int(state_per_param * b / v.dtype.itemsize * 4)
    acts = 0
    seen = set()
    for node in lg.nodes:
        if isinstance(node, OpNode) and node.phase == "forward":
            for o in node.outputs:
                v = lg.values.get(o)
                if v is not None and o not in seen:
                    seen.add(o)
                    acts += _shard_bytes(v.placement, v.shape, v.sbp, v.dtype)
    out = {"parameters": params, "gradients": grads, "optimizer": state, "activations": acts}
    out["total"] = sum(out.values())
    return out
