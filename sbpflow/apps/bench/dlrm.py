"""``sbpflow bench dlrm --vocab V``: DLRM's training step with embedding tables of V rows,
sbpflow's row-split tables (S(0), sparse updates) against PyTorch DDP with replicated
``nn.EmbeddingBag(sparse=True)`` tables, on the same ranks, threads and data, for each V.

The model is :class:`sbpflow.models.dlrm.DLRM` (``--tables`` tables of V rows and
``--dim`` columns (default 2 x 16), 13 dense features as Criteo's, bottom MLP (64,), top
MLP (64, 32)); the data are **synthetic** (labelled so in the output): per table one id
per sample drawn from a Zipf law over the V ids (:func:`sbpflow.apps.datasets.zipf_ids`,
exponent ``--zipf``, default 1.05: a few hot ids, a long tail, as real click logs),
standard normal dense features, random 0/1 labels; one batch made before timing and
reused. Both sides use Adagrad (lr 0.01; torch's ``Adagrad`` takes the sparse gradients
of the tables, its state ``sum`` is one float per table entry) or, with ``--optimizer
sgd``, SGD lr 0.01 (no state).

Method: :func:`sbpflow.apps.bench.time_runners` (DLPerf's: ``--warmup`` untimed steps, then
``--repeats`` blocks of ``--steps`` timed steps, runners alternating, the slowest rank's
time, the median block), once per V.

Memory, per rank:

* ``table_bytes``: the exact bytes of the tables' parameters and their optimizer state on
  this rank (sbpflow: its shard of each table, ``ceil(V / ranks)`` rows at most; PyTorch:
  the whole table). ``param_state_bytes``: the same over every parameter (the MLPs are
  replicated on both sides).
* ``peak_rss_bytes``: the growth of the process's peak resident set (``VmHWM``, reset
  through ``/proc/self/clear_refs`` before each runner is built) over the building of the
  runner and its first steps: what it actually took, allocator and temporaries included
  (Linux only; None elsewhere). Memory freed by earlier runners and reused is not counted
  (a lower bound, close for the large tables); one untimed round at V = 1000 first takes
  the cost of first use (imports, gloo buffers) out of the first V's figure.
* ``--mem-cap GiB`` (default 2 per rank): a side whose tables and their optimizer state
  (:func:`table_bytes`, exact) exceed the cap on a rank is not built; it is reported as
  ``"does not fit"`` with the bytes it would need. The cap stands for a device's memory
  (the 24 GiB of the CPU machine this was written on are shared by every rank and every
  other user). Defaults: 2 tables x 16 columns, Adagrad: PyTorch needs 2 x 4 x 16 x 2 x V
  bytes per rank (2.4 GiB at V = 1e7: does not fit), sbpflow half of it (1.2 GiB).

Launch: ``sbpflow bench dlrm --vocab 1e4 1e5 1e6 1e7`` (2 ranks by default,
``--nproc-per-node``); under torchrun it runs in place. Outputs (rank 0) in ``--out``
(default ``out/bench-dlrm``): ``bench.json`` (see :func:`main`) and ``bench.md``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

from sbpflow._argtypes import nonneg_int as _nonnegative
from sbpflow._argtypes import positive_int as _positive

from .. import require_extra

__all__ = ["main", "build_parser", "table_bytes"]

_GIB = 1024 ** 3
_DENSE = 13  # dense features (Criteo's)
_LR = 0.01


def _vocab(text: str) -> int:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--vocab {text!r}: give a number of rows, e.g. 1e6"
                                         ) from None
    if not math.isfinite(value) or value < 1 or value != int(value):
        raise argparse.ArgumentTypeError(f"--vocab {text!r}: rows must be a whole number >= 1")
    return int(value)


class _Vocabs(argparse.Action):
    """``--vocab 1e4 1e5`` or ``--vocab 1e4,1e5`` (as ``bench partial-fc --classes``)."""

    def __call__(self, parser, namespace, values, option_string=None):
        out = []
        for v in values:
            try:
                out += [_vocab(t) for t in str(v).split(",") if t]
            except argparse.ArgumentTypeError as e:
                parser.error(str(e))
        setattr(namespace, self.dest, out)


def _gib(text: str) -> float:
    value = float(text)
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"--mem-cap {text!r}: give GiB > 0, e.g. 4")
    return value


def build_parser(prog: str = "sbpflow bench dlrm") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="DLRM step time and per-rank memory for tables of V rows: sbpflow's "
                    "row-split tables (sparse updates) vs PyTorch DDP with replicated "
                    "EmbeddingBag(sparse=True) tables; synthetic Zipf ids.",
        epilog="example:\n  %(prog)s --vocab 1e4 1e5 1e6 1e7 --nproc-per-node 2")
    p.add_argument("--vocab", action=_Vocabs, nargs="+", default=[10 ** 4, 10 ** 5, 10 ** 6,
                                                                   10 ** 7],
                   metavar="V", help="rows per table, spaces or commas between values "
                   "(default 1e4 1e5 1e6 1e7)")
    p.add_argument("--nproc-per-node", type=_positive, default=2, metavar="N",
                   help="ranks (default 2; under torchrun: its world)")
    p.add_argument("--tables", type=_positive, default=2, help="tables (default 2)")
    p.add_argument("--dim", type=_positive, default=16, help="table width (default 16)")
    p.add_argument("--batch-size", type=_positive, default=2048, metavar="B",
                   help="samples per rank per step (default 2048)")
    p.add_argument("--zipf", type=float, default=1.05, help="Zipf exponent of the ids "
                   "(default 1.05)")
    p.add_argument("--optimizer", choices=("adagrad", "sgd"), default="adagrad",
                   help="both sides (default adagrad, lr 0.01)")
    p.add_argument("--mem-cap", type=_gib, default=2.0, metavar="GIB",
                   help="per-rank GiB of table parameters + optimizer state a side may hold "
                        "(default 2); a side above it is reported as 'does not fit'")
    p.add_argument("--peers", choices=("both", "sbpflow", "torch"), default="both",
                   help=argparse.SUPPRESS)
    p.add_argument("--warmup", type=_nonnegative, default=2, help="untimed steps (default 2)")
    p.add_argument("--steps", type=_positive, default=5, help="timed steps per repeat "
                   "(default 5)")
    p.add_argument("--repeats", type=_positive, default=3, help="timed repeats (default 3)")
    p.add_argument("--seed", type=int, default=0, help="init and data seed")
    from .. import bench

    bench.add_out_arguments(p, "bench.json and bench.md", "out/bench-dlrm")
    p.set_defaults(device="cpu")  # the CPU only, for now (the harness reads args.device)
    return p


def table_bytes(vocab: int, dim: int, tables: int, ranks: int, optimizer: str,
                sharded: bool) -> int:
    """Bytes of the tables' parameters and optimizer state on the rank holding the most
    (fp32; Adagrad keeps one float per entry, SGD none; Adagrad's 4-byte step counter per
    table, which the measured ``table_bytes`` include, is left out): ``ceil(vocab / ranks)`` rows of
    each table when ``sharded`` (S(0): the first ``vocab % ranks`` ranks hold one more
    row), else ``vocab``."""
    rows = -(-vocab // ranks) if sharded else vocab
    return rows * dim * tables * 4 * (2 if optimizer == "adagrad" else 1)


# ---------------------------------------------------------------------------- memory
def _rss_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_peak() -> int | None:
    """Reset the peak RSS (Linux ``clear_refs`` 5); the current RSS in bytes, or None."""
    import gc

    gc.collect()
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
    except OSError:
        return None
    now = _rss_kib("VmRSS")
    return None if now is None else now * 1024


def _peak_since(base: int | None) -> int | None:
    peak = _rss_kib("VmHWM")
    return None if base is None or peak is None else max(peak * 1024 - base, 0)


def _nbytes(tensors) -> int:
    total = 0
    for t in tensors:
        local = getattr(t, "_local", t)  # an sbpflow Tensor: its shard
        total += local.numel() * local.element_size()
    return total


def _param_state(opt, params) -> list:
    """The optimizer state tensors of ``params`` (an sbpflow optimizer keys its state by
    the parameter's local shard)."""
    out = []
    for p in params:
        for v in opt.state.get(getattr(p, "_local", p), {}).values():
            if hasattr(v, "numel"):
                out.append(v)
    return out


def _state_tensors(opt):
    for state in opt.state.values():
        for v in state.values():
            if hasattr(v, "numel"):
                yield v


# ---------------------------------------------------------------------------- runners
def _config(args, vocab: int):
    from sbpflow.models.dlrm import DLRMConfig

    return DLRMConfig(vocab_sizes=(vocab,) * args.tables, bag_vocab=0, num_dense=_DENSE,
                      embedding_dim=args.dim, bottom_mlp=(64,), top_mlp=(64, 32),
                      sparse=True)


def _data(args, vocab: int, world: int):
    """The global batch (dense, ids, labels) of ``world x batch`` samples (same on every
    rank): ids per table from :func:`zipf_ids` seeded by (seed, table)."""
    import torch

    from ..datasets import zipf_ids

    n = args.batch_size * world
    g = torch.Generator().manual_seed(args.seed)
    dense = torch.randn(n, _DENSE, generator=g)
    labels = torch.randint(0, 2, (n,), generator=g).float()
    ids = torch.stack([zipf_ids((n,), vocab, args.zipf, seed=args.seed * 1000 + t)
                       for t in range(args.tables)], dim=1)
    return dense, ids, labels


def _torch_ddp(job, args, vocab: int, data):
    """PyTorch DDP (gloo) of the plain-torch DLRM with replicated sparse tables."""
    import torch
    import torch.nn.functional as F

    from sbpflow.models import dlrm
    from sbpflow.models._twin import torch_twin

    from .. import bench

    twin = torch_twin(dlrm.__name__)
    base = _reset_peak()
    torch.manual_seed(args.seed)
    model = twin.DLRM(_config(args, vocab))
    ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=bench._torch_group(
        job)) if job.world > 1 else model
    opt = torch.optim.Adagrad(ddp.parameters(), lr=_LR) if args.optimizer == "adagrad" \
        else torch.optim.SGD(ddp.parameters(), lr=_LR)
    b = args.batch_size
    batch = tuple(t[job.rank * b:(job.rank + 1) * b] for t in data)

    def step(batch):
        dense, ids, labels = batch
        opt.zero_grad()
        loss = F.binary_cross_entropy_with_logits(ddp(dense, ids), labels)
        loss.backward()
        opt.step()
        return loss

    for _ in range(2):
        step(batch)
    tables = list(model.embeddings.parameters())
    table_state = _param_state(opt, tables)
    built = bench.Built(step, batch, _nbytes(model.parameters()),
                        "DistributedDataParallel (gloo), replicated EmbeddingBag(sparse=True)",
                        lambda: bench._torch_collectives(lambda: step(batch),
                                                         ddp if job.world > 1 else None))
    memory = {"table_bytes": _nbytes(tables) + _nbytes(table_state),
              "param_state_bytes": _nbytes(model.parameters()) + _nbytes(_state_tensors(opt)),
              "peak_rss_bytes": _peak_since(base)}
    return built, memory


def _sbpflow(job, args, vocab: int, data):
    """sbpflow: the DLRM laid out by its ``"dp"`` plan (tables split by rows, S(0), with
    sparse gradients and sparse Adagrad/SGD updates of the touched rows; the MLPs
    replicated, the batch S(0)). The tables are created sharded (``sbpflow.randn`` under
    :func:`sbpflow.random.per_shard`, scaled as the model's ``1 / sqrt(d)``): no rank ever
    holds a whole table, so their values (and the first loss) differ from the PyTorch
    side's."""
    import dataclasses

    import sbpflow
    import sbpflow.nn.functional as F
    from sbpflow.models import dlrm
    from sbpflow.nn.parallel import parallelize_module
    from sbpflow.sbp import split

    from .. import bench

    base = _reset_peak()
    pl = sbpflow.placement("cpu", list(range(job.world)))
    cfg = _config(args, vocab)
    sbpflow.manual_seed(args.seed)
    model = dlrm.DLRM(dataclasses.replace(cfg, vocab_sizes=(1,) * args.tables))
    collection = model.embeddings.tables.collection
    with sbpflow.random.per_shard(), sbpflow.no_grad():
        for i, c in enumerate(collection.configs):  # the 1-row tables become V-row shards
            w = sbpflow.randn(vocab, args.dim, placement=pl, sbp=split(0))
            w.mul_(args.dim ** -0.5)
            collection.embedding_bags[c.name] = sbpflow.nn.EmbeddingBag(
                vocab, args.dim, mode="sum", sparse=True, _weight=w)
            collection.configs[i] = dataclasses.replace(c, num_embeddings=vocab)
    parallelize_module(model, pl, dlrm.TABLES_BY_ROWS)
    opt = sbpflow.optim.Adagrad(model.parameters(), lr=_LR) if args.optimizer == "adagrad" \
        else sbpflow.optim.SGD(model.parameters(), lr=_LR)
    b = args.batch_size
    batch = tuple(sbpflow.from_torch(t[job.rank * b:(job.rank + 1) * b].contiguous())
                  .to_global(pl, split(0)) for t in data)

    def step(batch):
        dense, ids, labels = batch
        opt.zero_grad()
        loss = F.binary_cross_entropy_with_logits(model(dense, ids), labels)
        loss.backward()
        opt.step()
        return loss

    def collectives():
        with sbpflow.distributed.CommRecorder() as rec:
            step(batch)
        return bench._collectives_summary((r.kind, r.bytes) for r in rec.records)

    for _ in range(2):
        step(batch)
    tables = list(model.embeddings.parameters())
    table_state = _param_state(opt, tables)
    params = list(model.parameters())
    built = bench.Built(step, batch, _nbytes(params),
                        "global tensors: tables S(0) by rows (sparse Adagrad/SGD of the "
                        "touched rows), MLPs B, batch S(0)", collectives, loss_is_global=True)
    memory = {"table_bytes": _nbytes(tables) + _nbytes(table_state),
              "param_state_bytes": _nbytes(params) + _nbytes(_state_tensors(opt)),
              "peak_rss_bytes": _peak_since(base)}
    return built, memory


_RUNNERS = {"sbpflow": ("sbpflow, row-split tables", _sbpflow, True),
            "torch-ddp": ("PyTorch DDP, replicated tables", _torch_ddp, False)}


# ---------------------------------------------------------------------------- measuring
def _measure(args, vocab: int, world: int, rank: int, ranks) -> dict:
    import torch

    from .. import bench

    cap = int(args.mem_cap * _GIB)
    data = _data(args, vocab, world)
    cfg = bench._Config(model="dlrm", batch=args.batch_size, seq_len=None, amp="none",
                        channels_last=False)
    job = bench.Job(spec=None, cfg=cfg, args=args, world=world, rank=rank, dp=world, tp=1,
                    dev=torch.device("cpu"), optimizer=args.optimizer, rank_batch=(),
                    coord_batch=())
    dense_bytes = None
    built, memory, skipped = {}, {}, {}
    names = [n for n in _RUNNERS if args.peers == "both" or
             (n == "sbpflow") == (args.peers == "sbpflow")]
    for name in names:
        _, build, sharded = _RUNNERS[name]
        need = table_bytes(vocab, args.dim, args.tables, world, args.optimizer, sharded)
        if need > cap:
            skipped[name] = {"does_not_fit": True, "table_bytes": need,
                             "mem_cap_bytes": cap}
            continue
        try:
            built[name], memory[name] = build(job, args, vocab, data)
        except NotImplementedError as e:
            skipped[name] = {"not_available": str(e)}
            continue
        dense_bytes = memory[name]["param_state_bytes"] - memory[name]["table_bytes"]
    sides = bench.time_runners(job, ranks, built) if built else {}
    for name, side in sides.items():
        side.update(memory[name])
        side["peak_rss_bytes_max_rank"] = max(
            ranks.gather(float(memory[name]["peak_rss_bytes"] or 0)))
        side["collectives_per_step"] = side["collectives_per_step"]
    for name, side in skipped.items():
        sides[name] = side
    for name, side in sides.items():
        side["label"] = _RUNNERS[name][0]
    return {"vocab": vocab, "rows_per_rank_sbpflow": -(-vocab // world),
            "dense_param_state_bytes": dense_bytes, "runners": sides}


def _run_ranks(args, argv: list[str]) -> int:
    import warnings

    import torch

    import sbpflow.distributed as sd

    from .. import bench

    # torch's Adagrad (both sides) builds sparse tensors from valid indices: nothing to check
    warnings.filterwarnings("ignore", message="Sparse invariant checks are implicitly")
    sd.init()
    world, rank = sd.get_world_size(), sd.get_rank()
    ranks = bench._Ranks(world)
    # one small untimed round first, so that the first V's peak memory is not the cost of
    # first use (imports, gloo buffers, allocator pools)
    _measure(argparse.Namespace(**{**vars(args), "warmup": 1, "steps": 1, "repeats": 1}),
             1000, world, rank, ranks)
    results = []
    for vocab in args.vocab:
        t0 = time.perf_counter()
        res = _measure(args, vocab, world, rank, ranks)
        res["wall_s"] = time.perf_counter() - t0
        results.append(res)
        if rank == 0:
            print(_row(res), flush=True)
    if rank == 0:
        out = args.out
        os.makedirs(out, exist_ok=True)
        report = {"model": "dlrm", "ranks": world, "tables": args.tables, "dim": args.dim,
                  "batch_size_per_rank": args.batch_size, "global_batch":
                  args.batch_size * world, "zipf_exponent": args.zipf,
                  "optimizer": f"{args.optimizer} lr {_LR}", "mem_cap_bytes":
                  int(args.mem_cap * _GIB), "synthetic_data": True,
                  "threads_per_rank": torch.get_num_threads(),
                  "warmup": args.warmup, "steps": args.steps, "repeats": args.repeats,
                  "method": bench.METHOD.format(warmup=args.warmup, repeats=args.repeats,
                                                steps=args.steps).replace(
                      "one random batch of the model's input shape",
                      "Zipf ids, normal dense features"),
                  "command": "sbpflow bench dlrm " + " ".join(argv), "results": results}
        with open(os.path.join(out, "bench.json"), "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)
        with open(os.path.join(out, "bench.md"), "w", encoding="utf-8") as f:
            f.write("\n".join(_table(report)) + "\n")
        print("\n".join(_table(report)), flush=True)
        print(f"wrote {out}/bench.json, bench.md", flush=True)
    return 0


# ---------------------------------------------------------------------------- reporting
def _mib(n) -> str:
    return "-" if n is None else f"{n / 2 ** 20:,.1f} MiB"


def _cell(side: dict | None) -> tuple[str, str, str]:
    if side is None:
        return "-", "-", "-"
    if side.get("does_not_fit"):
        return (f"does not fit ({_mib(side['table_bytes'])} > cap)", _mib(side["table_bytes"]),
                "-")
    if "not_available" in side:
        return "n/a", "-", "-"
    return (f"{side['step_ms_median']:,.1f} ms", _mib(side["table_bytes"]),
            _mib(side["peak_rss_bytes_max_rank"]))


def _row(res: dict) -> str:
    parts = [f"V={res['vocab']:.0e}"]
    for name, side in res["runners"].items():
        step, tb, peak = _cell(side)
        parts.append(f"{name}: step {step}, tables {tb}/rank, peak +{peak}")
    return "  ".join(parts)


def _table(report: dict) -> list[str]:
    lines = [f"# sbpflow bench dlrm (SYNTHETIC Zipf ids, exponent {report['zipf_exponent']})",
             "", f"{report['ranks']} ranks, {report['tables']} tables x {report['dim']} "
             f"columns, batch {report['batch_size_per_rank']} per rank, "
             f"{report['optimizer']}, cap {_mib(report['mem_cap_bytes'])} per rank; "
             f"{report['method']}. Peak RSS growth: the rise of the process's peak resident "
             f"set over building the side and its first steps (worst rank).", "",
             "| rows V | sbpflow step | sbpflow tables/rank | sbpflow peak RSS growth | "
             "PyTorch DDP step | PyTorch tables/rank | PyTorch peak RSS growth |",
             "|---|---|---|---|---|---|---|"]
    for res in report["results"]:
        s = _cell(res["runners"].get("sbpflow"))
        t = _cell(res["runners"].get("torch-ddp"))
        lines.append(f"| {res['vocab']:.0e} | " + " | ".join(s + t) + " |")
    return lines


def main(argv: list[str] | None = None, prog: str = "sbpflow bench dlrm") -> int:
    """Run ``sbpflow bench dlrm``; returns the exit code.

    Writes (rank 0) ``OUT/bench.json``: ``model``, ``ranks``, ``tables``, ``dim``,
    ``batch_size_per_rank``, ``global_batch``, ``zipf_exponent``, ``optimizer``,
    ``mem_cap_bytes``, ``synthetic_data`` (True), ``method``, ``command`` and ``results``:
    one object per V with ``vocab``, ``rows_per_rank_sbpflow``, ``dense_param_state_bytes``
    and ``runners`` {``sbpflow``, ``torch-ddp``: the :func:`sbpflow.apps.bench.time_runners`
    side plus ``table_bytes``, ``param_state_bytes``, ``peak_rss_bytes`` (this rank's,
    rank 0) and ``peak_rss_bytes_max_rank``; or ``{"does_not_fit": True, "table_bytes",
    "mem_cap_bytes"}``}. Also ``OUT/bench.md``.

    Raises:
        SystemExit: bad arguments (code 2, naming the value).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    require_extra(prog)
    from .. import bench

    bench.output_dir(parser, args, "bench-dlrm", argv)
    if bench._under_torchrun() or args.nproc_per_node == 1:
        return _run_ranks(args, argv)
    return bench.launch_ranks("sbpflow.apps.bench.dlrm", argv, args.nproc_per_node)


if __name__ == "__main__":
    sys.exit(main())
