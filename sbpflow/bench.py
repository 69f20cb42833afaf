"""``sbpflow bench MODEL``: training throughput of an sbpflow model against the same model in
plain PyTorch, in one invocation, on the same ranks, threads and data.

Method (DLPerf, https://github.com/Oneflow-Inc/DLPerf): each framework runs ``--warmup``
training steps that are not timed, then ``--repeats`` blocks of ``--steps`` timed training
steps (forward, backward, gradient synchronisation, optimizer step); a block's time is the
slowest rank's, its throughput ``global batch x steps / time`` in samples/s, and the
reported figure is the median over the blocks. The batch is **synthetic** (random inputs of
the model's input shape, made once before timing and reused every step) so that data
loading is not measured; results are labelled as such. The batch size is per rank
(``--batch-size``); both sides process the same global batch of ``ranks x batch`` samples
per step, and the repeats of the two frameworks alternate (sbpflow, PyTorch, PyTorch,
sbpflow, ...) so that a slow phase of a shared machine hits both alike.

The two sides:

* **sbpflow** builds ``spec.build()`` and lays it out with ``spec.plan(layout)`` via
  ``parallelize_module`` on a mesh of ``dp x tp`` ranks (1-D when one of them is 1). The
  global batch is ``S(0)`` over the data-parallel axis and ``B`` over the tensor-parallel
  one, so a data-parallel rank holds the same samples as the PyTorch rank of the same
  index. BatchNorm layers run with ``sync_stats=False`` (statistics of each rank's part
  of the batch, as DDP without SyncBatchNorm).
* **PyTorch** builds ``spec.build_torch()`` (the same model file run under plain torch,
  same seed, so the same initial parameters) and, on several ranks, wraps it in
  ``torch.nn.parallel.DistributedDataParallel`` with default settings (25 MiB buckets,
  ``broadcast_buffers=True``) on its own process group (``dist.new_group`` over all ranks:
  gloo on CPU, NCCL on CUDA), separate from sbpflow's groups so neither side's traffic or
  sequence numbers touch the other's. On one rank it is the plain model.

Defaults on the CPU: 8 samples per rank, images 128 x 128 (DLPerf's 224 with
``--image-size 224``), text at the config's longest sequence, 3 warm-up steps, 3 repeats of
10 steps. Besides samples/s the report gives each side's first-step loss (equal when the
two sides really run the same model on the same batch), its CPU time per step (work done,
less noisy than wall time on a shared machine), parameter bytes per rank, and the
collectives one step runs (sbpflow's from :class:`~sbpflow.distributed.CommRecorder`,
PyTorch's from the profiler's ``c10d::`` ops, with DDP's bucket sizes).

Both use the same optimizer (``--optimizer``: AdamW lr 1e-3, or SGD lr 0.01 momentum 0.9),
the same autocast setting (``--amp``) and the same number of torch threads per rank.

Launch: ``sbpflow bench resnet18 --nproc-per-node 2`` starts 2 ranks itself (through
``sbpflow.distributed.launch``, i.e. torchrun); under ``torchrun`` it runs in place and does
not relaunch. Unless ``--no-scaling``, rank 0 then runs the 1-rank measurement of both
frameworks in a fresh process (same threads, same per-rank batch) for the scaling ratio
``samples/s on N ranks / samples/s on 1 rank``.

Outputs (rank 0), in ``--out`` (default ``out/bench-MODEL``): ``bench.json`` (see
:func:`main`), ``bench.md`` (a markdown table) and ``bench.png`` (a bar chart).

``--device cuda`` runs the GPU-sized configurations on the GPU(s): with no MODEL the suite
ResNet-50 at batch 128 and 256 (channels-last, bf16 autocast), BERT-base at sequence
length 128 and GPT-2 (bf16 autocast); with a MODEL that model's entries of the suite.

Examples::

    sbpflow bench resnet18 --nproc-per-node 2
    sbpflow bench gpt-mini --nproc-per-node 2 --tp 2
    sbpflow bench gpt-mini --nproc-per-node 4 --dp 2 --tp 2 --amp bf16
    torchrun --nproc-per-node 2 -m sbpflow.bench resnet18   # no relaunch under torchrun
    sbpflow bench --device cuda                               # the GPU suite, one GPU
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from ._argtypes import nonneg_int as _nonnegative
from ._argtypes import positive_int as _positive

__all__ = ["main", "METHOD", "CUDA_SUITE"]

METHOD = ("DLPerf: {warmup} warm-up steps (not timed), then {repeats} repeats of {steps} timed "
          "training steps; samples/s = global batch x steps / slowest rank's time; median over "
          "repeats; synthetic data (one random batch of the model's input shape, reused)")

# --device cuda: (model, per-rank batch, sequence length or None, amp, channels-last).
CUDA_SUITE = (
    ("resnet50", 128, None, "bf16", True),
    ("resnet50", 256, None, "bf16", True),
    ("bert-base", 32, 128, "bf16", False),
    ("gpt2", 8, 1024, "bf16", False),
)

_DEFAULT_BATCH = {"image": 8, "lm": 8, "mlm": 8}  # per rank, on the CPU
_CPU_IMAGE_SIZE = 128  # CPU default (a 2-core run in minutes); DLPerf and --device cuda: 224
_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                 "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR",
                 "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
                 "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE",
                 "TORCHELASTIC_ERROR_FILE", "TORCH_NCCL_ASYNC_ERROR_HANDLING")


# ---------------------------------------------------------------------------- arguments
def build_parser(prog: str = "sbpflow bench") -> argparse.ArgumentParser:
    """The argument parser of ``sbpflow bench`` (see the module doc for the method)."""
    p = argparse.ArgumentParser(
        prog=prog, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Benchmark training throughput of an sbpflow model against the same "
                    "model in plain PyTorch (DDP on several ranks), same data and threads.\n"
                    + METHOD.format(warmup="W", repeats="R", steps="S") + ".",
        epilog="examples:\n  %(prog)s resnet18 --nproc-per-node 2\n"
               "  %(prog)s gpt-mini --nproc-per-node 2 --tp 2\n"
               "  %(prog)s --device cuda            (GPU suite: ResNet-50 b128/b256, "
               "BERT-base s128, GPT-2)")
    p.add_argument("model", nargs="?", default=None,
                   help="a name from sbpflow.models (e.g. resnet18, gpt-mini); optional with "
                        "--device cuda (then the whole GPU suite runs)")
    p.add_argument("--nproc-per-node", type=_positive, default=None, metavar="N",
                   help="ranks to launch on this node (default 1; under torchrun: its world)")
    p.add_argument("--batch-size", type=_positive, default=None, metavar="B",
                   help="samples per rank per step (default 8 on the CPU; --device cuda: "
                        "the suite's)")
    p.add_argument("--seq-len", type=_positive, default=None, metavar="T",
                   help="sequence length for text models (default: the config's longest)")
    p.add_argument("--image-size", type=_positive, default=None, metavar="S",
                   help="image models: S x S inputs (default: the config's size, else "
                        f"{_CPU_IMAGE_SIZE} on the CPU and 224 on CUDA)")
    p.add_argument("--warmup", type=_nonnegative, default=3, help="untimed steps (default 3)")
    p.add_argument("--steps", type=_positive, default=10,
                   help="timed steps per repeat (default 10)")
    p.add_argument("--repeats", type=_positive, default=3,
                   help="timed repeats; the median is reported (default 3)")
    p.add_argument("--dp", type=_positive, default=None,
                   help="data-parallel degree of the sbpflow side (dp x tp = ranks)")
    p.add_argument("--tp", type=_positive, default=None,
                   help="tensor-parallel degree of the sbpflow side (default: the model's "
                        "default layout over all ranks)")
    p.add_argument("--amp", choices=("none", "bf16", "fp16"), default=None,
                   help="autocast dtype on both sides (default none on CPU, bf16 on CUDA); "
                        "fp16 adds a GradScaler")
    p.add_argument("--optimizer", choices=("adamw", "sgd"), default=None,
                   help="both sides (default: sgd with momentum for images, adamw for text)")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="where bench.json, bench.md, bench.png go (default out/bench-MODEL)")
    p.add_argument("--threads-per-rank", type=_positive, default=None, metavar="N",
                   help="torch threads per rank, both sides and the 1-rank run (default 1 "
                        "when several ranks share the node, else torch's default)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--check-overhead", action="store_true",
                   help="also time the sbpflow side with the collective agreement check off "
                   "(SBPFLOW_CHECK=off), in the same repeats, and report the default check's "
                   "share of the step time")
    p.add_argument("--no-scaling", action="store_true",
                   help="skip the 1-rank runs (no scaling ratio)")
    p.add_argument("--seed", type=int, default=0, help="model init and synthetic data seed")
    p.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE",
                   help="import MODULE first (it may register more models); repeatable")
    p.add_argument("--child-result", default=None, help=argparse.SUPPRESS)
    return p


@dataclass(frozen=True)
class _Config:
    """One measurement: a model at a batch size and sequence length."""

    model: str
    batch: int
    seq_len: int | None  # text models
    amp: str
    channels_last: bool
    image_size: int | None = None  # image models


def _under_torchrun() -> bool:
    return os.environ.get("WORLD_SIZE") not in (None, "") and "RANK" in os.environ


def _world_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


def _check_args(parser: argparse.ArgumentParser, args) -> None:
    """Argument checks that need no rank or model (run before any launch)."""
    if args.model is None and args.device != "cuda":
        parser.error("MODEL is required (e.g. `resnet18`, `gpt-mini`; known models: "
                     f"{_known_models()}); only --device cuda runs a suite without one")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            parser.error("--device cuda: CUDA is not available on this machine (torch "
                         f"{torch.__version__}, torch.cuda.is_available() is False); run "
                         "without --device cuda to benchmark on the CPU")
    if _under_torchrun():
        world = _world_from_env()
        if args.nproc_per_node is not None and args.nproc_per_node * int(
                os.environ.get("GROUP_WORLD_SIZE", "1") or 1) != world:
            parser.error(f"--nproc-per-node {args.nproc_per_node} but torchrun started "
                         f"WORLD_SIZE={world} ranks; drop --nproc-per-node under torchrun")
    ranks = _world_from_env() if _under_torchrun() else (args.nproc_per_node or 1)
    if args.device == "cuda" and not _under_torchrun():
        import torch

        if ranks > torch.cuda.device_count():
            parser.error(f"--device cuda --nproc-per-node {ranks}: only "
                         f"{torch.cuda.device_count()} GPU(s); one rank per GPU")


def _known_models() -> list[str]:
    from . import models

    return models.names()


def _layout(parser, args, spec, ranks: int) -> tuple[int, int]:
    """(dp, tp) of the sbpflow side: :func:`sbpflow.train.resolve_layout`, its ValueError
    turned into a usage error (exit code 2)."""
    from .train import resolve_layout

    try:
        return resolve_layout(spec, args.dp, args.tp, ranks)
    except ValueError as e:
        parser.error(str(e))


def _configs(parser, args) -> list[_Config]:
    from . import models

    if args.device == "cuda":
        suite = [c for c in CUDA_SUITE if args.model is None or c[0] == args.model]
        if not suite:
            suite = [(args.model, None, None, "bf16", False)]
        out = []
        for model, batch, seq, amp, cl in suite:
            c = _Config(model, args.batch_size or batch or 0, args.seq_len or seq,
                        args.amp or amp, cl, args.image_size)
            if c not in out:  # --batch-size makes resnet50's two entries one
                out.append(c)
        configs = out
    else:
        configs = [_Config(args.model, args.batch_size or 0, args.seq_len, args.amp or "none",
                           False, args.image_size)]
    resolved = []
    for c in configs:
        try:
            spec = models.get(c.model)
        except ValueError as e:
            parser.error(str(e))
        if spec.task not in _DEFAULT_BATCH:
            parser.error(f"model {c.model!r} has task {spec.task!r}; bench knows "
                         f"{sorted(_DEFAULT_BATCH)}")
        if not hasattr(spec, "build_torch"):
            parser.error(f"model {c.model!r}: its spec has no build_torch() (the plain-PyTorch "
                         f"twin bench compares against)")
        batch = c.batch or _DEFAULT_BATCH[spec.task]  # cuda suite entries carry theirs
        seq = c.seq_len
        if spec.task in ("lm", "mlm"):
            longest = _max_seq(spec.config)
            seq = seq or longest
            if longest is not None and seq > longest:
                parser.error(f"--seq-len {seq} is longer than {c.model}'s longest sequence "
                             f"{longest}")
        elif args.seq_len is not None:
            parser.error(f"--seq-len is for text models; {c.model} takes images")
        else:
            seq = None
        size = None
        if spec.task == "image":
            size = args.image_size or _config_image_size(spec.config) or (
                224 if args.device == "cuda" else _CPU_IMAGE_SIZE)
        elif args.image_size is not None:
            parser.error(f"--image-size is for image models; {c.model} takes token ids")
        resolved.append(_Config(c.model, batch, seq, c.amp, c.channels_last, size))
    return resolved


def _max_seq(cfg) -> int | None:
    for name in ("block_size", "max_position", "max_position_embeddings", "max_seq_len",
                 "max_len", "seq_len"):
        v = getattr(cfg, name, None)
        if isinstance(v, int):
            return v
    return None


# ---------------------------------------------------------------------------- data
def _config_image_size(cfg) -> int | None:
    return next((getattr(cfg, n) for n in ("image_size", "img_size", "resolution", "input_size")
                 if isinstance(getattr(cfg, n, None), int)), None)


def _in_channels(cfg) -> int:
    return next((getattr(cfg, n) for n in ("in_channels", "in_chans", "channels")
                 if isinstance(getattr(cfg, n, None), int)), 3)


def _num_classes(cfg) -> int:
    return next((getattr(cfg, n) for n in ("num_classes", "n_classes", "classes")
                 if isinstance(getattr(cfg, n, None), int)), 1000)


def _vocab(cfg) -> int:
    return next((getattr(cfg, n) for n in ("vocab_size", "n_vocab")
                 if isinstance(getattr(cfg, n, None), int)), 256)


def synthetic_batch(spec, batch: int, seq_len: int | None, rank: int, seed: int,
                    image_size: int = 224):
    """One rank's synthetic batch for ``spec.task`` as plain torch tensors (CPU).

    * ``image``: ``(images (B, C, S, S) float32 N(0, 1), labels (B,) int64)``, S =
      ``image_size``, C the config's ``in_channels`` (3);
    * ``lm``: ``(idx (B, T) int64, targets (B, T) int64)``, uniform over the vocabulary;
    * ``mlm``: ``(input_ids (B, T) int64, labels (B, T) int64)``, labels -100 except on
      15% of the positions, where they are the token ids.

    Deterministic in ``(seed, rank)``, so that every process can make any rank's batch.
    """
    import torch

    g = torch.Generator().manual_seed(seed * 100003 + rank)
    cfg = spec.config
    if spec.task == "image":
        c = _in_channels(cfg)
        return (torch.randn(batch, c, image_size, image_size, generator=g),
                torch.randint(0, _num_classes(cfg), (batch,), generator=g))
    ids = torch.randint(0, _vocab(cfg), (batch, seq_len), generator=g)
    if spec.task == "lm":
        return ids, torch.randint(0, _vocab(cfg), (batch, seq_len), generator=g)
    mask = torch.rand(batch, seq_len, generator=g) < 0.15
    mask[:, 0] = True  # at least one label per row
    return ids, torch.where(mask, ids, torch.full_like(ids, -100))


def _loss(lib_f, task: str, model, x, y):
    if task == "image":
        return lib_f.cross_entropy(model(x), y)
    return model(x, y)[1]


# ---------------------------------------------------------------------------- measuring
class _Ranks:
    """Timing helpers over a gloo group of all ranks (None on one rank)."""

    def __init__(self, world: int):
        self.world = world
        self.group = None
        if world > 1:
            import torch.distributed as dist

            self.group = dist.new_group(backend="gloo")

    def barrier(self) -> None:
        if self.group is not None:
            import torch.distributed as dist

            dist.barrier(group=self.group)

    def reduce(self, value: float, op: str) -> float:
        if self.group is None:
            return value
        import torch
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM,
                        group=self.group)
        return float(t.item()) / (self.world if op == "mean" else 1)


def _collectives_summary(records) -> dict:
    out: dict[str, dict] = {}
    for kind, nbytes in records:
        e = out.setdefault(kind, {"count": 0, "bytes": 0})
        e["count"] += 1
        e["bytes"] += int(nbytes)
    return out


_C10D_KINDS = {"allreduce": "all_reduce", "allgather": "all_gather", "broadcast": "broadcast",
               "reduce_scatter": "reduce_scatter", "alltoall": "all_to_all",
               "_allgather_base": "all_gather", "_reduce_scatter_base": "reduce_scatter",
               "allgather_into_tensor_coalesced": "all_gather",
               "allreduce_coalesced": "all_reduce", "barrier": "barrier"}


@contextlib.contextmanager
def _quiet_stderr():
    """Silence file descriptor 2 (C++ log lines) inside the block; Python exceptions still
    propagate and are printed after it."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _torch_collectives(step, ddp) -> dict:
    """The collectives one PyTorch step runs, from torch's profiler (the ``c10d::`` ops):
    ``{kind: {"count", "bytes"}}``. Bytes: all-reduce = DDP's bucket sizes, broadcast = the
    module's buffers (DDP's ``broadcast_buffers``); 0 where torch does not say."""
    from torch.profiler import profile

    with _quiet_stderr(), profile() as prof:  # kineto logs its start and stop to fd 2
        step()
    counts: dict[str, int] = {}
    for e in prof.events():
        if e.name.startswith("c10d::"):
            kind = e.name[len("c10d::"):].rstrip("_")
            kind = _C10D_KINDS.get(kind, kind)
            counts[kind] = counts.get(kind, 0) + 1
    out = {k: {"count": n, "bytes": 0} for k, n in sorted(counts.items())}
    if ddp is not None:
        info = ddp._get_ddp_logging_data()
        sizes = str(info.get("rebuilt_bucket_sizes") or info.get("bucket_sizes") or "")
        ints = [int(s) for s in sizes.replace(",", " ").split() if s.strip().isdigit()]
        if "all_reduce" in out:
            out["all_reduce"]["bytes"] = sum(ints)
            out["all_reduce"]["ddp_buckets"] = len(ints)
        if "broadcast" in out:
            out["broadcast"]["bytes"] = sum(b.numel() * b.element_size()
                                            for b in ddp.module.buffers())
    return out


def _measure(spec, cfg: _Config, args, world: int, rank: int, ranks: _Ranks,
             dp: int, tp: int, threads: int) -> dict:
    """Run both frameworks on this rank; the result dict (meaningful on rank 0)."""
    import torch

    import sbpflow
    from sbpflow.nn.modules.norm import _BatchNorm
    from sbpflow.nn.parallel import parallelize_module
    from sbpflow.sbp import broadcast, split

    device = args.device
    local_rank = int(os.environ.get("LOCAL_RANK", "0") or 0)
    dev = torch.device("cuda", local_rank % max(torch.cuda.device_count(), 1)) \
        if device == "cuda" else torch.device("cpu")
    if device == "cuda":
        torch.cuda.set_device(dev)
        torch.backends.cudnn.benchmark = True
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    task = spec.task
    optimizer = args.optimizer or ("sgd" if task == "image" else "adamw")
    amp_dtype = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}[cfg.amp]
    overrides = {}
    fmt = torch.channels_last if cfg.channels_last else torch.contiguous_format

    def to_dev(t):
        t = t.to(dev)
        return t.contiguous(memory_format=fmt) if t.dim() == 4 else t

    # Data: torch rank r's batch; sbpflow's DP coordinate d holds ranks d*tp .. d*tp+tp-1.
    x_t, y_t = (to_dev(t) for t in synthetic_batch(spec, cfg.batch, cfg.seq_len, rank,
                                                   args.seed, cfg.image_size or 224))
    coord = rank // tp
    parts = [synthetic_batch(spec, cfg.batch, cfg.seq_len, r, args.seed, cfg.image_size or 224)
             for r in range(coord * tp, coord * tp + tp)]
    x_s = to_dev(torch.cat([p[0] for p in parts]))
    y_s = to_dev(torch.cat([p[1] for p in parts]))
    global_batch = cfg.batch * world

    # sbpflow side.
    if world > 1:
        mesh = torch.arange(world).reshape(dp, tp).tolist() if dp > 1 and tp > 1 \
            else list(range(world))
    else:
        mesh = [0]
    pl = sbpflow.placement(device, mesh)
    if dp > 1 and tp > 1:
        data_sbp = (split(0), broadcast)
    else:
        data_sbp = split(0) if tp == 1 else broadcast
    layout = "dp" if tp == 1 else "tp"
    sbpflow.manual_seed(args.seed)
    s_model = spec.build(**overrides)
    for m in s_model.modules():
        if isinstance(m, _BatchNorm):
            m.sync_stats = False  # per-rank statistics, as DDP without SyncBatchNorm
    if device == "cuda":
        s_model.to(dev)
    if cfg.channels_last:
        s_model._apply_to_tensors(
            lambda t: t.contiguous(memory_format=torch.channels_last) if t.dim() == 4 else t)
    parallelize_module(s_model, pl, spec.plan(layout), tp_axis=-1)
    s_model.train()
    xs = sbpflow.from_torch(x_s).to_global(pl, data_sbp)
    ys = sbpflow.from_torch(y_s).to_global(pl, data_sbp)
    s_params = list(s_model.parameters())
    s_opt = (sbpflow.optim.AdamW(s_params, lr=1e-3) if optimizer == "adamw"
             else sbpflow.optim.SGD(s_params, lr=0.01, momentum=0.9))
    s_scaler = sbpflow.amp.GradScaler(device) if cfg.amp == "fp16" else None

    # PyTorch side.
    torch.manual_seed(args.seed)
    t_model = spec.build_torch(**overrides).to(dev)
    if cfg.channels_last:
        t_model = t_model.to(memory_format=torch.channels_last)
    t_model.train()
    ddp = None
    if world > 1:
        import torch.distributed as dist

        group = dist.new_group(backend="nccl" if device == "cuda" else "gloo")
        ddp = torch.nn.parallel.DistributedDataParallel(
            t_model, process_group=group,
            device_ids=[dev.index] if device == "cuda" else None)
    t_run = ddp if ddp is not None else t_model
    t_opt = (torch.optim.AdamW(t_run.parameters(), lr=1e-3) if optimizer == "adamw"
             else torch.optim.SGD(t_run.parameters(), lr=0.01, momentum=0.9))
    t_scaler = torch.amp.GradScaler(device) if cfg.amp == "fp16" else None

    def autocast():
        if amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=device, dtype=amp_dtype)

    def s_step():
        s_opt.zero_grad()
        with sbpflow.default_placement(pl), autocast():
            loss = _loss(sbpflow.nn.functional, task, s_model, xs, ys)
        if s_scaler is not None:
            s_scaler.scale(loss).backward()
            s_scaler.step(s_opt)
            s_scaler.update()
        else:
            loss.backward()
            s_opt.step()
        return loss

    def t_step():
        t_opt.zero_grad()
        with autocast():
            loss = _loss(torch.nn.functional, task, t_run, x_t, y_t)
        if t_scaler is not None:
            t_scaler.scale(loss).backward()
            t_scaler.step(t_opt)
            t_scaler.update()
        else:
            loss.backward()
            t_opt.step()
        return loss

    def sync():
        if device == "cuda":
            torch.cuda.synchronize(dev)

    # Warm-up (not timed); the first step's loss of each side (same init, same data).
    first = {}
    for name, step in (("sbpflow", s_step), ("torch", t_step)):
        for i in range(max(args.warmup, 1)):
            loss = step()
            if i == 0:
                first[name] = float(loss.float().item()) if name == "sbpflow" else \
                    ranks.reduce(float(loss.float().item()), "mean")
        sync()

    # The collectives of one (untimed) step of each side.
    with sbpflow.distributed.CommRecorder() as rec:
        s_step()
    s_coll = _collectives_summary((r.kind, r.bytes) for r in rec.records)
    t_coll = _torch_collectives(t_step, ddp)
    sync()

    def s_step_unchecked():
        mode = sbpflow.distributed.check_mode()
        sbpflow.distributed.set_check("off")
        try:
            return s_step()
        finally:
            sbpflow.distributed.set_check(mode)

    times: dict[str, list[float]] = {"sbpflow": [], "torch": []}
    cpu: dict[str, list[float]] = {"sbpflow": [], "torch": []}
    if args.check_overhead:
        times["unchecked"], cpu["unchecked"] = [], []
    for rep in range(args.repeats):
        order = (("sbpflow", s_step), ("torch", t_step))
        if args.check_overhead:
            order += (("unchecked", s_step_unchecked),)
        for name, step in (order if rep % 2 == 0 else order[::-1]):
            ranks.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(args.steps):
                step()
            sync()
            t1, c1 = time.perf_counter(), time.process_time()
            times[name].append(ranks.reduce(t1 - t0, "max"))
            cpu[name].append(ranks.reduce(c1 - c0, "mean"))

    def side(name, params_bytes, coll, mode):
        sps = [global_batch * args.steps / t for t in times[name]]
        return {"samples_per_s": statistics.median(sps), "repeats_samples_per_s": sps,
                "step_ms_median": 1000 * statistics.median(times[name]) / args.steps,
                # CPU time of a rank's process per step (all its threads; mean over ranks):
                # work done, less sensitive than wall time to a shared, oversubscribed CPU.
                "cpu_ms_per_step_median": 1000 * statistics.median(cpu[name]) / args.steps,
                "first_loss": first[name], "param_bytes_per_rank": params_bytes,
                "collectives_per_step": coll, "mode": mode}

    s_bytes = sum(p._local.numel() * p._local.element_size()
                  for p in {id(p): p for p in s_params}.values())
    t_bytes = sum(p.numel() * p.element_size() for p in t_model.parameters())
    result = {
        "model": cfg.model, "task": task, "device": device, "ranks": world,
        "layout": {"name": "dp" if tp == 1 else ("tp" if dp == 1 else "dp_tp"), "dp": dp,
                   "tp": tp, "mesh": list(pl.shape)},
        "batch_size_per_rank": cfg.batch, "global_batch": global_batch,
        "seq_len": cfg.seq_len, "image_size": cfg.image_size, "amp": cfg.amp,
        "channels_last": cfg.channels_last,
        "optimizer": optimizer, "threads_per_rank": threads,
        "warmup": args.warmup, "steps": args.steps, "repeats": args.repeats,
        "synthetic_data": True,
        "environment": {"torch": torch.__version__, "python": sys.version.split()[0],
                        "sbpflow": os.path.dirname(os.path.abspath(sbpflow.__file__)),
                        "cpu_count": os.cpu_count(),
                        "gpu": torch.cuda.get_device_name(dev) if device == "cuda" else None},
        "sbpflow": side("sbpflow", s_bytes, s_coll,
                        f"global tensors, {layout} plan on mesh {list(pl.shape)}"),
        "torch": side("torch", t_bytes, t_coll,
                      "DistributedDataParallel (defaults)" if ddp is not None
                      else "plain module, one process"),
    }
    result["ratio"] = result["sbpflow"]["samples_per_s"] / result["torch"]["samples_per_s"]
    if args.check_overhead:
        checked = statistics.median(times["sbpflow"]) / args.steps
        unchecked = statistics.median(times["unchecked"]) / args.steps
        result["check_overhead"] = {
            "mode": sbpflow.distributed.check_mode(),
            "checked_step_ms": 1000 * checked, "unchecked_step_ms": 1000 * unchecked,
            "unchecked_repeats_step_ms": [1000 * t / args.steps for t in times["unchecked"]],
            "checked_repeats_step_ms": [1000 * t / args.steps for t in times["sbpflow"]],
            "overhead": checked / unchecked - 1,
            "collectives_per_step": sum(e["count"] for e in s_coll.values())}
    return result


# ---------------------------------------------------------------------------- orchestration
def _child_argv(base: list[str], result_path: str, threads: int) -> list[str]:
    return [*base, "--nproc-per-node", "1", "--dp", "1", "--tp", "1", "--no-scaling",
             "--threads-per-rank", str(threads), "--child-result", result_path]


def _strip(argv: list[str], flags: dict[str, bool]) -> list[str]:
    """``argv`` without ``flags`` (name -> takes a value)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        name = a.split("=", 1)[0]
        if name in flags:
            skip = flags[name] and "=" not in a
            continue
        out.append(a)
    return out


def _single_rank(argv: list[str], threads: int) -> list[dict]:
    """The 1-rank measurement in a fresh process (no torchrun environment)."""
    base = _strip(argv, {"--nproc-per-node": True, "--dp": True, "--tp": True,
                         "--threads-per-rank": True, "--no-scaling": False, "--out": True,
                         "--child-result": True})
    env = {k: v for k, v in os.environ.items() if k not in _TORCHRUN_ENV}
    env["OMP_NUM_THREADS"] = str(threads)
    env["PYTHONPATH"] = os.pathsep.join(
        [_package_root()] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    with tempfile.TemporaryDirectory(prefix="sbpflow-bench-") as tmp:
        path = os.path.join(tmp, "result.json")
        cmd = [sys.executable, "-m", "sbpflow.bench", *_child_argv(base, path, threads)]
        proc = subprocess.run(cmd, env=env)
        if proc.returncode != 0:
            raise RuntimeError(f"the 1-rank run failed (exit {proc.returncode}): "
                               f"{' '.join(cmd)}")
        with open(path, encoding="utf-8") as f:
            return json.load(f)


def _package_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run_ranks(parser, args, argv: list[str]) -> int:
    """This process is a rank (or the only process): measure, and on rank 0 report."""
    import torch

    import sbpflow.distributed as sd

    if args.threads_per_rank is not None:
        torch.set_num_threads(args.threads_per_rank)
    threads = torch.get_num_threads()
    for mod in args.imports:
        importlib.import_module(mod)
    configs = _configs(parser, args)
    from . import models

    sd.init()
    world, rank = sd.get_world_size(), sd.get_rank()
    ranks = _Ranks(world)
    results = []
    for cfg in configs:
        spec = models.get(cfg.model)
        dp, tp = _layout(parser, args, spec, world)
        results.append(_measure(spec, cfg, args, world, rank, ranks, dp, tp, threads))
        if args.device == "cuda":
            torch.cuda.empty_cache()  # the models of this configuration are gone
    if args.child_result is not None:
        if rank == 0:
            with open(args.child_result, "w", encoding="utf-8") as f:
                json.dump(results, f)
        return 0
    if rank != 0:
        return 0
    if world > 1 and not args.no_scaling:
        singles = _single_rank(argv, threads)
        for res, one in zip(results, singles):
            res["scaling"] = {
                "ranks": [1, world],
                "sbpflow_1rank_samples_per_s": one["sbpflow"]["samples_per_s"],
                "torch_1rank_samples_per_s": one["torch"]["samples_per_s"],
                "sbpflow": res["sbpflow"]["samples_per_s"] / one["sbpflow"]["samples_per_s"],
                "torch": res["torch"]["samples_per_s"] / one["torch"]["samples_per_s"],
                "ratio_1rank": one["ratio"],
                "sbpflow_1rank_repeats": one["sbpflow"]["repeats_samples_per_s"],
                "torch_1rank_repeats": one["torch"]["repeats_samples_per_s"],
            }
    else:
        for res in results:
            res["scaling"] = None
    _report(args, argv, results)
    return 0


def main(argv: list[str] | None = None, prog: str = "sbpflow bench") -> int:
    """Run ``sbpflow bench``; return the exit code.

    Writes (rank 0) ``OUT/bench.json``: for one configuration an object with ``model``,
    ``task``, ``device``, ``ranks``, ``layout`` ({name, dp, tp, mesh}),
    ``batch_size_per_rank``, ``global_batch``, ``seq_len``, ``amp``, ``optimizer``,
    ``threads_per_rank``, ``warmup``/``steps``/``repeats``, ``synthetic_data`` (True),
    ``method``, ``command``, and per framework (``sbpflow``, ``torch``): ``samples_per_s``
    (median), ``repeats_samples_per_s``, ``step_ms_median``, ``first_loss``,
    ``param_bytes_per_rank``, ``collectives_per_step`` ({kind: {count, bytes}}), ``mode``;
    then ``ratio`` (sbpflow / torch samples/s) and ``scaling`` (None, or
    {``sbpflow``, ``torch``: N-rank over 1-rank samples/s, the 1-rank figures,
    ``ratio_1rank``}). Several configurations (``--device cuda``): ``{"method", "command",
    "runs": [object, ...]}``. Also ``OUT/bench.md`` and ``OUT/bench.png``.

    Raises:
        SystemExit: bad arguments (code 2, naming the value and the fix), e.g. ``--dp x
            --tp`` not equal to the ranks, an unknown model, ``--device cuda`` without CUDA.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    _check_args(parser, args)
    nproc = args.nproc_per_node or 1
    if _under_torchrun() or nproc == 1:
        if not _under_torchrun():
            for mod in args.imports:
                importlib.import_module(mod)
            _configs(parser, args)  # model errors before any work
        return _run_ranks(parser, args, argv)
    # Check the model and layout here, before launching N processes.
    for mod in args.imports:
        importlib.import_module(mod)
    from . import models

    for cfg in _configs(parser, args):
        _layout(parser, args, models.get(cfg.model), nproc)
    from .distributed import launch

    launch_argv = ["--standalone", "--nproc-per-node", str(nproc)]
    if args.threads_per_rank is not None:
        launch_argv += ["--threads-per-rank", str(args.threads_per_rank)]
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [_package_root()] + [p for p in (saved or "").split(os.pathsep) if p])
    try:
        return launch.main(launch_argv + ["-m", "sbpflow.bench", *argv])
    finally:
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved


# ---------------------------------------------------------------------------- reporting
def _fmt(x: float) -> str:
    return f"{x:,.1f}" if x >= 10 else f"{x:.2f}"


def _table(results: list[dict]) -> list[str]:
    rows = ["| model | ranks | layout (sbpflow) | batch/rank | framework | samples/s (median) "
            "| ratio | scaling (N/1 rank) |",
            "|---|---|---|---|---|---|---|---|"]
    for r in results:
        lay = r["layout"]
        layout = f"{lay['name']} (dp={lay['dp']}, tp={lay['tp']})"
        batch = f"{r['batch_size_per_rank']}" + (
            f" x {r['seq_len']} tok" if r["seq_len"] else
            f" x {r['image_size']}px" if r.get("image_size") else "")
        sc = r.get("scaling")
        for fw, label in (("sbpflow", "sbpflow"), ("torch", "PyTorch " + (
                "DDP" if r["ranks"] > 1 else "(1 process)"))):
            scale = f"{sc[fw]:.2f}x" if sc else "-"
            ratio = f"{r['ratio']:.2f}x" if fw == "sbpflow" else "1.00x"
            rows.append(f"| {r['model']} | {r['ranks']} | {layout} | {batch} | {label} | "
                        f"{_fmt(r[fw]['samples_per_s'])} | {ratio} | {scale} |")
        if sc:
            rows.append(f"| {r['model']} | 1 | - | {batch} | sbpflow | "
                        f"{_fmt(sc['sbpflow_1rank_samples_per_s'])} | "
                        f"{sc['ratio_1rank']:.2f}x | - |")
            rows.append(f"| {r['model']} | 1 | - | {batch} | PyTorch (1 process) | "
                        f"{_fmt(sc['torch_1rank_samples_per_s'])} | 1.00x | - |")
    return rows


def _bytes(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def _colls(c: dict) -> str:
    if not c:
        return "none"
    return ", ".join(f"{k} x{v['count']} ({_bytes(v['bytes'])})" for k, v in c.items())


def _report(args, argv: list[str], results: list[dict]) -> None:
    r0 = results[0]
    method = METHOD.format(warmup=args.warmup, repeats=args.repeats, steps=args.steps)
    command = "sbpflow bench " + " ".join(argv)
    out_dir = args.out or os.path.join("out", "bench-" + (args.model or "cuda-suite"))
    os.makedirs(out_dir, exist_ok=True)
    lines = [f"Method ({method}).",
             f"Per-rank batch stated below; {r0['threads_per_rank']} torch thread(s) per rank; "
             f"optimizer {r0['optimizer']}; amp {r0['amp']}; device {r0['device']}; "
             f"ratio = sbpflow / PyTorch samples/s.", ""]
    lines += _table(results)
    lines.append("")
    for r in results:
        lines.append(f"- {r['model']} collectives per step and rank: sbpflow: "
                     f"{_colls(r['sbpflow']['collectives_per_step'])}; PyTorch: "
                     f"{_colls(r['torch']['collectives_per_step'])}. Parameters per rank: "
                     f"sbpflow {_bytes(r['sbpflow']['param_bytes_per_rank'])}, PyTorch "
                     f"{_bytes(r['torch']['param_bytes_per_rank'])}. CPU time per step and rank: "
                     f"sbpflow {r['sbpflow']['cpu_ms_per_step_median']:.1f} ms, PyTorch "
                     f"{r['torch']['cpu_ms_per_step_median']:.1f} ms. First-step loss: "
                     f"sbpflow {r['sbpflow']['first_loss']:.4f}, PyTorch "
                     f"{r['torch']['first_loss']:.4f}.")
    for r in results:
        c = r.get("check_overhead")
        if c:
            lines.append(f"- {r['model']} collective agreement check ({c['mode']}): step "
                         f"{c['checked_step_ms']:.1f} ms checked vs "
                         f"{c['unchecked_step_ms']:.1f} ms "
                         f"with SBPFLOW_CHECK=off (medians, same repeats): "
                         f"{100 * c['overhead']:+.1f}%.")
    lines.append("")
    lines.append(f"Command: `{command}`")
    print("\n".join(lines), flush=True)
    with open(os.path.join(out_dir, "bench.md"), "w", encoding="utf-8") as f:
        f.write(f"# sbpflow bench: {args.model or 'cuda suite'} (synthetic data)\n\n")
        f.write("\n".join(lines) + "\n")
    for r in results:
        r["method"] = method
        r["command"] = command
    doc = results[0] if len(results) == 1 else {"method": method, "command": command,
                                                "runs": results}
    with open(os.path.join(out_dir, "bench.json"), "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=2)
    _chart(results, os.path.join(out_dir, "bench.png"))
    print(f"wrote {out_dir}/bench.json, bench.md, bench.png", flush=True)


def _chart(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, s_vals, t_vals, s_err, t_err = [], [], [], [], []

    def err(vals, med):
        return (med - min(vals), max(vals) - med)

    for r in results:
        sc = r.get("scaling")
        name = r["model"] + (f" b{r['batch_size_per_rank']}" if len(results) > 1 else "")
        if sc:
            labels.append(f"{name}\n1 rank")
            s_vals.append(sc["sbpflow_1rank_samples_per_s"])
            t_vals.append(sc["torch_1rank_samples_per_s"])
            s_err.append(err(sc["sbpflow_1rank_repeats"], s_vals[-1]))
            t_err.append(err(sc["torch_1rank_repeats"], t_vals[-1]))
        labels.append(f"{name}\n{r['ranks']} rank{'s' if r['ranks'] > 1 else ''} "
                      f"({r['layout']['name']})")
        s_vals.append(r["sbpflow"]["samples_per_s"])
        t_vals.append(r["torch"]["samples_per_s"])
        s_err.append(err(r["sbpflow"]["repeats_samples_per_s"], s_vals[-1]))
        t_err.append(err(r["torch"]["repeats_samples_per_s"], t_vals[-1]))
    fig, ax = plt.subplots(figsize=(max(5.0, 1.8 * len(labels) + 1), 4))
    xs = range(len(labels))
    w = 0.38
    ax.bar([x - w / 2 for x in xs], s_vals, w, label="sbpflow",
           yerr=list(zip(*s_err)), capsize=3)
    ax.bar([x + w / 2 for x in xs], t_vals, w, label="PyTorch",
           yerr=list(zip(*t_err)), capsize=3)
    for x, s, t in zip(xs, s_vals, t_vals):
        ax.annotate(f"{s / t:.2f}x", (x - w / 2, s), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(xs))
    ax.set_xticklabels(labels, fontsize=8)
    ax.set_ylabel("samples/s (median; bars: min-max of repeats)")
    r0 = results[0]
    ax.set_title(f"sbpflow bench ({r0['device']}, synthetic data, batch "
                 f"{r0['batch_size_per_rank']}/rank); label: sbpflow/PyTorch", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], prog="sbpflow bench"))
