"""The verifier every compiled per-rank program passes (ARCHITECTURE "Graph mode").

A program starts a collective or a transfer in one node and waits for it in another, so
that compute runs while data moves (:func:`sbpflow.graph.passes.overlap`). Between the two,
the backend reads the input buffers and writes the output buffers on its own threads
(gloo) or streams (NCCL). The verifier proves, on the program's ``torch.fx`` graph, that
nothing else touches them then:

1. **pairing**: every start has exactly one wait, after it; every wait waits a start;
2. **no write of an in-flight input**: between a start and its wait, no node writes a
   buffer the collective reads (its input, or any view or alias of it);
3. **no access to an in-flight output**: between a start and its wait, no node reads or
   writes a buffer the collective writes (its output; for an in-place collective, its
   input too), through any alias;
4. **liveness**: every such buffer is referenced by the program until the wait (a replay
   frees a value after its last use: a buffer whose last use is the start could be freed,
   and its memory reused, while the backend still reads or writes it). :func:`hold`
   makes this true by construction; the verifier checks it;
5. **one order**: the collectives of each process group come in the same order with the
   same shapes and dtypes on every member, and each transfer's send matches its receive
   (tag, shape, dtype) on the peer. Checked across ranks at compile time by exchanging a
   digest (:func:`check_order`).

Aliasing is read from the ops' schemas (``Tensor(a)`` returns alias their ``Tensor(a)``
arguments; ``Tensor(a!)`` arguments are written), so a view, a ``split`` or an in-place
update of an in-flight buffer is caught through any chain of views. An op without a
schema (a Python function in the program) is taken to write all its tensor arguments.

A violation raises :class:`~sbpflow.graph.GraphError` at compile time naming the
collective, the offending node and, where the trace recorded it, its source line.
"""

from __future__ import annotations

import hashlib
import operator
import os
import time
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from . import passes

__all__ = ["Report", "check_order", "collective_digest", "hold", "verify"]


def _hold(tensors: list[torch.Tensor]) -> None:
    """``sbpflow::hold``: nothing. Its arguments are referenced by the program until it
    runs, just after a collective's wait (see :func:`hold`)."""


_lib = torch.library.Library("sbpflow", "FRAGMENT")  # noqa: TID251 - program ops
_lib.define("hold(Tensor[] tensors) -> ()")
_lib.impl("hold", _hold, "CompositeExplicitAutograd")
HOLD = torch.ops.sbpflow.hold.default
fx.node.has_side_effect(HOLD)  # never dead code: its point is to be last
_SOURCE_HASH = hashlib.sha1(open(__file__, "rb").read()).hexdigest()[:12]


# ----------------------------------------------------------------------- classification

def _namespace(target) -> str | None:
    return getattr(target, "namespace", None)


def _is_wait(node: fx.Node) -> bool:
    return node.op == "call_function" and passes._is_wait(node.target)


def _is_start(node: fx.Node) -> bool:
    return node.op == "call_function" and passes._is_collective(node.target) and \
        not passes._is_wait(node.target)


def _is_p2p_start(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is passes._P2P


def _schema(node: fx.Node):
    return getattr(node.target, "_schema", None) if node.op == "call_function" else None


def _tensor_nodes(v) -> list[fx.Node]:
    if isinstance(v, fx.Node):
        return [v]
    if isinstance(v, (list, tuple)):
        return [x for item in v for x in _tensor_nodes(item)]
    if isinstance(v, dict):
        return [x for item in v.values() for x in _tensor_nodes(item)]
    return []


def _arg_values(node: fx.Node, schema) -> list[tuple[object, object]]:
    """(schema argument, value) for each argument of ``node``."""
    out = []
    for i, arg in enumerate(schema.arguments):
        if i < len(node.args):
            out.append((arg, node.args[i]))
        elif arg.name in node.kwargs:
            out.append((arg, node.kwargs[arg.name]))
    return out


# ------------------------------------------------------------------------------- aliases


class _Aliases:
    """For each node, the buffers (root nodes) its value may share memory with."""

    def __init__(self, g: fx.Graph) -> None:
        self.roots: dict[fx.Node, frozenset] = {}
        for node in g.nodes:
            self.roots[node] = self._of(node)

    def of(self, v) -> frozenset:
        out: set = set()
        for n in _tensor_nodes(v):
            out |= self.roots.get(n, frozenset({n}))
        return frozenset(out)

    def _of(self, node: fx.Node) -> frozenset:
        me = frozenset({node})
        if node.op != "call_function":
            return me
        t = node.target
        if t is operator.getitem:
            src = node.args[0]
            if not isinstance(src, fx.Node):
                return me
            base = self.roots.get(src, frozenset({src}))
            # an element of a fresh list (a coalesced collective's or a transfer's
            # outputs) is a buffer of its own; of an aliasing list (split), the base
            return me if base == frozenset({src}) else base
        if _is_wait(node):  # the wait returns the buffer it waited for
            return self.of(node.args[0])
        schema = _schema(node)
        if schema is None:
            return me
        sets = set()
        for ret in schema.returns:
            if ret.alias_info is not None:
                sets |= set(ret.alias_info.before_set)
        if not sets:
            return me
        out: set = set()
        for arg, v in _arg_values(node, schema):
            if arg.alias_info is not None and set(arg.alias_info.before_set) & sets:
                out |= self.of(v)
        return frozenset(out) if out else me

    def written(self, node: fx.Node) -> frozenset:
        """The buffers ``node`` may write."""
        if node.op != "call_function" or node.target is operator.getitem or \
                node.target is HOLD or _is_wait(node):
            return frozenset()
        schema = _schema(node)
        if schema is None:
            if getattr(node.target, "__module__", "").startswith("_operator") or \
                    getattr(node.target, "_sbpflow_pure", False):
                return frozenset()
            return self.of(list(node.args) + list(node.kwargs.values()))
        out: set = set()
        for arg, v in _arg_values(node, schema):
            if arg.alias_info is not None and arg.alias_info.is_write:
                out |= self.of(v)
        return frozenset(out)

    def read(self, node: fx.Node) -> frozenset:
        """The buffers whose data ``node`` may read (a view reads none: it only makes a
        new alias, whose own readers count)."""
        if node.op != "call_function" or node.target is operator.getitem or \
                node.target is HOLD:
            return frozenset()
        if self.roots[node] != frozenset({node}) and not self.written(node):
            return frozenset()  # a view
        return self.of(list(node.args) + list(node.kwargs.values()))


# ------------------------------------------------------------------------------ in flight


@dataclass
class _Flight:
    """One collective (or one transfer of a batch) between its start and its wait."""

    start: fx.Node
    handle: fx.Node  # the value the wait takes: the start, or getitem(start, i)
    wait: fx.Node | None
    inputs: frozenset  # buffers it reads while in flight
    outputs: frozenset  # buffers it writes while in flight


def _describe(node: fx.Node) -> str:
    t = node.target
    name = str(t) if _namespace(t) else getattr(t, "__name__", None) or str(t)
    site = _site(node)
    return f"%{node.name} = {name}(...)" + (f" [{site}]" if site else "")


def _site(node: fx.Node) -> str:
    """The user's source line that made ``node``, where the trace recorded it."""
    st = node.meta.get("stack_trace")
    if st:
        lines = [ln.strip() for ln in st.strip().splitlines() if ln.strip().startswith("File")]
        inside = (f"{os.sep}torch{os.sep}", f"{os.sep}sbpflow{os.sep}")
        user = [ln for ln in lines if not any(d in ln for d in inside)]
        picked = user or lines  # the innermost user frame, else the innermost frame
        if picked:
            return picked[-1]
    return ""


def _flights(g: fx.Graph, al: _Aliases) -> tuple[list[_Flight], list[str]]:
    flights, problems = [], []
    for node in g.nodes:
        if not _is_start(node):
            continue
        if _is_p2p_start(node):
            ops, tensors = node.args[0], node.args[3]
            items = {u.args[1]: u for u in node.users if u.target is operator.getitem}
            for i, op in enumerate(ops):
                h = items.get(i)
                if h is None:
                    problems.append(f"{_describe(node)}: transfer {i} ({op}) is never waited")
                    continue
                ins = al.of(tensors[i]) if op == "isend" else frozenset()
                flights.append(_Flight(node, h, None, ins, al.roots[h]))
            continue
        schema = _schema(node)
        inplace = schema is not None and any(
            a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)
        ins = al.of(list(node.args) + list(node.kwargs.values()))
        if isinstance(node.meta.get("val"), (list, tuple)):
            for u in node.users:
                if u.target is operator.getitem:
                    flights.append(_Flight(node, u, None, ins, al.roots[u]))
        else:
            outs = al.roots[node] | (ins if inplace else frozenset())
            flights.append(_Flight(node, node, None, ins, outs))
    for f in flights:
        waits = [u for u in f.handle.users if _is_wait(u)]
        if len(waits) != 1:
            problems.append(f"{_describe(f.start)} has {len(waits)} waits "
                            f"({', '.join('%' + w.name for w in waits) or 'none'}); a start "
                            f"needs exactly one")
            continue
        f.wait = waits[0]
    for node in g.nodes:
        if _is_wait(node):
            src = node.args[0]
            start = src.args[0] if isinstance(src, fx.Node) and \
                src.target is operator.getitem else src
            if not (isinstance(start, fx.Node) and _is_start(start)):
                problems.append(f"{_describe(node)} waits %{getattr(src, 'name', src)}, "
                                f"which no collective started")
    return flights, problems


def _conflict(n: fx.Node, f: _Flight, al: _Aliases) -> str | None:
    """What ``n``, run while ``f`` is in flight, does that rules 2-3 forbid, or None."""
    w = al.written(n)
    if w & f.inputs:
        return "writes the input"
    if w & f.outputs:
        return "writes the output"
    if al.read(n) & f.outputs:
        return "reads the output"
    return None


def _last_refs(nodes: list, index: dict, al: _Aliases) -> dict:
    """Each buffer's last position in ``nodes`` at which some alias of it is used."""
    last: dict = {}
    for n in nodes:
        for v in n.all_input_nodes:
            for r in al.roots.get(v, (v,)):
                last[r] = max(last.get(r, -1), index[n])
    return last


# --------------------------------------------------------------------------------- verify


@dataclass
class Report:
    """What :func:`verify` checked: ``collectives`` (starts), ``transfers`` in flight
    checked (one per output of a batch), ``nodes`` of the program, ``seconds`` it took."""

    collectives: int = 0
    transfers: int = 0
    nodes: int = 0
    seconds: float = 0.0
    problems: list[str] = field(default_factory=list)


def verify(gm: fx.GraphModule | fx.Graph, *, what: str = "program",
           raise_errors: bool = True, liveness: bool = True) -> Report:
    """Check rules 1-4 of the module doc on ``gm``'s graph.

    Args:
        gm: a per-rank program (after :func:`sbpflow.graph.passes.overlap` and :func:`hold`),
            or its graph.
        what: how the error names the program.
        raise_errors: raise on a violation (else only report it in ``Report.problems``).
        liveness: check rule 4 (off for graphs whose buffers another planner owns).

    Returns:
        a :class:`Report`.

    Raises:
        GraphError: a violation, naming the collective, the offending node and its source
            line where known.
    """
    t0 = time.perf_counter()
    g = gm if isinstance(gm, fx.Graph) else gm.graph
    nodes = list(g.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    al = _Aliases(g)
    flights, problems = _flights(g, al)
    last_ref = _last_refs(nodes, index, al)
    held_forever = {n for n in nodes if n.op in ("placeholder", "get_attr")}
    for f in flights:
        if f.wait is None:
            continue
        lo, hi = index[f.start], index[f.wait]
        if hi <= lo:
            problems.append(f"{_describe(f.start)} is waited before it starts "
                            f"({_describe(f.wait)})")
            continue
        for n in nodes[lo + 1:hi]:
            if n is f.handle:
                continue
            what = _conflict(n, f, al)
            if what:
                problems.append(f"{_describe(n)} {what} of the in-flight "
                                f"{_describe(f.start)} before its wait %{f.wait.name}")
        if liveness:
            for r in f.inputs | f.outputs:
                if r in held_forever or last_ref.get(r, -1) >= hi:
                    continue
                problems.append(f"a buffer of the in-flight {_describe(f.start)} (%{r.name}) "
                                f"is last referenced before its wait %{f.wait.name}: the "
                                f"replay may free it while the backend uses it")
    rep = Report(len({f.start for f in flights if not _is_p2p_start(f.start)}),
                 sum(1 for f in flights if _is_p2p_start(f.start)), len(nodes),
                 time.perf_counter() - t0, problems)
    if problems and raise_errors:
        from .trace import GraphError

        more = f"\n  (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        lines = any(n.meta.get("stack_trace") for n in nodes)
        hint = "" if lines else ("\n  (set graph.config.record_stack_traces = True before "
                                 "the first call to name each node's source line)")
        raise GraphError(f"the compiled {what} is not memory-safe: "
                         + "\n  ".join([""] + problems[:5]) + more + hint)
    return rep


def settle(gm: fx.GraphModule, recompile: bool = True) -> fx.GraphModule:
    """Move each wait up to just before the first node between its start and it that
    writes the collective's input or touches its output (rules 2 and 3), so that such a
    node runs on a settled buffer.

    A pipeline's sends are waited at the end of the step (after the update, so that no
    rank blocks on a peer that is still computing); a send of a parameter (a tied
    weight sent to another stage) was then still in flight when the update wrote the
    parameter in place: the peer could receive the updated or a torn value. Waiting
    earlier cannot deadlock there: every send of the step is posted before the update,
    and a peer's receive never waits on this rank's update."""
    g = gm.graph
    al = _Aliases(g)
    flights, _ = _flights(g, al)
    changed = False
    for f in flights:
        if f.wait is None:
            continue
        nodes = list(g.nodes)
        lo, hi = nodes.index(f.start), nodes.index(f.wait)
        for n in nodes[lo + 1:hi]:
            if n is not f.handle and _conflict(n, f, al):
                n.prepend(f.wait)
                changed = True
                break
    if changed:
        g.lint()
        if recompile:
            gm.recompile()
    return gm


_POST_GRAD_CHECK = None


def post_grad_check(check: bool = True):
    """A ``PostGradCheck`` (below) for ``check``; the class is made at the first call, so
    that importing sbpflow does not import inductor (1.3 s of every process start)."""
    global _POST_GRAD_CHECK
    if _POST_GRAD_CHECK is None:
        from torch._inductor.custom_graph_pass import CustomGraphPass

        class PostGradCheck(CustomGraphPass):
            """inductor's ``post_grad_custom_post_pass`` on each graph inductor compiles,
            after its own rewrites: :func:`verify` (rules 1-3; ``check``), then
            :func:`keep_order`.

            (A graph inductor takes from its cache was checked and ordered when it was
            compiled.)"""

            def __init__(self, check: bool = True) -> None:
                self.check = check

            def __call__(self, graph: fx.Graph) -> None:
                if self.check:
                    verify(graph, what="torch.compile'd program", liveness=False)
                keep_order(graph)

            def uuid(self) -> str:  # inductor's cache key for custom passes
                return f"sbpflow.graph.verify.PostGradCheck:{self.check}:{_SOURCE_HASH}"

        _POST_GRAD_CHECK = PostGradCheck
    return _POST_GRAD_CHECK(check)


def keep_order(graph: fx.Graph) -> None:
    """Make each collective start depend on the one before it (inductor's ``control_deps``),
    so that inductor's scheduler issues them in program order.

    Without it the scheduler orders independent nodes by its own heuristics, which see the
    whole graph; where the ranks' graphs differ (gradient clipping counts a replicated
    gradient on one rank of its axis only; uneven shards), two independent collectives
    of one shape could be issued in one order on one rank and the other order on
    another, and gloo or NCCL would pair them: silently wrong numbers (gpt-mini TP(2)
    with clipping, the vocabulary-parallel cross entropy's all-reduces). The program
    order is the same on every rank (:func:`check_order`)."""
    from torch._inductor.fx_passes.control_dependencies import preserve_node_ordering
    from torch.utils._ordered_set import OrderedSet

    starts = [n for n in graph.nodes if _is_start(n)]
    deps = {b: OrderedSet([a]) for a, b in zip(starts, starts[1:])}
    if deps:
        preserve_node_ordering(graph, deps)


def hold(gm: fx.GraphModule, recompile: bool = True) -> fx.GraphModule:
    """Keep each in-flight buffer referenced until its wait: where a collective's input
    (or a transfer's) is last used before the wait, a ``sbpflow::hold`` of it follows the
    wait. The backends keep their own reference too (torch's c10d works hold their
    tensors); this makes the program's guarantee its own, under any replay or compiler
    that frees a value at its last use."""
    g = gm.graph
    al = _Aliases(g)
    flights, _ = _flights(g, al)
    nodes = list(g.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    last_ref = _last_refs(nodes, index, al)
    changed = False
    for f in flights:
        if f.wait is None:
            continue
        hi = index[f.wait]
        src = [f.start.args[3][f.handle.args[1]]] if _is_p2p_start(f.start) else \
            _tensor_nodes(list(f.start.args) + list(f.start.kwargs.values()))
        keep = [v for v in src if isinstance(v, fx.Node) and v.op not in
                ("placeholder", "get_attr") and
                any(last_ref.get(r, -1) < hi for r in al.roots.get(v, (v,)))]
        if _is_p2p_start(f.start) and f.start.args[0][f.handle.args[1]] != "isend":
            keep = []  # a receive's template argument gives only its shape
        if keep:  # after the wait (its result the first argument: ordered after it)
            with g.inserting_after(f.wait):
                g.call_function(HOLD, ([f.wait, *keep],))
            changed = True
    if changed:
        g.lint()
        if recompile:
            gm.recompile()
    return gm


# ---------------------------------------------------------------------------- one order


def _val(node) -> str:
    v = node.meta.get("val") if isinstance(node, fx.Node) else None
    if isinstance(v, torch.Tensor):
        return f"{tuple(v.shape)}:{str(v.dtype).replace('torch.', '')}"
    return "?"


def _group_ranks(name) -> tuple:
    """The global ranks of the process group sbpflow made under ``name`` (its groups are
    cached per sorted rank tuple); an unknown name is compared as itself."""
    from ..distributed import _state

    for key, group in _state._state.groups.items():
        if getattr(group, "group_name", None) == name:
            return tuple(key)
    return (str(name),)


def collective_digest(gm: fx.GraphModule) -> dict:
    """This rank's collectives per group and transfers per peer, in program order:
    ``{"groups": {ranks: [description, ...]}, "sends": {peer: [...]}, "recvs": {peer:
    [...]}}``. Descriptions hold the op, shapes and dtypes (never a node name)."""
    groups: dict = {}
    sends: dict = {}
    recvs: dict = {}
    for n in gm.graph.nodes:
        if not _is_start(n):
            continue
        if _is_p2p_start(n):
            ops, peers, tags, tensors = n.args[0], n.args[1], n.args[2], n.args[3]
            for op, peer, tag, t in zip(ops, peers, tags, tensors):
                book = sends if op == "isend" else recvs
                book.setdefault(int(peer), []).append(f"tag {tag} {_val(t)}")
            continue
        name = getattr(getattr(n.target, "_overloadpacket", n.target), "__name__",
                       str(n.target))
        gname = n.args[-1] if n.args else n.kwargs.get("group_name")
        if name.startswith("all_to_all"):  # split sizes and shapes differ across ranks
            ins = ",".join(_val(v).split(":")[-1] for v in _tensor_nodes(list(n.args)))
            consts = []
        else:
            ins = ",".join(_val(v) for v in _tensor_nodes(list(n.args)))
            consts = [a for a in n.args[1:-1] if not isinstance(a, fx.Node)]
        groups.setdefault(_group_ranks(gname), []).append(f"{name}({ins}; {consts})")
    # gloo pairs a send with its receive by tag, whatever the order of the transfers
    return {"groups": groups, "sends": {p: sorted(v) for p, v in sends.items()},
            "recvs": {p: sorted(v) for p, v in recvs.items()}}


def _hash(items: list[str]) -> str:
    return hashlib.sha1("\n".join(items).encode()).hexdigest()[:16]


def check_order(gm: fx.GraphModule, what: str = "program") -> float:
    """Rule 5: every rank's collectives agree with its peers'. Every rank of the world
    calls it when it compiles (one small all-gather of digests). Returns its seconds.

    Raises:
        GraphError: on every rank, naming the group (or the pair of ranks) and the first
            collective (or transfer) where two ranks' programs differ.
    """
    import json

    from ..distributed import _comm, get_rank, get_world_size

    t0 = time.perf_counter()
    world = get_world_size()
    if world == 1:
        return 0.0
    me = get_rank()
    d = collective_digest(gm)
    brief = {"g": {",".join(map(str, k)): _hash(v) for k, v in d["groups"].items()},
             "s": {str(p): _hash(v) for p, v in d["sends"].items()},
             "r": {str(p): _hash(v) for p, v in d["recvs"].items()}}
    ranks = tuple(range(world))
    with _comm.untraced():
        rows = [json.loads(b) for b in
                _comm.all_gather_bytes(json.dumps(brief).encode(), ranks)]
    bad = _first_disagreement(rows)
    if bad is not None:  # every rank sees the same rows: every rank exchanges the details
        full = {"g": {",".join(map(str, k)): v for k, v in d["groups"].items()},
                "s": {str(p): v for p, v in d["sends"].items()},
                "r": {str(p): v for p, v in d["recvs"].items()}}
        with _comm.untraced():
            rows = [json.loads(b) for b in
                    _comm.all_gather_bytes(json.dumps(full).encode(), ranks)]
        from .trace import GraphError

        raise GraphError(f"rank {me}: the compiled {what}s differ across ranks: "
                         f"{_explain(bad, rows)}. Every rank must compile the same step "
                         f"(same build(), modules, config and input signature)")
    return time.perf_counter() - t0


def _first_disagreement(rows: list[dict]):
    for r, row in enumerate(rows):
        for key, h in row["g"].items():
            for m in (int(x) for x in key.split(",") if x.isdigit()):
                if rows[m]["g"].get(key) != h:
                    return ("g", key, r, m)
        for p, h in row["s"].items():
            if rows[int(p)]["r"].get(str(r)) != h:
                return ("s", p, r, int(p))
    return None


def _explain(bad, rows: list[dict]) -> str:
    kind, key, a, b = bad
    if kind == "g":
        la, lb = rows[a]["g"].get(key, []), rows[b]["g"].get(key, [])
        where = f"the collectives of group [{key}]"
    else:
        la, lb = rows[a]["s"].get(key, []), rows[b]["r"].get(str(a), [])
        where = f"rank {a}'s sends to rank {b} and rank {b}'s receives from rank {a}"
    for i in range(max(len(la), len(lb))):
        x = la[i] if i < len(la) else "(nothing)"
        y = lb[i] if i < len(lb) else "(nothing)"
        if x != y:
            return f"{where}: #{i} is {x} on rank {a} but {y} on rank {b}"
    return f"{where}: rank {a} has {len(la)}, rank {b} has {len(lb)}"
