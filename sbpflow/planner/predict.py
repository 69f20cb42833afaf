"""Predict a graph's training step from its logical graph (``graph.lower()``) and a
hardware profile: the cost model applied op by op, so that two layouts of one model can be
ranked before either runs.

Terms (seconds, this rank):

* ``compute``: each forward op of the logical graph, with its backward. By the profile's
  ``op_timing``:

  - ``"roofline"`` (a named profile: a machine we plan for but do not run on): the larger
    of its FLOPs on this rank's shards (torch's flop counter, recorded by the logical
    graph) over the achieved matmul rate and its shards' bytes (inputs read, output
    written) over the achieved memory bandwidth (:func:`sbpflow.planner.cost.op_time`);
    backward counted as twice the forward (an input and a weight gradient per product);
  - ``"measured"`` (``sbpflow calibrate``'s profile of this machine): the op's kernel run
    forward and backward on random tensors of its shards' shapes, here (:class:`OpTimer`;
    cached per op, attributes and shapes). Nnscaler and Galvatron profile ops the same
    way; it catches what a roofline misses on small shapes (attention at head size 32
    runs at half the matmul rate on a CPU, GELU is compute-bound, views are free). An op
    that cannot be replayed alone (a global algorithm, random inputs it refuses) falls
    back to the roofline.

  **Cold weights** (CPU): a step reads each weight once a pass, and between two reads it
  touches the rest of its working set. Where that is larger than the rank's part of the
  last-level cache, the step meets its weights cold, not as a loop timing an op alone
  does. So an op's inputs that the step holds from its start (parameters, ZeRO-1/2's
  gathered copies: :func:`held_values`) are also timed cold (evicted from the caches
  before each call, the other inputs read back in), and the op's time is
  ``warm + f x (cold - warm)`` with ``f = clamp((D - C) / C, 0, 1)`` (:func:`cold_share`):
  ``D`` the rank's working set (:func:`predict_memory`'s peak), ``C`` the node's
  last-level cache over its ranks. Measured here (2026-12-05, 2 ranks sharing a 32 MiB
  L3): gpt-mini's data-parallel step (``D`` 53 MiB) was predicted at 0.83 of its
  measured time with every op timed warm, 1.16 with every input evicted, 0.92-0.96
  with the weights cold; a matmul of [8, 256] by a [4096, 256] weight takes 0.3 ms
  warm, 0.7 ms cold, 1.2 ms inside the wide MLP's step.

  Ops the logical graph records in backward are activation checkpointing's recomputed
  forward: each counted once more, forward only.
* ``update``: the optimizer's step over this rank's parameter shards (given the graph's
  optimizer): measured (torch's optimizer of the same class and settings, stepped on
  tensors of the shards' shapes, cold by the same share ``f``) or, on the roofline, its memory
  traffic: Adam/AdamW read and write 21 values per element (torch's single-tensor Adam:
  decay, two moments, the denominator, the step), SGD with momentum 8, plain SGD 3,
  others as Adam;
* ``cpu share`` (this machine's calibration on CPU only): compute and update divided by
  :func:`cpu_share`, the share of a core each rank gets when the node's ranks times their
  torch threads outnumber its cores (ops are timed alone);
* ``communication``: every boxing step and every other collective (gradient reductions,
  a global algorithm's own) at :func:`sbpflow.planner.cost.collective_time`'s ring cost
  over its mesh axis on the profile's link for that kind of collective, forward and
  backward as the logical graph records them; no overlap with compute assumed. With a
  profile's ``collective_wait`` (this machine's calibration), each collective also
  waits for the last rank: :meth:`Hardware.wait` of the compute since the previous
  collective (forward: a third of each op's time, in the graph's order; backward's
  collectives spread evenly over its two thirds), scaled by the ranks it joins; the
  gradient reductions a compiled program waits for only at the update (data-parallel
  buckets, ZeRO's reduce-scatters) wait once, together (:func:`_waits`). A forward
  gather of a parameter (ZeRO-3's; any held value's) is prefetched by the compiled
  program (:func:`sbpflow.graph.passes.overlap`: it starts once the gather
  ``GATHERS_IN_FLIGHT`` before it was waited for, and after the collective before it):
  it waits for no rank (it started long before), and where a core is free for it (a
  GPU; a CPU the ranks do not fill: not :func:`_cores_full`) only its time beyond the
  forward compute in between is charged. On this machine (2 ranks, 2 cores) hiding them
  priced gpt-mini's ZeRO-3 below its ZeRO-2 and at 0.67 of measured; charged whole
  without a wait, 0.80-0.97 (2026-12-05). ZeRO-3's re-gathers in backward are waited
  for at once in the program, and charged so. A compiled program also checks at each call that every
  rank runs it (one fingerprint exchange, :mod:`sbpflow.distributed._fifo`), where the
  ranks wait for the last once more, after the update since the step before's last
  collective: one more wait a step (DLRM's plain data-parallel step on 2 ranks waited
  0.9 ms there, torch's profiler, in a 5-7 ms step);
* ``host`` (a profile with ``call_seconds``: a GPU's): the compiled program's calls
  (the logical graph's ``calls``, per micro-batch) take ``calls x call_seconds`` of host
  time, which overlaps the device's work; the part beyond compute + update +
  communication is exposed (a pipeline's stages each take the longer of their calls and
  their kernels: :func:`sbpflow.planner.pipeline.predict_pipeline`). Measured on an H200
  machine (2026-12-04): 18-19 us per counted call for gpt-mini, gpt2 and bert-base, and
  steps of gpt-mini and bert-base about as long as their calls alone. On a profile of
  this machine's CPU (its timed ops include their calls): its ``step_seconds``, what a
  small model's compiled step took beyond this model's other terms when calibrated,
  once a step (the program's check, its Python; :attr:`Hardware.step_seconds`).

Left out: on a CPU, the Python of the compiled program between ops, gradient buffers'
zeroing and copies, overlap, the allocator. The logical graph is one micro-batch's; a step of ``m``
micro-batches is ``m`` times its forward and backward (one update).
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import time
import weakref

import torch

from ..graph.ir import shard_bytes
from ..graph.passes import GATHERS_IN_FLIGHT as PREFETCH
from .cost import COLLECTIVES, collective_time, op_time, sent_time
from .hardware import Hardware

__all__ = ["TERMS", "OpTimer", "UPDATE_ACCESSES", "collective_count", "cpu_share",
           "cold_share", "held_values", "host_seconds", "last_level_cache_bytes",
           "state_per_param",
           "op_seconds",
           "predict_memory", "predict_step",
           "slowest_rank", "terms_as_ints", "terms_from_ints"]

#: Values read and written per parameter element by an optimizer's step (torch's
#: single-tensor implementations; the roofline's update term). Others: as Adam.
UPDATE_ACCESSES = {"Adam": 21, "AdamW": 21, "SGD": 3, "SGD+momentum": 8}

#: Boxing steps that move no data between ranks (their cost is none).
LOCAL_STEPS = ("slice", "zero_fill", "pad", "")


def _op_seconds(lg, node, hw: Hardware, dtype: str) -> float:
    """The roofline time of a forward op (without its backward)."""
    sig = node.signature
    read = sum(shard_bytes(node.placement, m.shape, s, m.dtype)
               for m, s in zip(node.metas, sig.ins))
    wrote = sum(shard_bytes(lg.values[v].placement, lg.values[v].shape, lg.values[v].sbp,
                             lg.values[v].dtype) for v in node.outputs if v in lg.values)
    flops = node.flops[node.chosen] or 0
    return op_time(flops, read + wrote, hw, dtype)


def _is_transfer(step) -> bool:
    """Whether boxing ``step`` moves shards between placements (a send/receive pair)."""
    return step.kind == "transfer" or step.collective in ("send_recv", "transfer")


def _step_ranks(step) -> int:
    """The ranks of the mesh axis boxing ``step`` acts on (all of its placement's when it
    acts on no one axis)."""
    pl = step.placement
    return pl.shape[step.axis] if step.axis is not None else pl.size


def _step_seconds(step, hw: Hardware) -> float:
    """One boxing step: its collective over the mesh axis it acts on (``step.bytes``:
    what each rank sends), or a transfer between placements."""
    if step.collective in LOCAL_STEPS:
        return 0.0
    n = _step_ranks(step)
    if _is_transfer(step):
        return sent_time("send_recv", step.bytes, 2, hw.link(n > hw.devices_per_node,
                                                             "send_recv"))
    kind = step.collective if step.collective in COLLECTIVES else "all_to_all"
    return sent_time(kind, step.bytes, n, hw.link(n > hw.devices_per_node, kind))


def _shards(pl, metas, sbps) -> list[tuple]:
    return [tuple(m.shape) if pl is None or s is None else pl.shard_shape(tuple(m.shape), s)
            for m, s in zip(metas, sbps)]


def _sample(shape, dtype, device, gen, grad: bool) -> torch.Tensor:
    """A tensor to time an op on: normal values for floating dtypes (``grad``: a leaf
    that requires grad), zeros otherwise (valid indices, masks)."""
    if dtype.is_floating_point or dtype.is_complex:
        return torch.randn(shape, dtype=dtype, device=device, generator=gen) \
            .requires_grad_(grad)
    return torch.zeros(shape, dtype=dtype, device=device)


def _least_seconds(fn, device, before=None) -> float:
    """The least of a few timed calls of ``fn`` after one untimed (9 for calls under 2 ms,
    5 under 50 ms, 2 under 0.5 s, else 1): the time the op needs, without what other
    processes took from it meanwhile (on shared cores the median moved 3x with the load;
    the least is what a quiet machine's step is made of). ``before``: run untimed before
    each call (evicting the caches)."""
    def once():
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - t0

    first = once()
    # fewer calls for longer ones: an op of a million-class head runs ~0.5 s; its
    # least of two is as steady as a short op's least of nine
    reps = 9 if first <= 2e-3 else 5 if first <= 0.05 else 2 if first <= 0.5 else 1
    return min(once() for _ in range(reps))


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


@contextlib.contextmanager
def _timing_alone(device):
    """On a CPU whose cores the node's ranks outnumber (ranks x torch threads > cores),
    one rank of a job times at a time, the ranks taking turns op by op: the others wait
    on a lock file (``flock``; one per job, named by its rendezvous, in the folder
    ``sbpflow-op-timing-UID`` of the temporary directory, where a job removes other jobs'
    files untouched for :data:`STALE_LOCK_SECONDS`; at most :data:`TIMING_LOCK_SECONDS`,
    then it times anyway) meanwhile, so a timed op has its core to itself, as
    :func:`cpu_share` assumes. Timed side by side, 4 ranks on these 2 cores once
    priced gpt-mini's data-parallel step at 247 ms where it ran in 127-136 ms (another
    search of the same job: 118 ms). Elsewhere (a GPU, enough cores) nothing is
    locked."""
    if device.type != "cpu" or _threads_on_node() <= _cores():
        yield
        return
    import fcntl
    import tempfile

    # one lock per job (its ranks share the rendezvous), waited for at most
    # TIMING_LOCK_SECONDS: a stopped rank holding it must not stall its peers for good
    job = os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get("MASTER_PORT") or "0"
    folder = os.path.join(tempfile.gettempdir(), f"sbpflow-op-timing-{os.getuid()}")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{job}.lock")
    _sweep_locks(folder, path)
    with open(path, "a") as f:
        os.utime(path)  # (in use: not stale)
        deadline, held = time.monotonic() + TIMING_LOCK_SECONDS, False
        while not held:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                held = True
            except BlockingIOError:
                if time.monotonic() > deadline:
                    break  # timed beside the holder: as before the lock
                time.sleep(0.001)
        try:
            yield
        finally:
            if held:
                fcntl.flock(f, fcntl.LOCK_UN)
                # the turn passes: the others poll each millisecond, and a rank timing
                # its next op at once could take the lock back before any of them (a
                # peer kept waiting past TIMING_LOCK_SECONDS times beside the holder)
                time.sleep(TIMING_HANDOFF_SECONDS)


#: The longest a rank waits for its turn to time an op (:func:`_timing_alone`).
TIMING_LOCK_SECONDS = 30.0

#: How long a rank that has timed an op leaves the lock to the others before its next
#: (:func:`_timing_alone`; they poll every millisecond).
TIMING_HANDOFF_SECONDS = 0.003

#: A timing lock file untouched this long belongs to a job that has ended (a job touches
#: its own at each timing): the next job removes it (:func:`_timing_alone`).
STALE_LOCK_SECONDS = 24 * 3600.0


@functools.lru_cache(maxsize=8)  # (once per process and folder)
def _sweep_locks(folder: str, mine: str) -> None:
    """Remove the timing lock files in ``folder`` but ``mine`` that no job has touched for
    :data:`STALE_LOCK_SECONDS` (ended jobs'; one that is removed while in use is made
    again by its next rank, which then times beside the holder once)."""
    now = time.time()
    try:
        names = os.listdir(folder)
    except OSError:
        return
    for name in names:
        path = os.path.join(folder, name)
        try:
            if path != mine and name.endswith(".lock") and \
                    now - os.path.getmtime(path) > STALE_LOCK_SECONDS:
                os.remove(path)
        except OSError:
            pass  # (another job's sweep got there first)


@functools.lru_cache(maxsize=1)  # (the machine's; read once, not at every pricing)
def last_level_cache_bytes() -> tuple[int, int]:
    """``(bytes, instances)`` of this node's last-level CPU cache: the largest cache
    cpu0 has (Linux's ``/sys/devices/system/cpu/cpu0/cache/index*/size``, e.g.
    ``32768K``) and how many of it the node's CPUs share out (distinct
    ``shared_cpu_list``); ``(32 MiB, 1)`` where sysfs cannot be read."""
    root = "/sys/devices/system/cpu"
    best, index = 0, None
    try:
        entries = os.listdir(f"{root}/cpu0/cache")
    except OSError:
        entries = []
    for entry in entries:
        text = _read(f"{root}/cpu0/cache/{entry}/size")
        scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:].upper(), 1)
        digits = text[:-1] if scale > 1 else text
        if digits.isdigit() and int(digits) * scale > best:
            best, index = int(digits) * scale, entry
    if index is None:
        return 32 * 2**20, 1
    try:
        cpus = [c for c in os.listdir(root) if c.startswith("cpu") and c[3:].isdigit()]
    except OSError:
        cpus = ["cpu0"]
    shared = {_read(f"{root}/{c}/cache/{index}/shared_cpu_list") for c in cpus}
    return best, max(len(shared - {""}), 1)


def _ranks_on_node() -> int:
    """Ranks sharing this node: ``LOCAL_WORLD_SIZE`` (torchrun's), else the world size."""
    from ..distributed import _state

    return int(os.environ.get("LOCAL_WORLD_SIZE") or _state.get_world_size())


def _threads_on_node() -> int:
    """The torch threads of the node's ranks: ranks on the node x this rank's threads."""
    return _ranks_on_node() * torch.get_num_threads()


def state_per_param(optimizer) -> float:
    """Optimizer state per parameter element (float32 values) of ``optimizer``: Adam and
    AdamW 2, one with momentum 1, others 0 (:func:`predict_memory`'s
    ``state_per_param``)."""
    if type(optimizer).__name__ in ("Adam", "AdamW"):
        return 2.0
    return 1.0 if any(g.get("momentum") for g in optimizer.param_groups) else 0.0


def cold_share(lg, hw: Hardware, working_set: int) -> float:
    """``f`` of the module doc's cold weights: ``clamp((D - C) / C, 0, 1)`` for a rank
    whose step touches ``working_set`` bytes (``D``) where each rank has ``C`` bytes of
    the node's last-level cache (:func:`last_level_cache_bytes`, all instances, over
    the ranks on the node): 0 while it fits (every op warm), 1 from twice the cache on
    (weights cold). 0 unless ``hw`` is this machine's calibration (ops timed here) and
    ``lg`` runs on CPU."""
    if hw.op_timing != "measured" or _device_type(lg) != "cpu":
        return 0.0
    size, instances = last_level_cache_bytes()
    per_rank = size * instances / max(_ranks_on_node(), 1)
    return min(1.0, max(0.0, (working_set - per_rank) / per_rank))


def _device_type(lg) -> str:
    pl = next((v.placement for v in lg.values.values() if v.placement is not None), None)
    return "cpu" if pl is None else pl.device.type


class OpTimer:
    """Times ops and optimizer steps on this machine (a profile's ``op_timing =
    "measured"``): each distinct (op, attributes, shard shapes and dtypes, device, which
    inputs are cold) once per process, forward and backward (``torch.autograd.grad`` of
    its floating outputs with respect to its floating inputs: what the compiled program
    runs for it), the least of a few calls after a warm-up. On a CPU an op's cold inputs
    (the parameters, see the module doc) are out of the caches at each call: the calls
    take turns over copies of them, enough that twice the last-level cache
    (:func:`last_level_cache_bytes`) is touched between two calls on one copy (at most
    :data:`_COLD_COPIES`; the other inputs stay warm); before each of a cold optimizer
    step's calls twice the last-level cache is written. Torch's random generators are
    restored after each measurement (a dropout measured must not move the run's masks).
    Shared by every pricing of a search (:data:`TIMER`)."""

    def __init__(self):
        self.cache: dict = {}
        self.seconds = 0.0  # spent measuring, all calls together

    def op(self, node, forward_only: bool = False, cold: tuple = ()) -> float | None:
        """Seconds of ``node``'s (a forward :class:`sbpflow.graph.ir.OpNode`) kernel,
        forward and backward (``forward_only``: forward, as activation checkpointing
        recomputes it), on this rank's shards (a random algorithm's, dropout's: on
        the global shape, as it draws); None when it cannot be replayed alone (a global
        algorithm with collectives of its own; inputs it refuses). ``cold``: per input
        of ``node``, whether it is timed cold (evicted before each call; CPU only)."""
        spec = node.spec
        if (spec.algorithm is not None and not spec.everywhere and spec.cost is not None) \
                or node.placement is None:
            return None  # a global algorithm's collectives: not replayable alone
        # (an algorithm without communication of its own, a vocabulary-parallel lookup:
        # its kernel on this rank's shards, as the algorithm runs it plus a mask)
        pl, sig = node.placement, node.signature
        # a random algorithm (dropout) draws the whole global tensor on every rank
        shapes = [tuple(m.shape) for m in node.metas] if spec.everywhere else \
            _shards(pl, node.metas, sig.ins)
        device = torch.device(pl.device.type, torch.cuda.current_device()) \
            if pl.device.type == "cuda" else torch.device(pl.device.type)
        cold = tuple(cold) if device.type == "cpu" and any(cold) else ()
        key = ("op", node.op, node.attrs_key, tuple(shapes),
               tuple(m.dtype for m in node.metas), str(device), node.inplace, forward_only,
               cold)
        if key not in self.cache:
            t0 = time.perf_counter()
            self.cache[key] = self._measure(spec, dict(node.attrs_key), shapes,
                                            [m.dtype for m in node.metas], device,
                                            node.inplace, forward_only, cold)
            self.seconds += time.perf_counter() - t0
        return self.cache[key]

    def _measure(self, spec, attrs, shapes, dtypes, device, inplace: bool,
                 forward_only: bool = False, cold: tuple = ()) -> float | None:
        from torch.utils import _pytree as tpytree

        devices = [device] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), torch.enable_grad():
            gen = torch.Generator(device).manual_seed(0)
            ins = [_sample(s, d, device, gen, not inplace) for s, d in zip(shapes, dtypes)]
            # cold inputs: each call takes the next of k copies, k x their bytes at least
            # twice the last-level cache (one copy when they are that large themselves),
            # so that a copy has left the caches by its next call; warm ones are shared
            size, instances = last_level_cache_bytes()
            cold_bytes = sum(x.numel() * x.element_size() for x, c in zip(ins, cold) if c)
            k = min(_COLD_COPIES, -(-2 * size * instances // cold_bytes)) if cold_bytes else 1
            sets = [ins] + [[x.detach().clone().requires_grad_(x.requires_grad) if c else x
                             for x, c in zip(ins, cold)] for _ in range(k - 1)]
            calls = [0]
            grads: list = []

            def run():
                now = sets[calls[0] % k]
                calls[0] += 1
                out = spec.kernel(*now, **attrs)
                leaves = [x for x in now if x.requires_grad]
                if inplace or not leaves or forward_only:
                    return
                outs = [o for o in tpytree.tree_leaves(out)
                        if isinstance(o, torch.Tensor) and o.requires_grad]
                if not outs:
                    return
                if not grads:
                    grads.extend(torch.ones_like(o) for o in outs)
                torch.autograd.grad(outs, leaves, grads, allow_unused=True)

            try:
                with _timing_alone(device):
                    sec = _least_seconds(run, device)
            except Exception:  # noqa: BLE001 - random inputs the op refuses: roofline
                return None
        # an in-place op: its backward as long again
        return 2 * sec if inplace and not forward_only else sec

    def update(self, optimizer, shapes: list, dtypes: list, device,
               cold: bool = False) -> float | None:
        """Seconds of one step of ``optimizer``'s torch class with its first group's
        settings over tensors of ``shapes``/``dtypes`` (``cold``: its tensors evicted from
        the caches before each step; CPU only); None when it cannot be built."""
        cold = cold and device.type == "cpu"
        base = next((c for c in type(optimizer).__mro__
                     if c.__module__.startswith("torch.optim")
                     and c is not torch.optim.Optimizer), None)
        if base is None or not shapes:
            return None
        import inspect

        takes = inspect.signature(base.__init__).parameters
        group = {k: v for k, v in optimizer.param_groups[0].items()
                 if k != "params" and k in takes}  # (sbpflow's own keys left out)
        key = ("update", base, tuple(shapes), tuple(dtypes), str(device),
               repr(sorted(group.items())), cold)
        if key not in self.cache:
            t0 = time.perf_counter()
            self.cache[key] = self._measure_update(base, group, shapes, dtypes, device,
                                                   cold)
            self.seconds += time.perf_counter() - t0
        return self.cache[key]

    def _measure_update(self, base, group, shapes, dtypes, device,
                        cold: bool) -> float | None:
        devices = [device] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            gen = torch.Generator(device).manual_seed(0)
            params = [torch.nn.Parameter(_sample(s, d, device, gen, False))
                      for s, d in zip(shapes, dtypes)]
            for p in params:
                p.grad = _sample(p.shape, p.dtype, device, gen, False)
            try:
                opt = base(params, **group)
                size, instances = last_level_cache_bytes()
                evictor = torch.empty(2 * size * instances // 4) if cold else None
                with _timing_alone(device):  # (evictor written: the caches emptied)
                    return _least_seconds(opt.step, device, evictor.zero_ if cold else None)
            except Exception:  # noqa: BLE001 - settings the torch class does not take
                return None


#: The most copies of an op's cold inputs :class:`OpTimer` takes turns over (smaller
#: inputs stay partly cached: their cold time is a few microseconds more at most).
_COLD_COPIES = 64

#: The process's :class:`OpTimer` (its measurements outlive a search).
TIMER = OpTimer()


def _optimizer_kind(optimizer) -> str:
    name = next((c.__name__ for c in type(optimizer).__mro__
                 if c.__module__.startswith("torch.optim")), type(optimizer).__name__)
    if name == "SGD" and any(g.get("momentum") for g in optimizer.param_groups):
        return "SGD+momentum"
    return name


def _update_seconds(lg, hw: Hardware, optimizer, timer, params=None,
                    cold: float = 0.0) -> float:
    """The optimizer step over this rank's parameter shards (see the module doc); ``params``:
    only those parameter values of ``lg`` (default: all); ``cold``: :func:`cold_share`."""
    if params is None:
        params = [v for v in lg.values.values() if v.kind == "param"]
    if optimizer is None or not params:
        return 0.0
    shapes = [tuple(v.shape) if v.placement is None else
              v.placement.shard_shape(tuple(v.shape), v.sbp) for v in params]
    dtypes = [v.dtype for v in params]
    if timer is not None:
        pl = next((v.placement for v in params if v.placement is not None), None)
        device = torch.device("cpu") if pl is None or pl.device.type != "cuda" else \
            torch.device("cuda", torch.cuda.current_device())
        sec = timer.update(optimizer, shapes, dtypes, device)
        if sec is not None and cold > 0:
            cold_sec = timer.update(optimizer, shapes, dtypes, device, cold=True)
            sec = sec if cold_sec is None else sec + cold * (cold_sec - sec)
        if sec is not None:
            return sec
    per = UPDATE_ACCESSES.get(_optimizer_kind(optimizer), UPDATE_ACCESSES["Adam"])
    nbytes = sum(per * d.itemsize * _numel(s) for s, d in zip(shapes, dtypes))
    return nbytes / hw.bandwidth()


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


#: ``held_values``' answers, per logical graph (built once; priced many times).
_HELD: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def held_values(lg) -> frozenset:
    """The ids of ``lg``'s values a step holds from its start rather than makes just
    before their use: parameters, and ZeRO-1/2's gathered copies (``boxing`` values no
    boxing node of the graph makes; ZeRO-3 gathers each module's just before it runs).
    A CPU step meets them cold (see the module doc)."""
    from ..graph.ir import BoxingNode

    held = _HELD.get(lg)
    if held is None:
        made = {n.output for n in lg.nodes if isinstance(n, BoxingNode)}
        held = frozenset(v.id for v in lg.values.values() if v.kind == "param"
                         or (v.kind == "boxing" and v.id not in made))
        _HELD[lg] = held
    return held


def timed_op(lg, node, forward_only: bool = False, cold: float = 0.0) -> float | None:
    """:data:`TIMER`'s seconds for op ``node`` of ``lg`` (forward and backward, or
    ``forward_only``): ``warm + cold x (cold time - warm)``, its held inputs
    (:func:`held_values`) evicted for the cold time (``cold``: :func:`cold_share`);
    None when it cannot be replayed alone."""
    held = held_values(lg) if cold > 0 else frozenset()
    mask = tuple(i in held for i in node.inputs)
    if not any(mask):
        return TIMER.op(node, forward_only)
    cold_sec = TIMER.op(node, forward_only, mask)
    if cold >= 1 or cold_sec is None:  # (all cold: the warm time is not needed)
        return cold_sec if cold_sec is not None else TIMER.op(node, forward_only)
    warm = TIMER.op(node, forward_only)
    return cold_sec if warm is None else warm + cold * (cold_sec - warm)


def op_seconds(lg, node, hw: Hardware, dtype: str = "float32", cold: float = 0.0) -> float:
    """Seconds of op ``node`` of ``lg`` on ``hw`` (see the module doc): a forward op with
    its backward; an op recorded in backward (activation checkpointing's recomputation)
    forward only. Measured when ``hw`` is a calibrated profile and the op can be replayed
    alone (its weights ``cold``: :func:`cold_share`), else the roofline (backward twice
    the forward)."""
    measured = hw.op_timing == "measured"
    if node.phase == "forward":
        sec = timed_op(lg, node, cold=cold) if measured else None
        return sec if sec is not None else 3 * _op_seconds(lg, node, hw, dtype)
    sec = timed_op(lg, node, forward_only=True, cold=cold) if measured else None
    return sec if sec is not None else _op_seconds(lg, node, hw, dtype)


def predict_step(lg, hw: Hardware, dtype: str = "float32", micro_batches: int = 1,
                 optimizer=None, working_set: int | None = None) -> dict:
    """Seconds of one step of the graph whose logical graph is ``lg``
    (:class:`sbpflow.graph.ir.LogicalGraph`) on ``hw``: ``{"compute", "update",
    "communication", "host", "total"}`` (see the module doc). ``dtype``: the matmuls' dtype name
    in ``hw``'s ``peak_flops`` (the roofline's); ``optimizer``: the graph's (a
    ``torch.optim.Optimizer``; None: no update term); ``working_set``: the rank's
    :func:`predict_memory` total when the caller has it (the cold weights' ``D``; else
    worked out here).

    Raises:
        KeyError: ``hw`` lists no peak for ``dtype``.
    """
    from ..graph.ir import BoxingNode, CollectiveNode, OpNode

    timer = TIMER if hw.op_timing == "measured" else None
    cold = 0.0
    if timer is not None and _device_type(lg) == "cpu":
        if working_set is None:
            state = 0.0 if optimizer is None else state_per_param(optimizer)
            working_set = predict_memory(lg, state, micro_batches)["total"]
        cold = cold_share(lg, hw, working_set)
    compute = comm = since = 0.0
    # the collectives' waits for the last rank: (compute before it, or None in backward:
    # spread evenly; ranks it waits for; waited for at the end of backward)
    waits: list[tuple[float | None, int, bool]] = []
    # prefetched parameter gathers (ZeRO-3's in forward): (seconds, compute they overlap)
    ahead: list[tuple[float, float]] = []
    clock = fenced = 0.0  # forward compute so far; at the last collective not prefetched
    gathers: list[float] = []  # the clock where each prefetched gather's result is used
    held = held_values(lg)
    for node in lg.nodes:
        forward = node.phase == "forward"
        if isinstance(node, OpNode):
            sec = op_seconds(lg, node, hw, dtype, cold)
            compute += sec
            since += sec / 3 if forward else sec  # (backward: 2/3)
            clock += sec / 3 if forward else 0.0
        elif isinstance(node, BoxingNode):
            sec = sum(_step_seconds(s, hw) for s in node.plan.steps)
            if forward and node.input in held and sec > 0:
                # the program starts it once the gather PREFETCH before it was waited for
                # (and after the collective before it): it runs while that compute does
                k = len(gathers)
                start = max(fenced, gathers[k - PREFETCH] if k >= PREFETCH else 0.0)
                ahead.append((sec, clock - start))
                gathers.append(clock)
                continue
            comm += sec
            fenced = clock if forward else fenced
            for st in node.plan.steps:
                if st.collective not in LOCAL_STEPS:
                    waits.append((since if forward else None,
                                  2 if _is_transfer(st) else _step_ranks(st), node.deferred))
                    since = 0.0 if forward else since
        elif isinstance(node, CollectiveNode):
            n = len(node.ranks) if node.ranks else 1
            kind = node.kind if node.kind in COLLECTIVES else "send_recv"
            link = hw.link(n > hw.devices_per_node, kind)
            comm += collective_time(kind, node.bytes, max(n, 1) if kind != "send_recv"
                                    else 2, link)
            waits.append((since if forward else None, max(n, 1), node.inflight))
            since = 0.0 if forward else since
            fenced = clock if forward else fenced
    share = cpu_share(lg, hw)
    comm += _waits(waits, compute, hw, share)
    # (on CPU cores the ranks fill, an early start hides nothing: the transfer runs on
    # the collective library's threads, which take those cores from the compute)
    hide = 0.0 if _cores_full(lg, hw) else 1.0
    comm += sum(max(0.0, sec - hide * overlap / share) for sec, overlap in ahead)
    compute *= micro_batches / share
    comm *= micro_batches
    update = _update_seconds(lg, hw, optimizer, timer, cold=cold)
    if waits:  # the program's check at each call: every rank waits for the last there too
        comm += _waits([(update, max(k for _, k, _ in waits), False)], 0.0, hw, share)
    update /= share
    device = compute + update + comm
    host = max(0.0, host_seconds(lg, hw, micro_batches) - device) + hw.step_seconds
    return {"compute": compute, "update": update, "communication": comm, "host": host,
            "total": device + host}


def _waits(waits: list, compute: float, hw: Hardware, share: float) -> float:
    """Seconds one micro-batch's collectives wait for their last rank. ``waits``: each
    collective's forward compute since the previous one (None in backward), how many
    ranks it joins, and whether it is waited for only at the end of backward (a
    data-parallel bucket, a parameter gradient's reduce-scatter: the compiled program
    waits for it at the update); ``compute``: the micro-batch's ops, forward and
    backward, on one core.

    A collective waited for at once waits :meth:`Hardware.wait` of the compute before
    it, in wall time (over the rank's ``share`` of a core): forward's in the graph's
    order, backward's spread evenly over backward's two thirds of the compute (the
    logical graph does not order them among its ops). Those waited for at the end wait
    once, together, as one more such collective of backward. A collective of ``k`` of
    the profile's ``N`` ranks waits ``(k - 1) / (N - 1)`` of the ``N``-rank wait (fewer
    ranks to wait for)."""
    if not hw.collective_wait or not waits:
        return 0.0
    now = [w for w in waits if not w[2]]
    late = [w for w in waits if w[2]]
    if late:  # one wait for them all, with the most ranks any of them joins
        now.append((None, max(k for _, k, _ in late), False))
    back = sum(g is None for g, _, _ in now)
    spread = 2 * compute / 3 / (back + 1)
    total, full = 0.0, max(hw.devices_per_node - 1, 1)
    for gap, k, _ in now:
        gap = spread if gap is None else gap
        total += hw.wait(gap / share) * min(max(k - 1, 0) / full, 1.0)
    return total


def collective_count(lg) -> int:
    """The collectives of one micro-batch of ``lg``: its boxings' steps that move data
    and its other collectives (forward and backward)."""
    from ..graph.ir import BoxingNode, CollectiveNode

    return sum(len([s for s in n.plan.steps if s.collective not in LOCAL_STEPS])
               if isinstance(n, BoxingNode) else isinstance(n, CollectiveNode)
               for n in lg.nodes)


def host_seconds(lg, hw: Hardware, micro_batches: int = 1) -> float:
    """The host's seconds for a step's calls: ``lg.calls x micro_batches x
    hw.call_seconds`` (the update's calls not counted: a handful of multi-tensor ops on
    a GPU). 0 when the profile prices no calls."""
    return lg.calls * micro_batches * hw.call_seconds


def cpu_share(lg, hw: Hardware) -> float:
    """The share of its cores a rank's ops get on this machine, when ``hw`` is this
    machine's calibration (``op_timing == "measured"``) and ``lg`` runs on CPU:
    ``min(1, cores / (ranks on this node x torch threads per rank))``. Ops are timed as
    the least of a few calls (:class:`OpTimer`), what a rank computes alone; when the
    ranks outnumber the cores (4 ranks on 2 cores) each gets a share of one, and a step's
    compute and update take that much longer. 1 for a named profile (hardware planned
    for, not shared here) and on CUDA. Ranks on the node: ``LOCAL_WORLD_SIZE``
    (torchrun's), else the world size; cores: this process's CPU affinity."""
    if hw.op_timing != "measured" or _device_type(lg) != "cpu":
        return 1.0
    return min(1.0, _cores() / max(_threads_on_node(), 1))


def _cores() -> int:
    """This process's CPU affinity's size (the node's cores it may run on)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # (not on Linux)
        return os.cpu_count() or 1


def _cores_full(lg, hw: Hardware) -> bool:
    """Whether ``lg``'s ranks fill this machine's cores (this machine's calibration, a CPU
    step, ranks on the node x torch threads >= cores): no core is left for a collective
    in flight to run on beside the compute."""
    return hw.op_timing == "measured" and _device_type(lg) == "cpu" and \
        _threads_on_node() >= _cores()


#: :func:`predict_step`'s terms, in the order ranks exchange them (``bubble``: a
#: pipeline's idle time, :func:`sbpflow.planner.pipeline.predict_pipeline`; 0 otherwise;
#: ``host``: the program's calls beyond the device's work).
TERMS = ("compute", "update", "communication", "bubble", "host")


def terms_as_ints(terms: dict) -> list[int]:
    """:func:`predict_step`'s ``terms`` as nanoseconds (ranks exchange ints)."""
    return [int(terms.get(k, 0) * 1e9) for k in TERMS]


def terms_from_ints(ints) -> dict:
    """:func:`terms_as_ints`' inverse, ``total`` included."""
    out = {k: v / 1e9 for k, v in zip(TERMS, ints)}
    out["total"] = sum(ints) / 1e9
    return out


def slowest_rank(terms: dict, ranks: list[int]) -> dict:
    """:func:`predict_step`'s ``terms`` of the rank of ``ranks`` whose total is largest
    (a step waits for its slowest rank; op timings differ by rank), the same on every
    rank; every rank of ``ranks`` calls it, in step."""
    from ..distributed import _comm

    rows = _comm.all_gather_meta(terms_as_ints(terms), ranks)
    return terms_from_ints(max(rows, key=sum))


def predict_memory(lg, state_per_param: float = 2.0, micro_batches: int = 1) -> dict:
    """Bytes one rank holds at the peak of a step of the graph whose logical graph is
    ``lg`` (``micro_batches``: its gradient accumulation steps), by term:

    * ``parameters``: every parameter's shard on this rank;
    * ``optimizer``: ``state_per_param`` float32 values per parameter element of this
      rank (2: Adam/AdamW's moments; 1: SGD with momentum; 0: plain SGD);
    * ``gathered``: under ZeRO, the parameters its all-gathers make whole
      (``lg.gathered_bytes``, recorded while the logical graph was built): at stages 1
      and 2 every one, held for the step (sbpflow's graph gathers each once per step); at
      stage 3 the most one module gathers (freed after it runs, gathered again in
      backward);
    * ``backward``: the most backward holds at once, swept op by op from the last forward
      op to the first: the activations not yet freed (what autograd saved in the forward,
      ``lg.saved_at``: each saved storage once, the step's inputs and parameters left
      out, freed once backward has passed the first op that saved it), the gradients made
      so far (a parameter's from its last forward use on; all of them throughout under
      gradient accumulation), and beside them ``workspace`` (the gradients of an op's
      output and input: twice the largest forward output), ``recomputation`` (under
      activation checkpointing, one recomputed module's op outputs) and, once there are
      gradients, ``reduction`` (what backward's reductions hold, input and output: every
      data-parallel gradient bucket and its all-reduced copy, in flight together; else the
      largest other reduction: a partial gradient and its reduce-scattered shard).

    ``activations`` (all saved) and ``gradients`` (one per parameter shard) are reported
    too. ``total``: parameters + optimizer + gathered + backward. What autograd saves is
    recorded on meta stand-ins: attention as the kernel torch takes on the planned
    device saves it (the CPU's flash kernel; CUDA's flash or memory-efficient one: the
    output and its log-sum-exp, not the L x S probabilities); a checkpointed block keeps
    its inputs. A logical graph without that record: every
    forward op's output that is not a view, saved where it is made. Left out: the
    allocator's fragmentation, kernels' scratch memory, buffers.
    """
    from ..graph.ir import BoxingNode, OpNode

    def shard(v):
        return 0 if v is None else shard_bytes(v.placement, v.shape, v.sbp, v.dtype)

    params = state = 0
    grad_of: dict[int, int] = {}  # parameter value -> its gradient's bytes
    for vid, v in lg.values.items():
        if v.kind == "param":
            grad_of[vid] = b = shard(v)
            params += b
            state += int(state_per_param * b / v.dtype.itemsize * 4)
    # each parameter's last forward use (directly or through a boxing of it): backward
    # makes its gradient there; one never seen used has it from backward's start
    origin = {vid: vid for vid in grad_of}
    last_use = dict.fromkeys(grad_of, math.inf)
    made_at: dict[int, tuple[int, int]] = {}  # forward outputs owning memory: (node, bytes)
    recomputed = 0  # the outputs of activation checkpointing's recomputation in backward
    forward_ops = []
    for node in lg.nodes:
        if isinstance(node, BoxingNode) and node.phase == "forward" and node.input in origin:
            origin[node.output] = origin[node.input]
        if not isinstance(node, OpNode):
            continue
        for o in node.outputs:
            v = lg.values.get(o)
            if v is not None and not v.view:
                if node.phase == "forward":
                    made_at[o] = (node.index, shard(v))
                else:
                    recomputed += shard(v)
        if node.phase == "forward":
            forward_ops.append(node.index)
            for i in node.inputs:  # (nodes come in order: the last one seen is the last)
                if i in origin:
                    last_use[origin[i]] = node.index
    saved_at = list(made_at.values()) if lg.saved_bytes is None else list(lg.saved_at)
    workspace = 2 * max((b for _, b in made_at.values()), default=0)
    recompute = recomputed // max(lg.recomputed_modules, 1)
    # collectives left in flight (data-parallel buckets, waited for at the end of
    # backward) are all held together; other reductions (tensor parallel's, ZeRO's
    # reduce-scatters, boxings) one at a time
    colls = lg.collectives("backward")
    reduction = max([2 * sum(n.bytes for n in colls if n.inflight)]
                    + [2 * n.bytes for n in colls if not n.inflight]
                    + [shard(lg.values.get(n.input)) + shard(lg.values.get(n.output))
                       for n in lg.boxings("backward")])
    grads = sum(grad_of.values())
    peak = 0
    for k in [math.inf] + sorted(forward_ops, reverse=True):  # backward: the last op first
        acts = sum(b for at, b in saved_at if at <= k)
        made = grads if micro_batches > 1 else \
            sum(b for p, b in grad_of.items() if last_use[p] >= k)
        peak = max(peak, acts + made + workspace + recompute + (reduction if made else 0))
    out = {"parameters": params, "optimizer": state, "gathered": lg.gathered_bytes,
           "activations": sum(b for _, b in saved_at), "gradients": grads,
           "workspace": workspace, "recomputation": recompute, "reduction": reduction,
           "backward": peak}
    out["total"] = params + state + lg.gathered_bytes + peak
    return out
