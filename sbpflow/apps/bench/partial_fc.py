"""``sbpflow bench partial-fc --classes C``: the class-split margin-softmax head
(:class:`sbpflow.nn.PartialFC`) against PyTorch data parallel with a replicated head, in one
invocation, on the same ranks, threads and synthetic data.

The job (every runner): a data-parallel backbone stand-in ``Linear(d, d)`` on each rank's
``--batch-size`` synthetic features (``N(0, 1)``, labels uniform in ``[0, C)``; labelled
synthetic in every output) followed by the ArcFace head (``CombinedMarginLoss(64, 1, 0.5,
0)``: normalize, cosine logits, margin, softmax cross entropy), SGD (lr 0.1, momentum 0.9)
over everything. The runners:

* ``sbpflow r=1`` (model parallel): the head's weight ``(C, d)`` split by class over the
  ranks (``S(0)``), features all-gathered, logits ``(N, C/n)`` per rank, max and sum
  all-reduced (:class:`~sbpflow.nn.PartialFC`, ``sample_rate=1``);
* ``sbpflow r=R`` for each ``--sample-rates`` value below 1: the same with Partial FC
  sampling (the same module, its ``sample_rate`` switched: one weight in memory), with
  PartialFC's default sparse gradient of the sampled rows, stepped by SGD's lazy momentum
  (the original Partial FC's update: unsampled rows and their momentum untouched);
* ``torch-ddp``: the same model in plain PyTorch, the ``(C, d)`` head replicated on every
  rank, under ``DistributedDataParallel`` (defaults), each rank its own batch (the
  InsightFace margin on a local batch; the DDP all-reduce carries the head's whole
  gradient). Skipped and reported "does not fit" where its estimated per-rank memory
  (:func:`torch_estimate`) exceeds ``--mem-cap-gib``.

Timing: :func:`sbpflow.apps.bench.time_runners` (DLPerf method: ``--warmup`` untimed steps,
then ``--repeats`` blocks of ``--steps`` timed steps, runners alternating, median
samples/s of the slowest rank). Memory per rank, three figures: ``head_state_bytes``, the
head's parameter + gradient + optimizer-state bytes counted exactly from the tensors
after a step (sbpflow: this rank's shards, a sparse gradient's values and indices; torch:
the replicated tensors, plus DDP's gradient bucket copy reported separately), and
``step_peak_bytes``, the peak of live tensor bytes allocated during one step over those
alive before it: on CUDA ``torch.cuda.max_memory_allocated`` (as ``sbpflow bench``), on
the CPU (where ``sbpflow bench`` has no allocator figure) a ``TorchDispatchMode`` that
adds every op output's storage when it appears and subtracts it when its last tensor dies
(:class:`LiveBytes`; storages made outside torch ops, e.g. by gloo, are not seen); and
``peak_bytes``, what a rank holds at the step's peak: the head's parameter and optimizer
state and DDP's buckets (resident between steps; the gradient is set to None at the
step's start) plus ``step_peak_bytes``. The memory cap compares :func:`torch_estimate`
with the PyTorch peer's ``peak_bytes``. The backbone stand-in's few bytes are in neither
figure's head part.

The runners of one ``C`` share nothing but the data, except the sbpflow ones, which share
one module and optimizer (so a later runner's first loss is that of a trained head).

Launch: ``sbpflow bench partial-fc --classes 1e4,1e5,1e6,2e6 --nproc-per-node 2``;
outputs ``bench.json`` and ``bench.md`` in ``--out`` (default ``out/bench-partial-fc``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import weakref
from types import SimpleNamespace

from sbpflow._argtypes import nonneg_int as _nonnegative
from sbpflow._argtypes import positive_int as _positive

from .. import bench as _bench
from .. import require_extra

__all__ = ["main", "build_parser", "torch_estimate", "LiveBytes"]

MARGIN = (64.0, 1.0, 0.5, 0.0)  # ArcFace, InsightFace's default margin_list (1.0, 0.5, 0.0)


def _classes(text: str) -> list[int]:
    out = []
    for part in text.split(","):
        try:
            v = float(part)
        except ValueError:
            raise argparse.ArgumentTypeError(f"--classes: {part!r} is not a number") from None
        if v < 2 or v != int(v):
            raise argparse.ArgumentTypeError(f"--classes: {part!r} must be an integer >= 2")
        out.append(int(v))
    return out


def _rates(text: str) -> list[float]:
    out = []
    for part in text.split(","):
        try:
            v = float(part)
        except ValueError:
            raise argparse.ArgumentTypeError(f"--sample-rates: {part!r} is not a number") \
                from None
        if not 0 < v <= 1:
            raise argparse.ArgumentTypeError(f"--sample-rates: {v} is outside (0, 1]")
        out.append(v)
    return out


def build_parser(prog: str = "sbpflow bench partial-fc") -> argparse.ArgumentParser:
    """The argument parser (see the module doc)."""
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--classes", type=_classes, default=[10_000, 100_000, 1_000_000,
                                                        2_000_000], metavar="C[,C...]",
                   help="numbers of classes, comma-separated, 1e6 style allowed "
                        "(default 1e4,1e5,1e6,2e6)")
    p.add_argument("--embedding-size", type=_positive, default=128, metavar="D")
    p.add_argument("--batch-size", type=_positive, default=64, metavar="B",
                   help="samples per rank per step (default 64)")
    p.add_argument("--sample-rates", type=_rates, default=[1.0, 0.1], metavar="R[,R...]",
                   help="sbpflow's Partial FC rates (default 1,0.1)")
    p.add_argument("--mem-cap-gib", type=float, default=4.0, metavar="GiB",
                   help="the PyTorch peer runs only where its estimated memory per rank "
                        "(torch_estimate) is below this (default 4)")
    p.add_argument("--nproc-per-node", type=_positive, default=None, metavar="N")
    p.add_argument("--warmup", type=_nonnegative, default=1)
    p.add_argument("--steps", type=_positive, default=3)
    p.add_argument("--repeats", type=_positive, default=3)
    p.add_argument("--threads-per-rank", type=_positive, default=None, metavar="N")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--seed", type=int, default=0)
    _bench.add_out_arguments(p, "bench.json and bench.md", "out/bench-partial-fc")
    return p


def torch_estimate(C: int, d: int, batch: int) -> int:
    """Bytes per rank the replicated PyTorch head needs at least (float32): the weight,
    its gradient, the momentum buffer, DDP's bucket copy of the gradient, the normalized
    weight and its gradient (6 C d x 4 B), and four (batch, C) tensors of the step (cosines,
    margin logits, softmax, their gradient): ``4 (6 C d + 4 batch C)``."""
    return 4 * (6 * C * d + 4 * batch * C)


class LiveBytes:
    """Peak bytes of tensor storage that torch ops allocate inside the ``with`` block, over
    what was alive at its start (``peak``): a ``TorchDispatchMode`` counts each op output's
    storage once, when first seen, and subtracts it when the last tensor on it dies
    (backward included: on the CPU autograd runs in the calling thread)."""

    def __init__(self):
        self.live = self.peak = 0
        self._refs: dict[int, list] = {}

    def _seen(self, t) -> None:
        import torch

        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return
        if t.is_sparse:  # a sparse COO tensor (a sparse gradient): its indices and values
            for part in (t._indices(), t._values()):
                self._count(part.untyped_storage(), t)
        else:
            self._count(t.untyped_storage(), t)

    def _count(self, st, owner) -> None:
        """Count storage ``st`` as live while tensor ``owner`` lives."""
        key = st.data_ptr()
        if key == 0:
            return
        entry = self._refs.get(key)
        if entry is None:
            entry = self._refs[key] = [0, st.nbytes()]
            self.live += entry[1]
            self.peak = max(self.peak, self.live)
        entry[0] += 1
        weakref.finalize(owner, self._dead, key)

    def _dead(self, key: int) -> None:
        entry = self._refs.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            self.live -= entry[1]
            del self._refs[key]

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_flatten

        outer = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in tree_flatten(out)[0]:
                    outer._seen(t)
                return out

        self._mode = _Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)
        self._refs.clear()
        return False


def _nbytes(tensors) -> int:
    """Bytes of the tensors' data; a sparse COO tensor's are its values and indices."""
    total = 0
    for t in tensors:
        if t is not None:
            total += _nbytes([t._values(), t._indices()]) if t.is_sparse else \
                t.numel() * t.element_size()
    return total


# ---------------------------------------------------------------------------- runners
def _torch_model(C: int, d: int, seed: int):
    """The plain-PyTorch job: ``Linear(d, d)`` then the replicated ArcFace head."""
    import torch
    import torch.nn.functional as F

    s, m1, m2, m3 = MARGIN

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.backbone = torch.nn.Linear(d, d)
            self.weight = torch.nn.Parameter(torch.normal(0, 0.01, (C, d)))

        def forward(self, x, y):
            cos = F.linear(F.normalize(self.backbone(x)), F.normalize(self.weight))
            cos = cos.clamp(-1, 1)
            rows = torch.arange(y.numel(), device=y.device)
            with torch.no_grad():  # InsightFace's margin, in place without gradient
                cos[rows, y] = torch.cos(m1 * torch.arccos(cos[rows, y]) + m2) - m3
            return F.cross_entropy(cos * s, y)

    torch.manual_seed(seed)
    return Model()


def _build_torch(job) -> _bench.Built:
    import torch

    model = _torch_model(job.C, job.d, job.args.seed).to(job.dev)
    ddp = None
    if job.world > 1:
        ddp = torch.nn.parallel.DistributedDataParallel(
            model, process_group=_bench._torch_group(job),
            device_ids=[job.dev.index] if job.device == "cuda" else None)
    run = ddp or model
    opt = torch.optim.SGD(run.parameters(), lr=0.1, momentum=0.9)

    def step(batch):
        opt.zero_grad()
        loss = run(*batch)
        loss.backward()
        opt.step()
        return loss

    def head_state():  # (param, grad, optimizer state) bytes of the replicated head
        w = model.weight
        st = opt.state.get(w, {})
        return _nbytes([w]), _nbytes([w.grad]), _nbytes(
            [v for v in st.values() if isinstance(v, torch.Tensor) and v.dim() > 0])

    def extra():
        if ddp is None:
            return 0
        sizes = str(ddp._get_ddp_logging_data().get("bucket_sizes") or "")
        return sum(int(s) for s in sizes.replace(",", " ").split() if s.strip().isdigit())

    built = _bench.Built(step, job.rank_batch, _nbytes(model.parameters()),
                         "DistributedDataParallel, (C, d) head replicated" if ddp else
                         "plain module, one process",
                         lambda: _bench._torch_collectives(lambda: step(job.rank_batch), ddp))
    return built, head_state, extra


def _sbpflow_setup(job):
    import sbpflow
    import sbpflow.nn as nn
    from sbpflow.sbp import broadcast, split

    pl = sbpflow.placement(job.device, list(range(job.world)))
    sbpflow.manual_seed(job.args.seed)
    backbone = nn.Linear(job.d, job.d).to_global(pl, broadcast)
    head = nn.PartialFC(nn.CombinedMarginLoss(*MARGIN), job.d, job.C, placement=pl,
                        seed=job.args.seed)
    opt = sbpflow.optim.SGD(list(backbone.parameters()) + list(head.parameters()), lr=0.1,
                            momentum=0.9)
    x, y = job.rank_batch
    batch = (sbpflow.from_torch(x).to_global(pl, split(0)),
             sbpflow.from_torch(y).to_global(pl, split(0)))
    return backbone, head, opt, batch


def _build_sbpflow(job, shared, rate: float):
    import sbpflow

    backbone, head, opt, batch = shared

    def step(b):
        head.sample_rate = rate
        opt.zero_grad()
        loss = head(backbone(b[0]), b[1])
        loss.backward()
        opt.step()
        return loss

    def collectives():
        with sbpflow.distributed.CommRecorder() as rec:
            step(batch)
        return _bench._collectives_summary((r.kind, r.bytes) for r in rec.records
                                           if r.kind != "check")

    def head_state():  # (param, grad, optimizer state) bytes of this rank's shards
        w = head.weight
        st = opt.state.get(w._local, {})
        return _nbytes([w._local]), _nbytes([None if w.grad is None else w.grad._local]), \
            _nbytes([v for v in st.values() if hasattr(v, "dim") and v.dim() > 0])

    params = _nbytes(p._local for p in list(backbone.parameters()) + [head.weight])
    mode = (f"PartialFC weight S(0) over {job.world} ranks, features all-gathered"
            + (f", sample_rate {rate}" if rate < 1 else ", every class"))
    built = _bench.Built(step, batch, params, mode, collectives, loss_is_global=True)
    return built, head_state, lambda: 0


# ---------------------------------------------------------------------------- measuring
def _measure_one(args, C: int, world: int, rank: int, ranks, dev) -> dict:
    import torch

    d, B = args.embedding_size, args.batch_size
    g = torch.Generator().manual_seed(args.seed * 100003 + rank)
    rank_batch = (torch.randn(B, d, generator=g).to(dev),
                  torch.randint(0, C, (B,), generator=g).to(dev))
    job = _bench.Job(spec=None, cfg=_bench._Config("partial-fc", B, None, "none", False),
                     args=SimpleNamespace(warmup=args.warmup, steps=args.steps,
                                          repeats=args.repeats, seed=args.seed,
                                          device=args.device),
                     world=world, rank=rank, dp=world, tp=1, dev=dev, optimizer="sgd",
                     rank_batch=rank_batch, coord_batch=rank_batch)
    job.C, job.d = C, d
    built, extras = {}, {}
    shared = _sbpflow_setup(job)
    for r in sorted(set(args.sample_rates), reverse=True):
        name = "sbpflow r=1" if r == 1 else f"sbpflow r={r:g}"
        built[name], *extras[name] = _build_sbpflow(job, shared, r)
    est = torch_estimate(C, d, B)
    cap = int(args.mem_cap_gib * 2**30)
    torch_fits = est <= cap
    if torch_fits:
        built["torch-ddp"], *extras["torch-ddp"] = _build_torch(job)
    sides = _bench.time_runners(job, ranks, built)
    for name, b in built.items():
        head_state, extra = extras[name]
        gc.collect()
        if job.device == "cuda":
            torch.cuda.synchronize(dev)
            torch.cuda.reset_peak_memory_stats(dev)
            base = torch.cuda.memory_allocated(dev)
            b.step(b.batch)
            torch.cuda.synchronize(dev)
            peak = torch.cuda.max_memory_allocated(dev) - base
        else:
            with LiveBytes() as lb:
                b.step(b.batch)
            peak = lb.peak
        side = sides[name]
        side["step_peak_bytes"] = int(ranks.reduce(float(peak), "max"))
        param, grad, state = head_state()
        side["head_state_bytes"] = int(ranks.reduce(float(param + grad + state), "max"))
        side["ddp_bucket_bytes"] = int(ranks.reduce(float(extra()), "max"))
        # between steps (zero_grad sets the gradient to None at the step's start): the
        # head's parameter, optimizer state and DDP's buckets; the step adds its peak
        resident = int(ranks.reduce(float(param + state + extra()), "max"))
        side["peak_bytes"] = resident + side["step_peak_bytes"]
    base = "torch-ddp" if torch_fits else None
    return {"classes": C, "embedding_size": d, "batch_size_per_rank": B,
            "global_batch": B * world, "ranks": world, "synthetic_data": True,
            "runners": sides,
            "torch": {"fits": torch_fits, "estimate_bytes": est, "cap_bytes": cap},
            "ratios": {n: s["samples_per_s"] / sides[base]["samples_per_s"]
                       for n, s in sides.items() if n != base} if base else None}


def _run_ranks(args, argv) -> int:
    import torch

    import sbpflow.distributed as sd

    if args.threads_per_rank is not None:
        torch.set_num_threads(args.threads_per_rank)
    sd.init()
    world, rank = sd.get_world_size(), sd.get_rank()
    ranks = _bench._Ranks(world)
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0") or 0)) \
        if args.device == "cuda" else torch.device("cpu")
    results = []
    for C in args.classes:
        results.append(_measure_one(args, C, world, rank, ranks, dev))
        gc.collect()
        if rank == 0:
            print(f"measured C={C:,}", flush=True)
    if rank == 0:
        _report(args, argv, results, torch.get_num_threads())
    return 0


# ---------------------------------------------------------------------------- reporting
def _gib(n: int) -> str:
    return f"{n / 2**30:.3f}"


def _table(results: list[dict], header: bool = True) -> list[str]:
    rows = ["| classes | runner | samples/s (median) | step ms | CPU ms/step | vs torch DDP | "
            "head param+grad+state GiB/rank | step peak GiB/rank | peak GiB/rank | "
            "collectives per step (rank 0) |",
            "|---|---|---|---|---|---|---|---|---|---|"] if header else []
    for r in results:
        for name, s in r["runners"].items():
            ratio = r["ratios"].get(name) if r["ratios"] else None
            colls = ", ".join(f"{k} x{v['count']} ({_bench._bytes(v['bytes'])})"
                              for k, v in s["collectives_per_step"].items()) or "none"
            rows.append(f"| {r['classes']:,} | {name} | {s['samples_per_s']:.1f} | "
                        f"{s['step_ms_median']:.0f} | {s['cpu_ms_per_step_median']:.0f} | "
                        f"{'-' if ratio is None else f'{ratio:.2f}x'} | "
                        f"{_gib(s['head_state_bytes'])} | {_gib(s['step_peak_bytes'])} | "
                        f"{_gib(s['peak_bytes'])} | {colls} |")
        if not r["torch"]["fits"]:
            rows.append(f"| {r['classes']:,} | torch-ddp | does not fit (estimated "
                        f"{_gib(r['torch']['estimate_bytes'])} GiB/rank > cap "
                        f"{_gib(r['torch']['cap_bytes'])}) | | | | | | | |")
    return rows


def _report(args, argv, results, threads) -> None:
    out_dir = args.out
    os.makedirs(out_dir, exist_ok=True)
    method = _bench.METHOD.format(warmup=args.warmup, repeats=args.repeats, steps=args.steps)
    lines = [f"Method ({method}). Synthetic features N(0, 1) and uniform labels; backbone "
             f"stand-in Linear({args.embedding_size}, {args.embedding_size}) data parallel; "
             f"ArcFace head (s, m1, m2, m3) = {MARGIN}; SGD lr 0.1 momentum 0.9 (r < 1: "
             f"the head's sparse gradient, lazy momentum); "
             f"{args.batch_size} samples per rank; {threads} torch thread(s) per rank; "
             f"device {args.device}. Memory per rank: head param+grad+optimizer state "
             f"(exact, from the tensors; DDP's gradient bucket copy not included), step peak "
             f"= peak live tensor bytes allocated during one step; the PyTorch peer runs "
             f"where its estimate 4 (6 C d + 4 B C) bytes <= {args.mem_cap_gib} GiB.", ""]
    lines += _table(results)
    for r in results:
        ddp = r["runners"].get("torch-ddp")
        if ddp:
            lines.append(f"- C={r['classes']:,}: DDP gradient buckets "
                         f"{_gib(ddp['ddp_bucket_bytes'])} GiB/rank besides the head state; "
                         f"estimate {_gib(r['torch']['estimate_bytes'])} GiB/rank.")
    command = "sbpflow bench partial-fc " + " ".join(argv)
    lines += ["", f"Command: `{command}`"]
    print("\n".join(lines), flush=True)
    with open(os.path.join(out_dir, "bench.md"), "w", encoding="utf-8") as f:
        f.write("# sbpflow bench partial-fc (synthetic data)\n\n" + "\n".join(lines) + "\n")
    with open(os.path.join(out_dir, "bench.json"), "w", encoding="utf-8") as f:
        json.dump({"method": method, "command": command, "synthetic_data": True,
                   "margin": MARGIN, "runs": results}, f, indent=2)
    print(f"wrote {out_dir}/bench.json, bench.md", flush=True)


def main(argv: list[str] | None = None, prog: str = "sbpflow bench partial-fc") -> int:
    """Run ``sbpflow bench partial-fc``; return the exit code. Writes (rank 0)
    ``OUT/bench.json`` (``runs``: per number of classes, ``runners`` {name: the
    :func:`sbpflow.apps.bench.time_runners` side plus ``step_peak_bytes``, ``head_state_bytes``,
    ``ddp_bucket_bytes``}, ``torch`` {fits, estimate_bytes, cap_bytes}, ``ratios`` {runner:
    samples/s over torch DDP's, or None where it did not fit}) and ``OUT/bench.md``.

    Raises:
        SystemExit: bad arguments (code 2).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    require_extra(prog)
    _bench.output_dir(parser, args, "bench-partial-fc", argv)
    nproc = args.nproc_per_node or 1
    if _bench._under_torchrun() or nproc == 1:
        return _run_ranks(args, argv)
    return _bench.launch_ranks("sbpflow.apps.bench.partial_fc", argv, nproc, args.threads_per_rank)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
