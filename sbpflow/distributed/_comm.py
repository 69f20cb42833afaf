"""The only place sbpflow calls torch.distributed collectives.

Every wrapper here:

1. takes the group as a tuple of global ranks in *mesh coordinate order* (the order
   in which results are laid out), and maps it to torch's group ranks itself;
2. first checks that every rank of the group is about to run the same collective with
   the same signature (:func:`_check`: a fingerprint exchange by default, the full
   description with ``SBPFLOW_DEBUG=1``), and raises :class:`CollectiveMismatchError`
   naming both sides when not (gloo alone would pair two same-sized but different
   collectives and return wrong numbers, or abort the process on different sizes);
3. logs the call to every active :class:`CommRecorder`;
4. waits with the configured timeout and turns a failure (a peer exited, hung or
   diverged) into :class:`CollectiveError` naming the operation, group and ranks.

Byte counts in records are the bytes of the tensor this rank hands to the collective
(all_reduce, broadcast, send: the tensor; all_gather: the local input; reduce_scatter,
all_to_all: the full input).
"""

from __future__ import annotations

import contextlib
import datetime
import math
import os
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from . import _fifo, _state
from ._state import (  # noqa: F401 - release_works: part of this module's surface
    CollectiveError,
    CollectiveMismatchError,
    _recent_works,
    release_works,
)

_DEBUG_BYTES = 512
# torch >= 2.10 renamed the tensor-in/tensor-out collectives; keep working on both.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass(frozen=True)
class CommRecord:
    """One collective that ran on this rank.

    Attributes:
        kind: ``all_reduce``, ``all_gather``, ``reduce_scatter``, ``all_to_all``,
            ``broadcast``, ``reduce``, ``send_recv`` or ``barrier``.
        axis: the mesh axis it ran over (``None`` when not a mesh-axis collective).
        ranks: the group's global ranks, in mesh coordinate order.
        bytes: bytes of the tensor this rank handed to the collective.
        dtype: the tensor's dtype (``None`` for a barrier).
    """

    kind: str
    axis: int | None
    ranks: tuple[int, ...]
    bytes: int
    dtype: torch.dtype | None = None


@dataclass
class CommRecorder:
    """Context manager that logs every collective sbpflow runs on this rank.

    Example::

        with sbpflow.distributed.CommRecorder() as rec:
            y = x.to_global(sbp=sbpflow.sbp.broadcast)
        assert rec.kinds() == ["all_gather"]

    Collectives over a group of one rank are not run and so not logged.
    """

    records: list[CommRecord] = field(default_factory=list)
    include_metadata: bool = False

    def __enter__(self) -> CommRecorder:
        _recorders.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _recorders.remove(self)

    def kinds(self) -> list[str]:
        return [r.kind for r in self.records]

    def count(self, kind: str | None = None) -> int:
        return sum(1 for r in self.records if kind is None or r.kind == kind)

    def total_bytes(self) -> int:
        return sum(r.bytes for r in self.records)

    def __str__(self) -> str:
        lines = [f"{len(self.records)} collective(s), {self.total_bytes()} bytes"]
        for r in self.records:
            lines.append(f"  {r.kind:<14} axis={r.axis} ranks={list(r.ranks)} bytes={r.bytes}")
        return "\n".join(lines)


_recorders: list[CommRecorder] = []


def _record(kind: str, axis, ranks, nbytes: int, dtype, metadata: bool = False) -> None:
    for rec in _recorders:
        if metadata and not rec.include_metadata:
            continue
        rec.records.append(CommRecord(kind, axis, tuple(ranks), int(nbytes), dtype))


def _group_rank_order(ranks: Sequence[int]):
    """(process group, position in ``ranks`` of each group rank)."""
    group = _state.group_of(tuple(ranks))
    sorted_ranks = sorted(ranks)
    pos = {r: i for i, r in enumerate(ranks)}
    return group, [pos[r] for r in sorted_ranks]


def _describe(kind: str, ranks, axis, sig: str) -> str:
    where = f"mesh axis {axis}, " if axis is not None else ""
    return f"{kind}({sig}) over {where}ranks {list(ranks)}"


def _wait(works, what: str, ranks) -> None:
    timeout = _state.timeout_s()
    t0 = time.monotonic()
    try:
        for w in works if isinstance(works, (list, tuple)) else [works]:
            if w is not None:
                w.wait(datetime.timedelta(seconds=timeout))
                _recent_works.append(w)
    except Exception as e:  # noqa: BLE001 - re-raised with context
        raise CollectiveError(
            f"rank {_state.get_rank()}: {what} did not complete after "
            f"{time.monotonic() - t0:.1f}s (timeout {timeout:g}s): {type(e).__name__}: {e}. "
            f"A peer among ranks {list(ranks)} may have exited, hung, or run a different "
            f"collective; "
            + ("set SBPFLOW_CHECK=fast to check that collectives agree across ranks, "
               if _state.check_mode() == "off" else "")
            + "SBPFLOW_TIMEOUT to change the timeout"
        ) from e


_FINGERPRINT = 4  # int64s: sequence number on the group, checksum of the signature, 0, 0
_P2P_CHECK_MAX = 8  # groups up to this size exchange fingerprints point to point
_CHECK_TAG = 0x5BF1C  # the fingerprints' point-to-point tag (payload sends use tag 0)
_P2P_TAG_BASE = 1 << 25  # traced transfers: this plus their sequence number
_P2P_SEQ_MOD = 1 << 24


def p2p_tag(seq: int) -> int:
    """The point-to-point tag of the world's traced transfer number ``seq``."""
    return _P2P_TAG_BASE + seq % _P2P_SEQ_MOD


def p2p_seq(tag: int) -> int:
    """The transfer number (modulo ``2**24``) a :func:`p2p_tag` stands for."""
    return (tag - _P2P_TAG_BASE) % _P2P_SEQ_MOD


def _check(kind: str, ranks, axis, sig: str, speculate: bool = False):
    """Check that every rank of the group is about to run this collective; raise
    :class:`CollectiveMismatchError` on every rank, naming both sides, if not.

    ``fast`` (the default): each rank sends every peer a 32-byte fingerprint (the
    collective's sequence number on the group and a CRC-32 of its kind, shape, dtype and
    arguments) and compares theirs with its own; only after a mismatch are the full
    descriptions exchanged, for the message. Ranks on one host use named pipes
    (:mod:`._fifo`, about 30 us); other groups up to 8 ranks gloo point-to-point
    messages, larger ones one all-gather. ``full`` (``SBPFLOW_DEBUG=1``): the full
    descriptions every time, through gloo. ``off``: nothing. The check runs before the
    collective because gloo cannot survive a mismatch: two collectives of equal byte
    counts pair silently (wrong numbers), of different counts abort the process in C++.

    Waiting for the peers' fingerprints before sending any data would cost the overlap
    of an early rank's send with a late rank's work (11% of a tensor-parallel gpt-mini
    step on 2 CPU cores). So with ``speculate`` (named pipes only) the FIRST rank to
    arrive, the one that finds no peer's fingerprint yet, returns a verifier at once and
    the caller posts the collective, then calls ``verifier()`` before using the result;
    every later rank finds the earlier ones' fingerprints and verifies before posting.
    Each rank sends before it looks, so at most one rank of a group can find nothing:
    the speculative rank's data are only ever received by ranks that verified it first.
    """
    _state.solo_guard(f"the agreement check of a {kind} over ranks {list(ranks)}")
    st = _state._state
    if not st.initialized:
        _state._ensure()
    mode = "full" if st.config.debug else st.config.check
    if mode == "off":
        return None
    key = tuple(sorted(ranks))
    seq = st.sequence.get(key, 0) + 1
    st.sequence[key] = seq
    me = _describe(kind, ranks, axis, sig)
    if st.site:  # a value read: where it was read is part of what must agree
        me = f"{me} for a read at {st.site}"
    if mode == "full":
        _exchange_descriptions(me, ranks, axis, seq)
        return None
    crc = zlib.crc32(me.encode())
    group, _ = _group_rank_order(ranks)
    if _recorders:
        _record("check", axis, ranks, 8 * _FINGERPRINT, torch.int64, metadata=True)
    fifo = st.fifos[key] if key in st.fifos else \
        (_fifo_of(ranks, group, me) if len(ranks) <= _P2P_CHECK_MAX else None)
    if fifo is None:
        if not _gloo_fingerprints(seq, crc, ranks, group, f"agreement check before {me}"):
            _exchange_descriptions(me, ranks, axis, seq)  # every rank got here: explain
        return None

    def verify() -> None:
        try:
            theirs = fifo.wait_checksums(seq, st.config.timeout_s)
        except (TimeoutError, ConnectionError) as e:
            raise CollectiveError(
                f"rank {st.rank}: agreement check before {me} did not complete: {e}. A "
                f"peer among ranks {list(ranks)} may have exited, hung, or run a "
                f"collective on another group; SBPFLOW_TIMEOUT to change the timeout") from e
        if any(c != crc for c in theirs.values()):
            _exchange_descriptions(me, ranks, axis, seq, fifo)

    try:
        fifo.send(seq, crc)
    except ConnectionError as e:
        raise CollectiveError(f"rank {st.rank}: agreement check before {me} failed: {e}") \
            from e
    if speculate and not fifo.arrived(seq):
        return verify
    verify()
    return None


def _gloo_fingerprints(seq: int, crc: int, ranks, group, what: str) -> bool:
    """Exchange fingerprints through gloo; whether every member's equals this rank's."""
    mine = torch.tensor([seq, crc, 0, 0], dtype=torch.int64)
    if len(ranks) <= _P2P_CHECK_MAX:
        # Point-to-point with every peer: one message latency (gloo's all-gather of 32
        # bytes took 2-3x longer on a 2-core machine). Their own tag keeps these apart
        # from the payload's sends and receives.
        me_rank = _state.get_rank()
        peers = [r for r in ranks if r != me_rank]
        theirs = torch.empty(len(peers), _FINGERPRINT, dtype=torch.int64)
        ops = [dist.P2POp(dist.isend, mine, p, group, _CHECK_TAG) for p in peers]
        ops += [dist.P2POp(dist.irecv, theirs[i], p, group, _CHECK_TAG)
                for i, p in enumerate(peers)]
        try:
            works = dist.batch_isend_irecv(ops)
        except Exception as e:  # noqa: BLE001
            raise CollectiveError(f"rank {me_rank}: {what} failed: {e}") from e
        _wait(works, what, ranks)
        return torch.equal(theirs, mine.expand(len(peers), -1))
    out = torch.empty(len(ranks) * _FINGERPRINT, dtype=torch.int64)
    _wait(_all_gather_single(out, mine, group=group, async_op=True), what, ranks)
    return torch.equal(out.view(len(ranks), _FINGERPRINT), mine.expand(len(ranks), -1))


def _fifo_of(ranks, group, me: str) -> _fifo.FifoExchange | None:
    """The same-host fingerprint pipes of the group of ``ranks`` (made at its first
    check: two unchecked, fixed-size all-gathers of the group), or ``None`` when its
    ranks are not all on this host or pipes are unavailable (then gloo carries them)."""
    st = _state._state
    key = tuple(sorted(ranks))
    if key in st.fifos:
        return st.fifos[key]
    me_rank = _state.get_rank()
    ex = None
    if _fifo.available():
        try:
            ex = _fifo.FifoExchange(me_rank, key)
        except OSError:
            ex = None
    what = f"setting up the agreement check before {me}"
    try:
        rows = _gather_fixed(f"{_fifo.host_id()}|{os.getpid()}|{ex.path if ex else ''}", key,
                             group, what)
        entries = [row.split("|", 2) for row in rows]
        usable = ex is not None and all(e[0] == entries[0][0] and e[2] for e in entries)
        if usable:
            usable = ex.connect({r: (e[2], int(e[1])) for r, e in zip(key, entries)
                                 if r != me_rank})
        # every rank must choose the same transport
        usable = all(v == "1" for v in _gather_fixed("1" if usable else "0", key, group, what))
    except BaseException:
        if ex is not None:
            ex.close()  # no FIFO left on disk by a setup that did not complete
        raise
    if ex is not None:
        if usable:
            ex.unlink()
        else:
            ex.close()
            ex = None
    st.fifos[key] = ex
    return ex


def _gather_fixed(text: str, key, group, what: str) -> list[str]:
    """Unchecked all-gather of a short string (<= 512 bytes UTF-8) over the sorted ranks
    ``key``; returns the members' strings in ``key`` order."""
    raw = text.encode()
    if len(raw) > _DEBUG_BYTES:
        raise ValueError(f"internal: {len(raw)} bytes for a {_DEBUG_BYTES}-byte exchange")
    buf = torch.zeros(_DEBUG_BYTES, dtype=torch.uint8)
    buf[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    out = torch.empty(len(key) * _DEBUG_BYTES, dtype=torch.uint8)
    _wait(_all_gather_single(out, buf, group=group, async_op=True), what, key)
    rows = out.view(len(key), _DEBUG_BYTES)
    return [bytes(rows[i].tolist()).rstrip(b"\0").decode() for i in range(len(key))]


def _exchange_descriptions(me: str, ranks, axis, seq: int, fifo=None) -> None:
    """Exchange descriptions of the collective each rank is about to run (through
    ``fifo`` when given, else a fixed-size gloo all-gather); raise
    :class:`CollectiveMismatchError` naming the first rank that differs."""
    key = f"{zlib.crc32(f'{seq}|{me}'.encode()):08x}"
    text = f"{me} [collective #{seq} on this group, issued by {_state._state.activity}]"
    if fifo is not None:
        try:
            got = fifo.exchange_descriptions(seq, f"{key}|{text}", _state.timeout_s())
        except (TimeoutError, ConnectionError) as e:  # name what did arrive
            got = {r: fifo.descriptions[r].get(seq, f"{'?' * 8}|(no description: {e})")
                   for r in fifo.writers}
        others = [(r, got[r]) for r in ranks if r in got]
    else:
        group, _ = _group_rank_order(ranks)
        _record("debug_check", axis, ranks, _DEBUG_BYTES, torch.uint8, metadata=True)
        members = tuple(sorted(ranks))
        mine = f"{key}|{text}".encode()[: _DEBUG_BYTES].decode(errors="ignore")
        others = list(zip(members, _gather_fixed(mine, members, group,
                                                 f"agreement check before {me}")))
    for rank, other in others:
        if other[:8] != key:
            raise CollectiveMismatchError(
                f"collective mismatch: rank {_state.get_rank()} is about to run {text}, but "
                f"rank {rank} is about to run {other[9:]}. The ranks' programs "
                f"diverged: a rank-dependent branch (e.g. `if rank == 0: loss.item()`: "
                f"reading a global value is collective, every rank must do it), a rank "
                f"that skipped or repeated a collective, or different shapes/layouts per rank"
            )


# Element types gloo has no kernels for (it raises "Invalid scalar type").
_GLOO_UNSUPPORTED = {torch.int16} | {getattr(torch, n) for n in ("uint16", "uint32", "uint64")
                                     if hasattr(torch, n)}


def _check_dtype(kind: str, t: torch.Tensor | None) -> None:
    if t is not None and t.device.type == "cpu" and t.dtype in _GLOO_UNSUPPORTED:
        raise TypeError(
            f"{kind} on {t.dtype} tensors: gloo (the CPU backend) cannot communicate "
            f"{t.dtype}; cast to torch.int32 or torch.int64 first (e.g. x.to(torch.int32))")


def _run(kind: str, ranks, axis, sig: str, t: torch.Tensor | None, launch) -> None:
    """Check, record, launch and wait for one collective on tensor ``t`` (its input)."""
    _check_dtype(kind, t)
    verify = _check(kind, ranks, axis, sig, speculate=True)
    _record(kind, axis, ranks, 0 if t is None else t.nbytes, None if t is None else t.dtype)
    what = _describe(kind, ranks, axis, sig)
    try:
        works = launch()
    except CollectiveError:
        raise
    except Exception as e:  # noqa: BLE001
        raise CollectiveError(
            f"rank {_state.get_rank()}: {what} failed: {type(e).__name__}: {e}") from e
    if verify is not None:  # posted ahead of the peers' fingerprints: check them now
        verify()
    _wait(works, what, ranks)


# --------------------------------------------------------------------------- graph tracing
# While an nn.Graph traces a step (sbpflow.graph), every collective becomes a torch
# functional collective (``torch.ops._c10d_functional``): a node of the per-rank torch.fx
# program that the graph replays, with its wait as a separate node (so a pass can move it
# to the first use and overlap the collective with compute).


def tracing() -> bool:
    """Whether collectives are being traced into a graph now (see :func:`untraced`)."""
    st = _state._state
    return st.tracer is not None and not st.untraced


@contextlib.contextmanager
def untraced():
    """Inside a graph trace, run the block eagerly and keep it out of the program: the
    agreement checks and metadata exchanges, whose results the input signature fixes.
    Outside a trace it does nothing."""
    st = _state._state
    if st.tracer is None:
        yield
        return
    from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

    st.untraced += 1
    try:
        with disable_proxy_modes_tracing():
            yield
    finally:
        st.untraced -= 1


def _funcol():
    import torch.distributed._functional_collectives  # noqa: F401 - registers the ops

    return torch.ops._c10d_functional


def _start_traced(kind: str, ranks, axis, sig: str, t: torch.Tensor, launch,
                  inflight: bool = False):
    """Graph tracing: check agreement now (once, when the step is traced: the replayed
    program is checked as a whole at each call), record, and emit
    ``launch(functional ops, group name)``; returns the un-waited result. ``inflight``:
    the caller waits for it later, not at once (a logical graph records that)."""
    _check_dtype(kind, t)
    if _planning():  # a logical graph (sbpflow.graph.ir): no data, no agreement check
        _state._state.tracer.on_collective(kind, axis, tuple(ranks), t, inflight=inflight)
        return launch(_MetaCollectives, "")
    with untraced():
        _check(kind, ranks, axis, sig)
    _record(kind, axis, ranks, t.nbytes, t.dtype)
    group, _ = _group_rank_order(ranks)
    return launch(_funcol(), group.group_name)


def _traced(kind: str, ranks, axis, sig: str, t: torch.Tensor, launch) -> torch.Tensor:
    """:func:`_start_traced` and its wait."""
    out = _start_traced(kind, ranks, axis, sig, t, launch)
    return out if out.is_meta else _funcol().wait_tensor(out)


def _planning() -> bool:
    """Whether a logical graph is being built (:mod:`sbpflow.graph.ir`): tensors are meta
    tensors, collectives only give their outputs' shapes."""
    return getattr(_state._state.tracer, "planning", False)


class _MetaCollectives:
    """The functional collectives' output shapes, on meta tensors (what
    ``torch.ops._c10d_functional`` would return, without a process group)."""

    @staticmethod
    def all_reduce(t, op, group):
        return torch.empty_like(t)

    @staticmethod
    def broadcast(t, src, group):
        return torch.empty_like(t)

    @staticmethod
    def all_gather_into_tensor(t, n, group):
        return t.new_empty((n * t.shape[0], *t.shape[1:]))

    @staticmethod
    def reduce_scatter_tensor(t, op, n, group):
        return t.new_empty((t.shape[0] // n, *t.shape[1:]))

    @staticmethod
    def all_to_all_single(t, out_splits, in_splits, group):
        return t.new_empty((sum(out_splits), *t.shape[1:]))


def _sig(t: torch.Tensor, free_dims=(), **extra) -> str:
    """Rank-independent signature: dims in ``free_dims`` may differ across ranks (uneven)."""
    shape = ",".join("*" if i in free_dims else str(n) for i, n in enumerate(t.shape))
    parts = [f"shape=({shape})", f"dtype={str(t.dtype).replace('torch.', '')}"]
    parts += [f"{k}={v}" for k, v in extra.items()]
    return ", ".join(parts)


# --------------------------------------------------------------------------- collectives


_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def all_reduce(t: torch.Tensor, ranks: Sequence[int], *, axis: int | None = None,
               inplace: bool = False, op: str = "sum") -> torch.Tensor:
    """Reduce ``t`` over ``ranks`` with ``op`` (``sum``, ``max``, ``min``); returns the
    result (a new tensor unless ``inplace``)."""
    if len(ranks) == 1:
        return t if inplace else t.clone()
    extra = {} if op == "sum" else {"op": op}
    if tracing():
        out = _traced("all_reduce", ranks, axis, _sig(t, **extra), t,
                      lambda C, g: C.all_reduce(t.contiguous(), op, g))
        return t.copy_(out) if inplace else out
    out = t if inplace else t.clone(memory_format=torch.contiguous_format)
    if not out.is_contiguous():
        out = out.contiguous()
    group, _ = _group_rank_order(ranks)
    _run("all_reduce", ranks, axis, _sig(t, **extra), t,
         lambda: dist.all_reduce(out, op=_REDUCE_OPS[op], group=group, async_op=True))
    if inplace and out is not t:
        t.copy_(out)  # a non-contiguous input was reduced through a contiguous copy
        return t
    return out


class Pending:
    """An asynchronous collective in flight; :meth:`wait` (bounded by the timeout) returns
    its result."""

    __slots__ = ("_works", "_out", "_what", "_ranks")

    def __init__(self, works, out: torch.Tensor, what: str, ranks):
        self._works, self._out, self._what, self._ranks = works, out, what, ranks

    def wait(self) -> torch.Tensor:
        if self._what == "traced":  # a functional collective in a graph trace
            if not self._out.is_meta:  # (a logical graph's has nothing to wait for)
                self._out = _funcol().wait_tensor(self._out)
            self._what = ""
        if self._works is not None:
            _wait(self._works, self._what, self._ranks)
            self._works = None
        return self._out


def all_reduce_async(t: torch.Tensor, ranks: Sequence[int], *,
                     axis: int | None = None) -> Pending:
    """Start a sum all-reduce of ``t`` in place (``t`` must be contiguous and stay
    untouched until :meth:`Pending.wait`); checked and recorded like :func:`all_reduce`."""
    if len(ranks) == 1:
        return Pending(None, t, "", ranks)
    if not t.is_contiguous():
        raise ValueError("all_reduce_async needs a contiguous tensor")
    if tracing():  # started here, waited where the result is used
        out = _start_traced("all_reduce", ranks, axis, _sig(t), t,
                            lambda C, g: C.all_reduce(t, "sum", g), inflight=True)
        return Pending(None, out, "traced", ranks)
    _check_dtype("all_reduce", t)
    _check("all_reduce", ranks, axis, _sig(t))
    _record("all_reduce", axis, ranks, t.nbytes, t.dtype)
    group, _ = _group_rank_order(ranks)
    what = _describe("all_reduce", ranks, axis, _sig(t))
    try:
        work = dist.all_reduce(t, group=group, async_op=True)
    except Exception as e:  # noqa: BLE001
        raise CollectiveError(
            f"rank {_state.get_rank()}: {what} failed: {type(e).__name__}: {e}") from e
    return Pending(work, t, what, ranks)


def _pad_dim0(chunks: list[torch.Tensor], n_max: int) -> torch.Tensor:
    """Stack chunks (split along dim 0, lengths <= n_max) into one (n, n_max, ...) buffer."""
    first = chunks[0]
    buf = first.new_zeros((len(chunks), n_max, *first.shape[1:]))
    for i, c in enumerate(chunks):
        buf[i, : c.shape[0]].copy_(c)
    return buf


def all_gather(t: torch.Tensor, ranks: Sequence[int], dim: int, sizes: Sequence[int], *,
               axis: int | None = None) -> torch.Tensor:
    """Concatenate every member's ``t`` along ``dim``, in ``ranks`` order.

    ``sizes[i]`` is member ``i``'s length along ``dim`` (uneven allowed: shards are
    padded to the largest, gathered, and trimmed).
    """
    n = len(ranks)
    if n == 1:
        return t.clone()
    group, order = _group_rank_order(ranks)
    even = len(set(sizes)) == 1
    sig = _sig(t, free_dims=(dim,), dim=dim, sizes=list(sizes))
    x = t.movedim(dim, 0) if dim != 0 else t
    x = x.contiguous()
    m = max(sizes)
    if x.shape[0] < m:
        x = torch.cat([x, x.new_zeros((m - x.shape[0], *x.shape[1:]))])
    if tracing():
        buf = _traced("all_gather", ranks, axis, sig, t,
                      lambda C, g: C.all_gather_into_tensor(x, n, g))
    else:
        buf = x.new_empty((n * m, *x.shape[1:]))
        _run("all_gather", ranks, axis, sig, t,
             lambda: _all_gather_single(buf, x, group=group, async_op=True))
    in_order = order == list(range(n))
    if even and in_order:
        out = buf
    else:
        rows = buf.view(n, m, *x.shape[1:])
        parts = [None] * n
        for grank, pos in enumerate(order):
            parts[pos] = rows[grank, : sizes[pos]]
        out = torch.cat(parts)
    # Gathered along dim 0, the result is moved back in one copy: a transposed view would
    # carry its column-major strides into every op after it and into autograd's gradient
    # of it (torch's mm keeps an input's layout for its gradient, and a matmul of two
    # transposed operands runs 16x slower here: [8192, 128] x [128, 8], 6.1 against 0.38 ms).
    return out.movedim(0, dim).contiguous() if dim != 0 else out


def reduce_scatter(t: torch.Tensor, ranks: Sequence[int], dim: int, sizes: Sequence[int], *,
                   axis: int | None = None) -> torch.Tensor:
    """Sum ``t`` over ``ranks`` and return this rank's part along ``dim``.

    ``sizes`` are the parts' lengths along ``dim`` in ``ranks`` order (uneven: parts
    are padded to the largest and trimmed).
    """
    n = len(ranks)
    if n == 1:
        return t.clone()
    group, order = _group_rank_order(ranks)
    me = ranks.index(_state.get_rank())
    sig = _sig(t, dim=dim, sizes=list(sizes))
    x = t.movedim(dim, 0) if dim != 0 else t
    m = max(sizes)
    if len(set(sizes)) == 1 and order == list(range(n)):
        inp = x.contiguous()
    else:
        chunks = list(torch.split(x, list(sizes)))
        inp = _pad_dim0([chunks[pos] for pos in order], m).view(n * m, *x.shape[1:])
    if tracing():
        out = _traced("reduce_scatter", ranks, axis, sig, t,
                      lambda C, g: C.reduce_scatter_tensor(inp, "sum", n, g))
    else:
        out = x.new_empty((m, *x.shape[1:]))
        _run("reduce_scatter", ranks, axis, sig, t,
             lambda: _reduce_scatter_single(out, inp, group=group, async_op=True))
    out = out[: sizes[me]]
    return out.movedim(0, dim).contiguous() if dim != 0 else out  # (as all_gather's)


def all_to_all(t: torch.Tensor, ranks: Sequence[int], split_dim: int, split_sizes: Sequence[int],
               cat_dim: int, cat_sizes: Sequence[int], *, axis: int | None = None) -> torch.Tensor:
    """Split ``t`` along ``split_dim`` into ``split_sizes`` (one part per member, ``ranks``
    order), send part ``i`` to member ``i``, and concatenate what arrives along ``cat_dim``
    (member ``i`` sends ``cat_sizes[i]`` along it). This is S(cat_dim) -> S(split_dim).
    """
    n = len(ranks)
    if n == 1:
        return t.clone()
    group, order = _group_rank_order(ranks)
    sig = _sig(t, free_dims=(cat_dim,), split_dim=split_dim, cat_dim=cat_dim,
               split_sizes=list(split_sizes), cat_sizes=list(cat_sizes))
    me = ranks.index(_state.get_rank())
    recv_shapes = []
    for pos in range(n):
        shape = list(t.shape)
        shape[split_dim] = split_sizes[me]
        shape[cat_dim] = cat_sizes[pos]
        recv_shapes.append(shape)
    # One copy in: the parts (strided when split_dim > 0) are packed into one contiguous
    # send buffer in group-rank order (a single transpose-copy when the split is even).
    if len(set(split_sizes)) == 1:
        packed = t.unflatten(split_dim, (n, split_sizes[0])).movedim(split_dim, 0)
        if order != list(range(n)):
            packed = packed[order]
        inp = packed.contiguous().view(-1)
        in_splits = [inp.numel() // n] * n
    else:
        send_parts = torch.split(t, list(split_sizes), dim=split_dim)
        in_splits = [send_parts[pos].numel() for pos in order]
        inp = t.new_empty(sum(in_splits))
        offset = 0
        for pos, numel in zip(order, in_splits):
            inp[offset:offset + numel].view(send_parts[pos].shape).copy_(send_parts[pos])
            offset += numel
    recv_numels = [math.prod(recv_shapes[pos]) for pos in order]
    out_splits = recv_numels
    if tracing():
        out = _traced("all_to_all", ranks, axis, sig, t,
                      lambda C, g: C.all_to_all_single(inp, out_splits, in_splits, g))
    else:
        out = t.new_empty(sum(recv_numels))
        if len(set(in_splits)) == 1 and len(set(recv_numels)) == 1:
            in_splits = out_splits = None  # gloo's plain alltoall beats alltoallv by 25%
        _run("all_to_all", ranks, axis, sig, t,
             lambda: dist.all_to_all_single(out, inp, out_splits, in_splits, group=group,
                                            async_op=True))
    if cat_dim == 0 and order == list(range(n)):
        # Parts arrive contiguous and in order along dim 0: the buffer is the result.
        full = list(recv_shapes[0])
        full[0] = sum(cat_sizes)
        return out.view(full)
    pieces = [None] * n
    for part, pos in zip(torch.split(out, recv_numels), order):
        pieces[pos] = part.view(recv_shapes[pos])
    return torch.cat(pieces, dim=cat_dim)


def all_to_all_v(t: torch.Tensor, ranks: Sequence[int], send_counts: Sequence[int],
                 recv_counts: Sequence[int], *, axis: int | None = None) -> torch.Tensor:
    """All-to-all with per-rank, data-dependent sizes along dim 0 (``alltoallv``).

    ``t`` is ``(sum(send_counts), *rest)``; its first ``send_counts[0]`` rows go to member
    0 of ``ranks``, the next ``send_counts[1]`` to member 1, ...; the result is
    ``(sum(recv_counts), *rest)``, member 0's rows first (``recv_counts[i]``: how many rows
    member ``i`` sends to this rank; the caller learns them beforehand, e.g. by an
    all-gather of the counts). Unlike :func:`all_to_all` (a layout change whose sizes are
    the same on every rank) the counts may differ on every rank, so the checked signature
    holds only the trailing dims and dtype. This is the exchange of sharded embedding
    lookups (TorchRec's and OneFlow's id and embedding all-to-alls). Recorded as
    ``all_to_all`` with the bytes of ``t``. A graph trace cannot hold it (its sizes are
    data): raises ``RuntimeError`` while tracing.
    """
    n = len(ranks)
    send_counts, recv_counts = [int(c) for c in send_counts], [int(c) for c in recv_counts]
    if len(send_counts) != n or len(recv_counts) != n:
        raise ValueError(f"all_to_all_v: {len(send_counts)} send and {len(recv_counts)} "
                         f"receive counts for a group of {n} ranks")
    if sum(send_counts) != t.shape[0]:
        raise ValueError(f"all_to_all_v: send counts {send_counts} sum to "
                         f"{sum(send_counts)}, but the tensor has {t.shape[0]} rows")
    if n == 1:
        return t.clone()
    if tracing():
        raise RuntimeError("all_to_all_v: an all-to-all with data-dependent sizes cannot be "
                           "traced into a graph; run it eagerly")
    group, order = _group_rank_order(ranks)
    rest = tuple(t.shape[1:])
    row = math.prod(rest)
    sig = _sig(t, free_dims=(0,), variable=True)
    x = t.contiguous()
    if order != list(range(n)):  # member order -> group-rank order
        parts = torch.split(x, send_counts)
        x = torch.cat([parts[pos] for pos in order])
    in_splits = [send_counts[pos] * row for pos in order]
    out_splits = [recv_counts[pos] * row for pos in order]
    out = x.new_empty(sum(out_splits))
    _run("all_to_all", ranks, axis, sig, t,
         lambda: dist.all_to_all_single(out, x.view(-1), out_splits, in_splits, group=group,
                                        async_op=True))
    out = out.view(sum(recv_counts), *rest)
    if order != list(range(n)):
        pieces = dict(zip(order, torch.split(out, [recv_counts[pos] for pos in order])))
        out = torch.cat([pieces[pos] for pos in range(n)])
    return out


def broadcast(t: torch.Tensor, ranks: Sequence[int], src_index: int = 0, *,
              axis: int | None = None) -> torch.Tensor:
    """Broadcast member ``src_index``'s ``t`` to every member, in place; returns ``t``.

    Non-source members pass a buffer of the right shape and dtype.
    """
    if len(ranks) == 1:
        return t
    group, order = _group_rank_order(ranks)
    if tracing():  # the functional broadcast names its source by group rank
        src = order.index(src_index)
        return t.copy_(_traced("broadcast", ranks, axis, _sig(t, src=ranks[src_index]), t,
                               lambda C, g: C.broadcast(t.contiguous(), src, g)))
    buf = t if t.is_contiguous() else t.contiguous()
    _run("broadcast", ranks, axis, _sig(t, src=ranks[src_index]), t,
         lambda: dist.broadcast(buf, src=ranks[src_index], group=group, async_op=True))
    if buf is not t:
        t.copy_(buf)
    return t


#: torch DDP's ``broadcast_bucket_size`` (``_DEFAULT_BROADCAST_BUCKET_BYTES``): 250 MiB.
BROADCAST_BUCKET_BYTES = 250 * 2 ** 20


def broadcast_coalesced(tensors: Sequence[torch.Tensor], ranks: Sequence[int],
                        src_index: int = 0, *, axis: int | None = None,
                        bucket_bytes: int = BROADCAST_BUCKET_BYTES) -> int:
    """Broadcast member ``src_index``'s ``tensors`` to every member, in place, in as few
    collectives as their dtypes and ``bucket_bytes`` allow; returns how many ran.

    The tensors are grouped by (dtype, device) in order of first appearance; each group is
    cut, in order, into buckets of at most ``bucket_bytes`` bytes (a tensor larger than
    that goes alone), and each bucket is flattened into one buffer and broadcast once (as
    torch's ``_broadcast_coalesced``, which DDP uses for its parameters and buffers).
    Every member passes tensors of the same shapes and dtypes in the same order.

    Raises:
        ValueError: ``bucket_bytes`` < 1.
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1 byte, got {bucket_bytes}")
    if len(ranks) == 1 or not tensors:
        return 0
    groups: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    buckets: list[list[torch.Tensor]] = []
    for group in groups.values():
        bucket, nbytes = [], 0
        for t in group:
            if bucket and nbytes + t.nbytes > bucket_bytes:
                buckets.append(bucket)
                bucket, nbytes = [], 0
            bucket.append(t)
            nbytes += t.nbytes
        buckets.append(bucket)
    for bucket in buckets:
        if len(bucket) == 1:
            broadcast(bucket[0], ranks, src_index, axis=axis)
            continue
        flat = broadcast(torch.cat([t.reshape(-1) for t in bucket]), ranks, src_index,
                         axis=axis)
        if ranks[src_index] != _state.get_rank():
            with torch.no_grad():
                for t, part in zip(bucket, flat.split([t.numel() for t in bucket])):
                    t.copy_(part.view_as(t))
    return len(buckets)


def reduce(t: torch.Tensor, ranks: Sequence[int], dst_index: int = 0, *,
           axis: int | None = None) -> torch.Tensor:
    """Sum ``t`` over ``ranks`` onto member ``dst_index`` (others' result is undefined)."""
    if len(ranks) == 1:
        return t.clone()
    if tracing():  # no functional reduce: an all-reduce (every member gets the sum)
        return _traced("reduce", ranks, axis, _sig(t, dst=ranks[dst_index]), t,
                       lambda C, g: C.all_reduce(t.contiguous(), "sum", g))
    out = t.clone(memory_format=torch.contiguous_format)
    group, _ = _group_rank_order(ranks)
    _run("reduce", ranks, axis, _sig(t, dst=ranks[dst_index]), t,
         lambda: dist.reduce(out, dst=ranks[dst_index], group=group, async_op=True))
    return out


def send_recv(sends: Sequence[tuple[torch.Tensor, int]], recvs: Sequence[tuple[torch.Tensor, int]],
              sig: str) -> None:
    """Run point-to-point sends ``(tensor, peer)`` and receives ``(buffer, peer)`` together.

    Every rank of the world calls this (with possibly empty lists), so that debug mode
    can check the transfer's signature over the world.
    """
    world = tuple(range(_state.get_world_size()))
    if len(world) == 1:
        return
    _state.ensure_groups([world])
    for t, _ in list(sends) + list(recvs):
        _check_dtype("send_recv", t)
    if _planning():  # a logical graph: the receive buffers (meta) are the result
        if sends or recvs:
            peers = tuple(sorted({p for _, p in list(sends) + list(recvs)}))
            _state._state.tracer.on_collective("send_recv", None, peers, None,
                                               sum(t.nbytes for t, _ in sends))
        return
    with untraced():
        _check("send_recv", world, None, sig)
    traced = tracing()
    if traced:  # every rank counts every transfer: a send and its receive share a tag
        _state._state.p2p_seq += 1
        tag = p2p_tag(_state._state.p2p_seq)
    if not sends and not recvs:
        return
    nbytes = sum(t.nbytes for t, _ in sends)
    peers = sorted({p for _, p in sends} | {p for _, p in recvs})
    _record("send_recv", None, peers, nbytes, (sends or recvs)[0][0].dtype)
    if traced:  # one batch of sends and receives (program ops), waited at once
        # Tagged per transfer, so a program reordered into a pipeline plan pairs each
        # receive with its send whatever the order of the transfers between two ranks
        # (gloo matches by tag; NCCL ignores tags and needs one order on both sides,
        # which the 1F1B and GPipe plans give).
        ops = _p2p_ops()
        outs = ops.p2p_start(["isend"] * len(sends) + ["irecv"] * len(recvs),
                             [p for _, p in sends] + [p for _, p in recvs],
                             [tag] * (len(sends) + len(recvs)),
                             [t.contiguous() for t, _ in sends] + [b for b, _ in recvs],
                             _state.group_of(world).group_name)
        outs = [ops.p2p_wait(o) for o in outs]
        for (b, _), o in zip(recvs, outs[len(sends):]):
            b.copy_(o)
        return
    ops = [dist.P2POp(dist.isend, t.contiguous(), p) for t, p in sends]
    ops += [dist.P2POp(dist.irecv, b, p) for b, p in recvs]
    what = f"send_recv({sig}) between rank {_state.get_rank()} and peers {peers}"
    try:
        works = dist.batch_isend_irecv(ops)
    except Exception as e:  # noqa: BLE001
        raise CollectiveError(f"rank {_state.get_rank()}: {what} failed: {e}") from e
    _wait(works, what, peers)


# Point-to-point transfers as program ops (``sbpflow::p2p_start`` / ``sbpflow::p2p_wait``).
# torch's functional ``batch_p2p_ops`` keeps each sent tensor registered after its wait
# (torch 2.13 on gloo: the work is registered under the input and the output, the wait
# clears one), so a replayed pipeline step leaked every send; these keep their own works.
_P2P_WORKS: dict[int, tuple] = {}  # id(token or receive buffer) -> (work, what it holds)
_P2P_LIB = None


def _p2p_ops():
    """Register (once) and return ``torch.ops.sbpflow`` with the transfer ops."""
    global _P2P_LIB
    if _P2P_LIB is None:
        lib = torch.library.Library("sbpflow", "FRAGMENT")  # noqa: TID251 - program ops
        lib.define("p2p_start(str[] ops, int[] peers, int[] tags, Tensor[] tensors, "
                   "str group_name) -> Tensor[]")
        lib.define("p2p_wait(Tensor x) -> Tensor")
        lib.impl("p2p_start", _p2p_start, "CompositeExplicitAutograd")
        lib.impl("p2p_wait", _p2p_wait, "CompositeExplicitAutograd")
        _P2P_LIB = lib
    return torch.ops.sbpflow


def _p2p_start(ops, peers, tags, tensors, group_name):
    """Post the sends and receives; returns per op a token (send: an empty tensor) or the
    receive buffer, each to be passed to :func:`_p2p_wait`."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    group = _resolve_process_group(group_name)
    p2p, outs = [], []
    for op, peer, tag, t in zip(ops, peers, tags, tensors):
        if op == "isend":
            p2p.append(dist.P2POp(dist.isend, t, peer, group, tag))
            outs.append(torch.empty(0, dtype=t.dtype, device=t.device))
        else:
            buf = torch.empty_like(t)
            p2p.append(dist.P2POp(dist.irecv, buf, peer, group, tag))
            outs.append(buf)
    try:
        works = dist.batch_isend_irecv(p2p)
    except Exception as e:  # noqa: BLE001
        raise CollectiveError(f"rank {_state.get_rank()}: posting transfers {list(ops)} "
                              f"with peers {list(peers)} failed: {e}") from e
    for out, work, t in zip(outs, works, tensors):
        _P2P_WORKS[id(out)] = (work, t)
    return outs


def _p2p_wait(x):
    """Wait for the transfer ``x`` came from (bounded by the collective timeout) and
    return ``x`` (a receive: the received tensor)."""
    work, _ = _P2P_WORKS.pop(id(x))
    _wait(work, f"send/recv of {tuple(x.shape)}", ())
    return x


def all_gather_meta(values: Sequence[int], ranks: Sequence[int]) -> list[list[int]]:
    """Gather a short list of ints from every member (a CPU exchange for shapes and checks)."""
    if len(ranks) == 1:
        return [list(values)]
    _state.solo_guard(f"a metadata exchange over ranks {list(ranks)}")
    if len(values) > 31:
        raise ValueError(f"all_gather_meta takes at most 31 ints, got {len(values)}")
    if tracing():  # in a graph trace: exchanged now, the values fixed in the program
        with untraced():
            return all_gather_meta(values, ranks)
    # The checked signature leaves out the values: they may differ (that is what the
    # caller checks, with a better message), the exchange itself may not.
    _check("metadata_exchange", ranks, None, "")
    group, order = _group_rank_order(ranks)
    x = torch.tensor([len(values), *values] + [0] * (31 - len(values)), dtype=torch.int64)
    out = torch.empty(len(ranks) * 32, dtype=torch.int64)
    _record("all_gather", None, ranks, x.nbytes, x.dtype, metadata=True)
    _wait(_all_gather_single(out, x, group=group, async_op=True),
          f"metadata exchange over ranks {list(ranks)}", ranks)
    rows = out.view(len(ranks), 32).tolist()
    result = [None] * len(ranks)
    for grank, pos in enumerate(order):
        result[pos] = rows[grank][1 : 1 + rows[grank][0]]
    return result


def all_gather_bytes(data: bytes, ranks: Sequence[int]) -> list[bytes]:
    """Gather a byte string of any length from every member, in ``ranks`` order.

    For small metadata (names, descriptions, digests) that must be compared across
    ranks; two collectives (the lengths, then the padded bytes). Every member calls it.
    """
    if len(ranks) == 1:
        return [bytes(data)]
    if tracing():
        with untraced():
            return all_gather_bytes(data, ranks)
    lengths = [m[0] for m in all_gather_meta([len(data)], ranks)]
    n = max(lengths)
    buf = torch.zeros(max(n, 1), dtype=torch.uint8)
    if data:
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    rows = all_gather(buf, ranks, 0, [buf.numel()] * len(ranks)).view(len(ranks), -1)
    return [bytes(rows[i, :k].tolist()) for i, k in enumerate(lengths)]


def check_agreement(what: str) -> None:
    """Check that every rank of the world is at the same point with the same ``what`` (a
    description: a compiled graph's name and input signature); every rank calls it.
    Uses the collective check's mode (``SBPFLOW_CHECK``): a fingerprint by default,
    nothing when ``off``.

    Raises:
        CollectiveMismatchError: on every rank, naming each side's ``what``, when they
            differ (or a rank is at another collective).
    """
    world = tuple(range(_state.get_world_size()))
    if len(world) == 1:
        return
    _state.ensure_groups([world])
    _state._state.activity = "nn.Graph call"
    with untraced():
        _check("agreement", world, None, what)


def barrier() -> None:
    """Block until every rank of the world reaches this call; raises
    :class:`CollectiveError` after the timeout."""
    world = tuple(range(_state.get_world_size()))
    if len(world) == 1:
        return
    _state.ensure_groups([world])
    if tracing():  # a barrier while tracing holds once, when the graph is traced
        with untraced():
            return barrier()
    x = torch.zeros(1)
    _run("barrier", world, None, "", None,
         lambda: dist.all_reduce(x, group=_state.group_of(world), async_op=True))


__all__ = [
    "Pending",
    "check_agreement",
    "tracing",
    "untraced",
    "all_reduce_async",
    "CommRecord",
    "CommRecorder",
    "CollectiveError",
    "CollectiveMismatchError",
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "all_to_all_v",
    "broadcast",
    "reduce",
    "send_recv",
    "all_gather_meta",
    "all_gather_bytes",
    "barrier",
]
