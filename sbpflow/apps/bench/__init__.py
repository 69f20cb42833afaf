"""``sbpflow bench MODEL``: training throughput of an sbpflow model against what a user would
pick instead for the same job (the same model in PyTorch: DDP, DDP compiled, torch's tensor
parallelism, compiled), in one invocation, on the same ranks, threads and data.

Method (DLPerf, https://github.com/Oneflow-Inc/DLPerf), one harness for every runner
(:func:`time_runners`): each runner runs ``--warmup`` training steps that are not timed, then
``--repeats`` blocks of ``--steps`` timed training steps (forward, backward, gradient
synchronisation, optimizer step); a block's time is the slowest rank's, its throughput
``global batch x steps / time`` in samples/s, and the reported figure is the median over the
blocks. The batch is **synthetic** (random inputs of the model's input shape, made once
before timing and reused every step) so that data loading is not measured; results are
labelled as such. The batch size is per rank (``--batch-size``); every runner processes the
same global batch of ``ranks x batch`` samples per step, and the blocks of the runners
alternate (A B C, C B A, ...) so that a slow phase of a shared machine hits all alike.

The runners (:data:`RUNNERS`, each one ``build(job) -> Built`` function; ``--peers`` picks
the PyTorch ones by name or group):

* ``sbpflow`` (always): builds ``spec.build()`` and lays it out with ``spec.plan(layout)``
  via ``parallelize_module`` on a mesh of ``dp x tp`` ranks (1-D when one of them is 1).
  The global batch is ``S(0)`` over the data-parallel axis and ``B`` over the
  tensor-parallel one, so a data-parallel rank holds the same samples as the PyTorch rank of
  the same index. BatchNorm layers run with ``sync_stats=False`` (statistics of each rank's
  part of the batch, as DDP without SyncBatchNorm).
* ``torch-ddp`` (group ``eager``): ``spec.build_torch()`` (the same model file run under
  plain torch, same seed, so the same initial parameters) wrapped, on several ranks, in
  ``torch.nn.parallel.DistributedDataParallel`` with default settings (25 MiB buckets,
  ``broadcast_buffers=True``); on one rank the plain model. The baseline of data-parallel
  layouts.
* ``torch-ddp-compiled`` (group ``compiled``): ``torch.compile(ddp_model)``.
* ``torch-tp`` (group ``eager``, tensor-parallel layouts with ``dp = 1``): the torch twin
  under DTensor ``parallelize_module`` with ``ColwiseParallel`` / ``RowwiseParallel`` where
  the model's sbpflow plan has them (attention q, k, v colwise and its projection rowwise;
  the MLP's first layer colwise, its second rowwise; ``n_head / tp`` heads per rank), on a
  ``DeviceMesh`` of all ranks; vocabulary-parallel layers stay replicated. Every rank
  processes the whole batch of its tensor-parallel group, as sbpflow's does. The baseline of
  tensor-parallel layouts.
* ``torch-tp-compiled`` (group ``compiled``): ``torch.compile`` of the ``torch-tp`` model.

Pipeline parallelism (``--pp P``, GPT models, CPU): the world is ``P`` ranks, one stage each
(no data or tensor parallelism inside stages), and exactly two runners run, on the same
split (stage 0: the embeddings and the first blocks; the last stage: its blocks, ``ln_f``
and ``lm_head``; blocks split contiguously, ``block * P // n_layer``), the same
``--micro-batches M`` (default ``2 P``), the same ``--schedule`` (``1f1b``, ``gpipe`` or
``zero_bubble``) and the same data (the global batch of ``--batch-size x P`` samples, cut
into ``M`` micro-batches):

* ``sbpflow-pipeline``: the model's stages put in place with
  ``module.to(GraphModule).set_stage(s, placement)`` inside an ``nn.Graph`` with
  ``set_gradient_accumulation_steps(M)`` and ``set_pipeline_schedule``; the tied
  embedding / ``lm_head`` weight is sbpflow's to handle.
* ``torch-pipelining`` (the baseline): the torch twin cut into the same stages under
  ``torch.distributed.pipelining`` (``PipelineStage`` + ``Schedule1F1B`` /
  ``ScheduleGPipe`` / ``ScheduleInterleavedZeroBubble`` over one stage per rank, whose
  order is ZB-H1's); the tied weight untied and its two copies' gradients summed by an
  all-reduce between the first and the last stage each step, as Megatron-LM does.

``--compare-schedules`` (instead of ``--schedule``) times four runners in one run: both
sides under 1F1B (``sbpflow-pipeline``, ``torch-pipelining``) and under zero-bubble
(``sbpflow-pipeline-zb``, ``torch-pipelining-zb``), each with its measured bubble beside
the prediction of ``sbpflow.runtime.schedules.simulate`` for its schedule
(:func:`bubble_prediction`).

Besides the figures below, a ``--pp`` run reports each runner's measured bubble next to
the theory (``(p - 1) / m`` for 1F1B and GPipe, ``simulate()``'s for zero-bubble; each
rank's idle time over its busy time, busy = the main thread's CPU time: :func:`_idle`,
which also states the method's limits; every runner of every run gets these ``idle``
figures) and sbpflow's peak activation memory per stage for 1F1B and GPipe (and
zero-bubble when timed) (``sbpflow.graph.show.peak_live_bytes`` of each rank's compiled program, an
estimate). There is no 1-rank run with ``--pp`` (no scaling ratio): a pipeline's 1-rank
counterpart is no pipeline.

``--peers all`` runs every PyTorch runner that can run the layout. A compiled runner
compiles in its first warm-up step: the report gives that as ``compile_s`` (first step less
one median step), excluded from every step time; ``--compile-backend`` picks the backend
(inductor by default; on a 2-core CPU its compile takes minutes). Each torch runner has its
own process group (``dist.new_group`` over all ranks: gloo on CPU, NCCL on CUDA), separate
from sbpflow's groups so neither side's traffic or sequence numbers touch the other's.

The headline ``ratio`` is sbpflow's samples/s over the *baseline*: the selected peer of the
same layout (DDP for data parallel and on one rank, torch TP for tensor parallel); ``ratios``
gives sbpflow over every PyTorch peer, and each row's ``vs baseline`` its samples/s over the
baseline's, all from the same blocks of the same run.

Adding a runner (the nn.Graph work does this for ``--graph`` and ``--graph --compile``,
which select ``sbpflow-graph`` and ``sbpflow-graph-compiled``; until they are registered
those flags raise ``NotImplementedError("nn.Graph runner not available yet ...")``)::

    from sbpflow.apps import bench

    def build_graph(job: bench.Job) -> bench.Built:
        # job: spec, cfg, args, world, rank, dp, tp, dev, optimizer, layout,
        #      rank_batch (this rank's samples), coord_batch (its TP group's samples),
        #      autocast(), make_optimizer(optim, params), sync()
        model, opt, batch = ...                     # built for job.layout on this rank
        def step(batch):                            # one whole training step
            ...
            return loss                             # a 0-d tensor
        return bench.Built(step, batch, param_bytes, "nn.Graph, tp plan", collectives,
                           loss_is_global=True)

    bench.register_runner(bench.Runner("sbpflow-graph", "sbpflow nn.Graph", "sbpflow",
                                       build_graph))

in a module that ``sbpflow.apps.bench`` imports, or one named with ``--import MODULE``. A runner
may also say which layouts it supports (``supports``), which layouts it is the baseline of
(``baseline_for``) and which ``--peers`` groups include it (``groups``).

Defaults on the CPU: 8 samples per rank, images 128 x 128 (DLPerf's 224 with
``--image-size 224``), text at the config's longest sequence, 3 warm-up steps, 3 repeats of
10 steps. Besides samples/s the report gives each runner's median step time, its
first-step loss (equal when the runners really run the same model on the same batch), its
CPU time per step (work done, less noisy than wall time on a shared machine), peak device
memory (CUDA only), parameter bytes per rank, and the collectives one step runs (sbpflow's
from :class:`~sbpflow.distributed.CommRecorder`, PyTorch's from its ``c10d::`` and
``_c10d_functional::`` ops seen by a dispatch mode, with DDP's bucket count).

All use the same optimizer (``--optimizer``: AdamW lr 1e-3, or SGD lr 0.01 momentum 0.9),
the same autocast setting (``--amp``) and the same number of torch threads per rank.

Launch: ``sbpflow bench resnet18 --nproc-per-node 2`` starts 2 ranks itself (through
``sbpflow.distributed.launch``, i.e. torchrun); under ``torchrun`` it runs in place and does
not relaunch. Unless ``--no-scaling``, rank 0 then runs the 1-rank measurement of sbpflow
and the plain torch model (``--peers``, ``--graph`` dropped) in a fresh process (same
threads, same per-rank batch) for the scaling ratio ``samples/s on N ranks / samples/s on 1
rank`` (of sbpflow, and of the baseline over the plain torch model).

Outputs (rank 0), in ``--out`` (default ``out/bench-MODEL``): ``bench.json`` (see
:func:`main`), ``bench.md`` (a markdown table) and ``bench.png`` (a bar chart).

``--device cuda`` runs the GPU-sized configurations on the GPU(s): with no MODEL the suite
ResNet-50 at batch 128 and 256 (channels-last, bf16 autocast), BERT-base at sequence
length 128 and GPT-2 (bf16 autocast); with a MODEL that model's entries of the suite.

Examples::

    sbpflow bench resnet18 --nproc-per-node 2
    sbpflow bench gpt-mini --nproc-per-node 2 --tp 2
    sbpflow bench gpt-mini --nproc-per-node 2 --tp 2 --peers all   # + DDP/TP compiled
    sbpflow bench gpt-mini --nproc-per-node 4 --dp 2 --tp 2 --amp bf16
    sbpflow bench gpt-mini --nproc-per-node 2 --pp 2 --micro-batches 8 --schedule gpipe
    sbpflow bench gpt-mini --nproc-per-node 2 --pp 2 --micro-batches 8 --compare-schedules
    torchrun --nproc-per-node 2 -m sbpflow.apps.bench resnet18   # no relaunch under torchrun
    sbpflow bench --device cuda                               # the GPU suite, one GPU
    sbpflow bench partial-fc --classes 1e4,1e6 --nproc-per-node 2   # the class-split head

``sbpflow bench partial-fc`` (:mod:`sbpflow.apps.bench.partial_fc`, routed by the command line)
benchmarks :class:`sbpflow.nn.PartialFC` against PyTorch DDP with a replicated head, with
this module's :func:`time_runners`.
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import importlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from sbpflow._argtypes import nonneg_int as _nonnegative
from sbpflow._argtypes import positive_int as _positive
from sbpflow._argtypes import positive_seconds as _positive_seconds
from sbpflow.models.spec import CPU_BATCH as _CPU_BATCH
from sbpflow.models.spec import layout_placement, per_rank_batch_norm, synthetic_batch
from sbpflow.models.spec import task_loss as _loss

from .. import require_extra

__all__ = ["main", "METHOD", "CUDA_SUITE", "Job", "Built", "Runner", "RUNNERS", "register_runner",
           "get_runner", "select_runners", "baseline_runner", "time_runners",
           "bubble_prediction"]

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
               "BERT-base s128, GPT-2)\n"
               "  %(prog)s partial-fc --classes 1e4,1e6 --nproc-per-node 2   (the class-split "
               "margin-softmax head; see `%(prog)s partial-fc --help`)")
    p.add_argument("model", nargs="?", default=None,
                   help=f"a model of sbpflow.models ({', '.join(_known_models())}), or "
                        f"'dlrm' (the embedding-table sweep) or 'partial-fc' (the class-split "
                        f"head), each with its own --help; optional with --device cuda "
                        f"(then the whole GPU suite runs)")
    p.add_argument("--nproc-per-node", type=_positive, default=None, metavar="N",
                   help="ranks to launch on this node (default 1; under torchrun: its world)")
    p.add_argument("--batch-size", type=_positive, default=None, metavar="B",
                   help="samples per rank per step (default on the CPU: 8 for text and "
                        "images, 256 click-through, 64 face; --device cuda: "
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
    p.add_argument("--pp", type=_positive, default=None, metavar="P",
                   help="pipeline parallelism: P stages, one rank each (the world is P "
                        "ranks: no data or tensor parallelism inside stages); times "
                        "sbpflow-pipeline against torch-pipelining (GPT models)")
    p.add_argument("--micro-batches", type=_positive, default=None, metavar="M",
                   help="with --pp: micro-batches per step (default 2 x P); the global "
                        "batch must be divisible by M")
    p.add_argument("--schedule", choices=("1f1b", "gpipe", "zero_bubble"), default=None,
                   help="with --pp: the pipeline schedule of both sides (default 1f1b; "
                        "torch: Schedule1F1B / ScheduleGPipe / ScheduleInterleavedZeroBubble "
                        "with one stage per rank, ZB-H1's order)")
    p.add_argument("--compare-schedules", action="store_true",
                   help="with --pp: time 1F1B and zero-bubble (ZB-H1) on both sides in one "
                        "run: sbpflow-pipeline, sbpflow-pipeline-zb, torch-pipelining "
                        "(Schedule1F1B), torch-pipelining-zb (ScheduleInterleavedZeroBubble); "
                        "each one's measured bubble beside simulate()'s")
    p.add_argument("--plan", default=None, metavar="auto|FILE",
                   help="time sbpflow's own layout: 'auto' (nn.Graph's enable_auto_parallel "
                        "on this machine's calibration; the model laid out broadcast on all "
                        "ranks, the whole batch on each) or a plan FILE (`sbpflow plan "
                        "--save`, or a `sbpflow train --plan auto` run's plan.json), against "
                        "DDP; a pipeline plan FILE runs as --pp (one rank per stage)")
    p.add_argument("--compare-plans", action="store_true",
                   help="with --plan: also time the hand plans (dp, tp, dp_tp, zero1-3, pp "
                        "where the model and ranks allow) in the same run, and print each plan's "
                        "predicted step time against its measured one (ranks, Spearman)")
    p.add_argument("--one-at-a-time", action="store_true",
                   help="build, time and free one runner after another (for models whose "
                        "runners do not fit in memory together, e.g. arcface-1e6 with "
                        "--compare-plans), twice, the second pass in reverse order, each "
                        "runner's faster pass kept (the auto plan found once); runners then "
                        "do not alternate block by block, so a slow phase of a shared "
                        "machine can favour one of them")
    p.add_argument("--memory-per-rank", type=_positive, default=None, metavar="BYTES",
                   help="with --plan auto: the search's memory limit per rank "
                        "(set_auto_parallel_memory_limit); the report says whether the "
                        "chosen plan's measured peak is within it")
    p.add_argument("--search-time", type=_positive_seconds, default=None, metavar="SECONDS",
                   help="with --plan auto: the search's time limit "
                        "(set_auto_parallel_search_time; default 10)")
    p.add_argument("--amp", choices=("none", "bf16", "fp16"), default=None,
                   help="autocast dtype on both sides (default none on CPU, bf16 on CUDA); "
                        "fp16 adds a GradScaler")
    p.add_argument("--optimizer", choices=("adamw", "sgd"), default=None,
                   help="both sides (default: sgd with momentum for images and face "
                        "recognition, as InsightFace; adamw for text and click-through)")
    add_out_arguments(p, "bench.json, bench.md, bench.png", "out/bench-MODEL")
    p.add_argument("--threads-per-rank", type=_positive, default=None, metavar="N",
                   help="torch threads per rank, both sides and the 1-rank run (default 1 "
                        "when several ranks share the node, else torch's default)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--check-overhead", action="store_true",
                   help="also time the sbpflow side with the collective agreement check off "
                   "(SBPFLOW_CHECK=off), in the same repeats, and report the default check's "
                   "share of the step time")
    p.add_argument("--peers", default="eager", metavar="LIST",
                   help="comma-separated runners to compare sbpflow with: names (torch-ddp, "
                        "torch-ddp-compiled, torch-tp, torch-tp-compiled) or groups (eager, "
                        "compiled, all: those that can run the layout). Default: eager "
                        "(torch-ddp, and torch-tp for a tensor-parallel layout)")
    p.add_argument("--graph", action="store_true",
                   help="also time sbpflow's nn.Graph mode (runner sbpflow-graph)")
    p.add_argument("--compile", action="store_true",
                   help="with --graph: the compiled nn.Graph (runner sbpflow-graph-compiled) "
                        "instead")
    p.add_argument("--compile-backend", default="inductor", metavar="NAME",
                   help="torch.compile backend of the compiled torch peers (default "
                        "inductor; aot_eager traces without generating code)")
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


def _pipeline_plan_args(parser: argparse.ArgumentParser, args) -> None:
    """``--plan FILE`` of a pipeline (``sbpflow plan --save`` of a pp row) runs as the
    file's ``--pp``, ``--micro-batches`` and ``--schedule`` (sbpflow-pipeline against
    torch-pipelining; ``args.plan`` cleared); bench's pipelines have one rank per stage,
    so a file with data parallelism inside its stages is refused (``sbpflow train --plan
    FILE`` runs it). A plan of layouts is left alone."""
    from sbpflow.planner.plan_file import pipeline_plan_file

    plan = pipeline_plan_file(args.plan)
    if plan is None:
        return
    pipe, dp = plan["pipeline"], (plan.get("mesh") or [1])[0]
    if dp != 1:
        parser.error(f"--plan {args.plan}: a pipeline of {pipe['stages']} stages x {dp} "
                     f"data-parallel ranks; sbpflow bench times pipelines of one rank per "
                     f"stage: run it with sbpflow train --plan FILE --nproc-per-node "
                     f"{pipe['stages'] * dp}")
    if pipe["schedule"] == "interleaved":
        parser.error(f"--plan {args.plan}: an interleaved pipeline ({pipe['virtual_stages']} "
                     f"model chunks a rank); sbpflow bench times 1f1b, gpipe and zero_bubble "
                     f"pipelines: run it with sbpflow train MODEL --plan {args.plan} "
                     f"--nproc-per-node {pipe['stages']}")
    if args.compare_plans:
        parser.error(f"--plan {args.plan} is a pipeline: --compare-plans compares layouts "
                     f"of one graph with the hand plans, pp among them; use --plan auto "
                     f"--compare-plans, or drop --compare-plans to time this pipeline")
    for flag, value, want in (("--pp", args.pp, pipe["stages"]),
                              ("--micro-batches", args.micro_batches, pipe["micro_batches"]),
                              ("--schedule", args.schedule, pipe["schedule"])):
        if value not in (None, want):
            parser.error(f"--plan {args.plan} is a pipeline ({flag} {want}); {flag} {value} "
                         f"contradicts it: drop {flag}")
    args.pp, args.micro_batches = pipe["stages"], pipe["micro_batches"]
    args.schedule, args.plan = pipe["schedule"], None


def _check_args(parser: argparse.ArgumentParser, args) -> None:
    """Argument checks that need no rank or model (run before any launch)."""
    if args.compile and not args.graph:
        parser.error("--compile compiles the nn.Graph runner: add --graph (the compiled "
                     "PyTorch peers are --peers torch-ddp-compiled,torch-tp-compiled)")
    _pipeline_plan_args(parser, args)
    _check_pp_args(parser, args)
    if args.one_at_a_time and args.pp:
        parser.error("--one-at-a-time with --pp: the pipeline runners' bubble report reads "
                     "them side by side; drop --one-at-a-time")
    if args.compare_plans and args.plan is None:
        parser.error("--compare-plans compares a plan with the hand plans: add --plan auto "
                     "(or --plan FILE)")
    if args.plan is not None:
        for flag, bad in (("--pp", args.pp), ("--graph", args.graph),
                          ("--check-overhead", args.check_overhead),
                          ("--dp", args.dp), ("--tp", args.tp)):
            if bad:
                parser.error(f"--plan {args.plan} with {flag}: a plan runs its own layouts as "
                             f"nn.Graph steps; drop {flag}")
        from sbpflow.planner.auto import plan_argument_error

        why = plan_argument_error(args.plan)
        if why:
            parser.error(why)
    for flag, value in (("--memory-per-rank", args.memory_per_rank),
                        ("--search-time", args.search_time)):
        if value is not None and args.plan != "auto":
            parser.error(f"{flag} is the auto-parallel search's limit: add --plan auto")
    if args.model is None and args.device != "cuda":
        parser.error("MODEL is required (e.g. `resnet18`, `gpt-mini`; known models: "
                     f"{', '.join(_known_models())}, and the sweeps `dlrm` and `partial-fc`); "
                     f"only --device cuda runs a suite without one")
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


def _check_pp_args(parser: argparse.ArgumentParser, args) -> None:
    """``--pp`` and its options: what they combine with (before any launch)."""
    if args.pp is None:
        for flag, value in (("--micro-batches", args.micro_batches),
                            ("--schedule", args.schedule),
                            ("--compare-schedules", args.compare_schedules or None)):
            if value is not None:
                parser.error(f"{flag} is a pipeline option: add --pp P")
        return
    if args.compare_schedules and args.schedule is not None:
        parser.error(f"--compare-schedules times 1f1b and zero_bubble on both sides: drop "
                     f"--schedule {args.schedule}")
    if args.pp < 2:
        parser.error(f"--pp {args.pp}: a pipeline needs at least 2 stages")
    for flag, bad in (("--dp", args.dp not in (None, 1)), ("--tp", args.tp not in (None, 1)),
                      ("--graph", args.graph), ("--check-overhead", args.check_overhead),
                      ("--peers", args.peers not in ("eager", "torch-pipelining"))):
        if bad:
            parser.error(f"--pp {args.pp} times sbpflow-pipeline against torch-pipelining "
                         f"only, one stage per rank: drop {flag}")
    if args.amp == "fp16":
        parser.error("--pp: --amp fp16 (a GradScaler) is not supported with --pp; use "
                     "--amp bf16 or none")
    if args.device == "cuda":
        parser.error("--pp runs on the CPU only for now (drop --device cuda)")


def _known_models() -> list[str]:
    from sbpflow import models

    return models.names()


def _layout(parser, args, spec, ranks: int) -> tuple[int, int]:
    """(dp, tp) of the sbpflow side: :func:`sbpflow.apps.train.resolve_layout`, its ValueError
    turned into a usage error (exit code 2)."""
    from ..train import resolve_layout

    if getattr(args, "pp", None):
        n_layer = getattr(spec.config, "n_layer", None)
        if spec.family != "gpt" or not isinstance(n_layer, int):
            parser.error(f"--pp: the bench splits GPT models into stages by blocks; "
                         f"{spec.name} is a {spec.family} model")
        if ranks != args.pp:
            parser.error(f"--pp {args.pp} needs {args.pp} ranks (one stage per rank), but "
                         f"the world has {ranks}; launch with --nproc-per-node {args.pp}")
        if n_layer < args.pp:
            parser.error(f"--pp {args.pp}: {spec.name} has {n_layer} blocks, fewer than the "
                         f"stages; pick --pp <= {n_layer}")
        return 1, 1
    if getattr(args, "plan", None) is not None:
        return ranks, 1  # the plans lay themselves out; DDP is the headline's peer
    try:
        return resolve_layout(spec, args.dp, args.tp, ranks)
    except ValueError as e:
        parser.error(str(e))


def _runner_names(parser, args, spec, dp: int, tp: int, world: int) -> list[str]:
    """:func:`select_runners`, its ValueError turned into a usage error (exit code 2); its
    NotImplementedError (``--graph`` before the nn.Graph runner exists) propagates."""
    try:
        return select_runners(args, spec, dp, tp, world)
    except ValueError as e:
        parser.error(str(e))


def _configs(parser, args) -> list[_Config]:
    from sbpflow import models

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
        if spec.task not in _CPU_BATCH:
            parser.error(f"model {c.model!r} has task {spec.task!r}; bench knows "
                         f"{sorted(_CPU_BATCH)}")
        if not hasattr(spec, "build_torch"):
            parser.error(f"model {c.model!r}: its spec has no build_torch() (the plain-PyTorch "
                         f"twin bench compares against)")
        batch = c.batch or _CPU_BATCH[spec.task]  # cuda suite entries carry theirs
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
        if args.pp:
            m = _micro_batches(args)
            if (batch * args.pp) % m:
                parser.error(f"--pp {args.pp} --micro-batches {m}: the global batch of "
                             f"{batch} x {args.pp} samples cannot be cut into {m} equal "
                             f"micro-batches; make --batch-size x {args.pp} divisible by {m}")
        resolved.append(_Config(c.model, batch, seq, c.amp, c.channels_last, size))
    return resolved


def _micro_batches(args) -> int:
    """``--micro-batches``, by default twice the pipeline stages."""
    return args.micro_batches or 2 * args.pp


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

    def gather(self, value: float) -> list[float]:
        """Every rank's ``value``, in rank order (on every rank)."""
        if self.group is None:
            return [value]
        import torch
        import torch.distributed as dist

        t = torch.zeros(self.world, dtype=torch.float64)
        t[dist.get_rank()] = value
        dist.all_reduce(t, group=self.group)
        return t.tolist()


def _collectives_summary(records) -> dict:
    out: dict[str, dict] = {}
    for kind, nbytes in records:
        e = out.setdefault(kind, {"count": 0, "bytes": 0})
        e["count"] += 1
        e["bytes"] += int(nbytes)
    return out


# torch's collective ops by (namespace, name): (the report's kind, index of the argument
# holding the input: its bytes are counted, as sbpflow's CommRecorder counts its input)
_C10D_OPS = {
    ("c10d", "allreduce_"): ("all_reduce", 0),
    ("c10d", "allreduce_coalesced_"): ("all_reduce", 0),
    ("c10d", "allgather_"): ("all_gather", 1),
    ("c10d", "_allgather_base_"): ("all_gather", 1),
    ("c10d", "allgather_coalesced_"): ("all_gather", 1),
    ("c10d", "allgather_into_tensor_coalesced_"): ("all_gather", 1),
    ("c10d", "reduce_scatter_"): ("reduce_scatter", 1),
    ("c10d", "_reduce_scatter_base_"): ("reduce_scatter", 1),
    ("c10d", "reduce_scatter_tensor_coalesced_"): ("reduce_scatter", 1),
    ("c10d", "alltoall_"): ("all_to_all", 1),
    ("c10d", "alltoall_base_"): ("all_to_all", 1),
    ("c10d", "broadcast_"): ("broadcast", 0),
    ("c10d", "reduce_"): ("reduce", 0),
    ("c10d", "send"): ("send", 0),
    ("c10d", "recv_"): ("recv", 0),
    ("c10d", "barrier"): ("barrier", None),
    ("_c10d_functional", "all_reduce"): ("all_reduce", 0),
    ("_c10d_functional", "all_reduce_"): ("all_reduce", 0),
    ("_c10d_functional", "all_reduce_coalesced"): ("all_reduce", 0),
    ("_c10d_functional", "all_gather_into_tensor"): ("all_gather", 0),
    ("_c10d_functional", "all_gather_into_tensor_coalesced"): ("all_gather", 0),
    ("_c10d_functional", "reduce_scatter_tensor"): ("reduce_scatter", 0),
    ("_c10d_functional", "reduce_scatter_tensor_coalesced"): ("reduce_scatter", 0),
    ("_c10d_functional", "all_to_all_single"): ("all_to_all", 0),
    ("_c10d_functional", "broadcast"): ("broadcast", 0),
}


def _tensor_bytes(x) -> int:
    import torch

    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_tensor_bytes(t) for t in x)
    return 0


def _c10d_recorder():
    """A ``TorchDispatchMode`` that appends ``(kind, input bytes)`` to its ``calls`` for
    every collective op of torch's (``c10d::`` as DDP and ``torch.distributed`` call them,
    ``_c10d_functional::`` as DTensor and compiled code do; a functional op's inner
    ``c10d::`` call runs outside the mode and is not counted again)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Calls(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls: list[tuple[str, int]] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            op = _C10D_OPS.get((func.namespace, func._opname))
            if op is not None:
                kind, arg = op
                self.calls.append((kind, 0 if arg is None or arg >= len(args)
                                   else _tensor_bytes(args[arg])))
            return func(*args, **(kwargs or {}))

    return _Calls()


def _torch_collectives(step, ddp) -> dict:
    """The collectives one PyTorch step runs: ``{kind: {"count", "bytes"}}``, each torch
    collective op seen by a dispatch mode (:func:`_c10d_recorder`; bytes of its input, as
    sbpflow's records count theirs); with ``ddp``, ``all_reduce`` also carries DDP's
    ``ddp_buckets`` (its bucket count, from DDP's logging data).

    Not torch's profiler (used before): in torch 2.13 a kineto profile around a DDP step on
    gloo corrupts the heap now and then (freeing the profile's events segfaults or glibc
    aborts: 3 of 3 runs profiling every 5th of 600 steps; CI's bench run once)."""
    rec = _c10d_recorder()
    with rec:
        step()
    out = _collectives_summary(rec.calls)
    out = {k: out[k] for k in sorted(out)}
    if ddp is not None and "all_reduce" in out:
        info = ddp._get_ddp_logging_data()
        sizes = str(info.get("rebuilt_bucket_sizes") or info.get("bucket_sizes") or "")
        out["all_reduce"]["ddp_buckets"] = len([s for s in sizes.replace(",", " ").split()
                                                if s.strip().isdigit()])
    return out


# ---------------------------------------------------------------------------- the harness
@dataclass
class Job:
    """One measurement as this rank sees it; every runner of the run gets the same one.

    ``rank_batch`` and ``coord_batch`` are the *same* synthetic samples cut two ways (see
    :func:`synthetic_batch`; plain torch tensors on ``dev``, images in ``channels_last`` when
    asked): ``rank_batch`` = ``(inputs, targets)`` of rank ``rank`` (``cfg.batch`` samples),
    what a data-parallel rank of every layout owns; ``coord_batch`` = the batches of ranks
    ``c*tp .. c*tp+tp-1`` concatenated (``tp x cfg.batch`` samples), where ``c = rank // tp``
    is this rank's data-parallel coordinate: what the ``tp`` ranks of a tensor-parallel group
    all process. Either way one step consumes ``cfg.batch x world`` samples in all. With
    ``--pp`` (``pp > 1``), ``coord_batch`` is the whole global batch (every rank's samples
    concatenated): the pipeline's one batch per step, its inputs read by the first stage and
    its targets by the last, cut into ``micro_batches`` equal micro-batches along dim 0.
    """

    spec: object  # the ModelSpec
    cfg: _Config
    args: argparse.Namespace
    world: int
    rank: int
    dp: int  # data-parallel degree (sbpflow's layout; dp x tp = world)
    tp: int  # tensor-parallel degree
    dev: object  # this rank's torch.device
    optimizer: str  # "adamw" | "sgd"
    rank_batch: tuple
    coord_batch: tuple
    pp: int = 1  # pipeline stages (--pp; one rank each, dp = tp = 1)
    micro_batches: int = 1  # --micro-batches with --pp
    schedule: str = "1f1b"  # --schedule with --pp
    # --plan auto's plan once found (its dict): a runner built again (--one-at-a-time's
    # second pass) runs it instead of searching again
    found_plan: dict | None = None

    @property
    def device(self) -> str:
        return self.args.device

    @property
    def layout(self) -> str:
        """``"dp"``, ``"tp"``, ``"dp_tp"`` (a 2-D mesh) or ``"pp"`` (``--pp``)."""
        if self.pp > 1:
            return "pp"
        return "dp" if self.tp == 1 else ("tp" if self.dp == 1 else "dp_tp")

    @property
    def global_batch(self) -> int:
        """Samples per training step over all ranks."""
        return self.cfg.batch * self.world

    def autocast(self):
        """``torch.autocast`` for ``--amp`` (a null context for ``none``)."""
        import torch

        dtype = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}[self.cfg.amp]
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device, dtype=dtype)

    def make_optimizer(self, optim, params):
        """``--optimizer`` from ``optim`` (``torch.optim`` or ``sbpflow.optim``): AdamW lr
        1e-3, or SGD lr 0.01 momentum 0.9."""
        params = list(params)
        if self.optimizer == "adamw":
            return optim.AdamW(params, lr=1e-3)
        return optim.SGD(params, lr=0.01, momentum=0.9)

    def sync(self) -> None:
        """Wait for this rank's device (CUDA); nothing on the CPU."""
        if self.device == "cuda":
            import torch

            torch.cuda.synchronize(self.dev)


@dataclass
class Built:
    """A runner built on this rank (by :attr:`Runner.build`), ready to time.

    Attributes:
        step: ``step(batch) -> loss``: one whole training step (zero grad, forward, backward,
            gradient synchronisation, optimizer step); the loss a 0-d tensor.
        batch: this runner's layout of the job's data (made once, not timed).
        param_bytes: bytes of parameters this rank holds (a tied weight once); or a
            function giving them, read after the timed steps (a graph that lays its
            parameters out at its first call: auto-parallel, ZeRO-3).
        mode: what runs, in words (shown in the report).
        collectives: ``collectives() -> {kind: {"count", "bytes", ...}}``: runs one more
            step (untimed) and returns the collectives that step ran on this rank.
        loss_is_global: the loss is the whole batch's on every rank (sbpflow); else it is the
            rank's part and the reported first-step loss is the mean over ranks.
        compiled: built with ``torch.compile``: the first step compiles, and the report gives
            ``compile_s`` (excluded from every step time).
        loss_rank: the one rank whose ``step`` returns the loss (a pipeline's last stage;
            the others return anything): the reported first-step loss is that rank's.
        graph: the ``nn.Graph`` the step calls (graph runners; else None): its compiled
            programs are read after timing (the pipeline's activation peaks).
        schedule: the pipeline schedule the runner runs (``--pp`` runners; else None).
        predict: ``predict(hw) -> (terms, memory bytes)`` for a runner whose graph cannot
            be lowered (``plan-pp``: :func:`sbpflow.planner.pipeline.predict_pipeline`);
            None: its graph's logical graph is priced.
    """

    step: Callable
    batch: object
    param_bytes: int | Callable[[], int]
    mode: str
    collectives: Callable[[], dict]
    loss_is_global: bool = False
    compiled: bool = False
    loss_rank: int | None = None
    graph: object = None
    schedule: str | None = None
    predict: Callable | None = None


def _always(spec, dp: int, tp: int, world: int) -> str | None:
    return None


@dataclass(frozen=True)
class Runner:
    """One way to train the job's model, registered in :data:`RUNNERS` by ``name``.

    Attributes:
        name: the key, as given to ``--peers`` (``"torch-ddp"``).
        label: the table's framework column (``"PyTorch DDP"``).
        framework: ``"sbpflow"`` or ``"torch"`` (the ratios are sbpflow over torch peers).
        build: ``build(job: Job) -> Built``; every rank calls it, in the same order.
        supports: ``supports(spec, dp, tp, world) -> None`` when the runner can run that
            layout, else the reason it cannot (a sentence; asked before any launch).
        baseline_for: layouts (``"dp"``, ``"tp"``, ``"dp_tp"``) for which this runner is the
            peer the headline ratio is taken against.
        groups: the ``--peers`` groups that include it (``"eager"``, ``"all"``).
    """

    name: str
    label: str
    framework: str
    build: Callable
    supports: Callable = _always
    baseline_for: tuple = ()
    groups: tuple = ("all",)


# name -> Runner. The built-in runners are registered below; see the module doc for adding one.
RUNNERS: dict[str, Runner] = {}
# Selected by ``--graph`` (``--graph --compile``) and registered by the nn.Graph work.
GRAPH_RUNNERS = ("sbpflow-graph", "sbpflow-graph-compiled")


def register_runner(runner: Runner) -> Runner:
    """Add ``runner`` to :data:`RUNNERS` (returns it).

    Raises:
        ValueError: a runner of that name is registered already.
    """
    if runner.name in RUNNERS:
        raise ValueError(f"bench runner {runner.name!r} is registered twice")
    RUNNERS[runner.name] = runner
    return runner


def get_runner(name: str) -> Runner:
    """The runner registered as ``name``.

    Raises:
        NotImplementedError: ``name`` is an nn.Graph runner (``--graph``) not registered yet.
        ValueError: any other unknown name (naming the registered ones).
    """
    if name in RUNNERS:
        return RUNNERS[name]
    if name in GRAPH_RUNNERS:
        raise NotImplementedError(
            f"nn.Graph runner not available yet: --graph selects {name!r}, which no module "
            f"has registered (sbpflow.apps.bench.register_runner); registered: {sorted(RUNNERS)}")
    raise ValueError(f"no bench runner {name!r}; registered: {sorted(RUNNERS)}")


def time_runners(job: Job, ranks: _Ranks, built: dict[str, Built]) -> dict[str, dict]:
    """Time every built runner on the job's data, the same way; the result per name.

    Method: each runner runs ``--warmup`` untimed steps (at least 1: the first step's loss
    and wall time are kept; a compiled runner compiles there), then one more untimed step
    that records its collectives; then ``--repeats`` blocks of ``--steps`` timed steps,
    runners alternating block by block and the order reversed every other repeat (A B C,
    C B A, ...) so that a slow phase of a shared machine hits all alike. All ranks start a
    block together (barrier); a block's time is the slowest rank's.

    Returns ``{name: side}``, each side: ``samples_per_s`` (median over repeats of
    ``global batch x steps / block time``, samples/s), ``repeats_samples_per_s``,
    ``step_ms_median`` (wall ms per step), ``repeats_step_ms``, ``cpu_ms_per_step_median``
    (CPU ms per step of a rank's process, all its threads, mean over ranks: work done,
    steadier than wall time on a shared CPU), ``peak_mem_bytes`` (CUDA: the largest
    ``torch.cuda.max_memory_allocated`` of a timed block over ranks; None on the CPU,
    where no allocator separates runners sharing a process), ``first_loss``,
    ``first_step_s`` (wall s of the first step, slowest rank), ``compile_s`` (compiled
    runners: first step less one median step, in s; else None), ``param_bytes_per_rank``,
    ``collectives_per_step``, ``mode``, ``idle`` (:func:`_idle`: each rank's idle time).
    """
    import torch

    args, names = job.args, list(built)
    first, first_s = {}, {}
    for name in names:
        b = built[name]
        for i in range(max(args.warmup, 1)):
            ranks.barrier()
            t0 = time.perf_counter()
            loss = b.step(b.batch)
            if i == 0:
                job.sync()
                first_s[name] = ranks.reduce(time.perf_counter() - t0, "max")
                # (mean: an nn.Graph packs one loss per micro-batch, as OneFlow's does)
                if b.loss_rank is not None:  # only that rank has it
                    value = float(loss.float().mean().item()) if job.rank == b.loss_rank \
                        else 0.0
                    first[name] = ranks.reduce(value, "sum")
                else:
                    value = float(loss.float().mean().item())
                    first[name] = value if b.loss_is_global else ranks.reduce(value, "mean")
        job.sync()
    colls = {}
    for name in names:
        colls[name] = built[name].collectives()
        job.sync()

    cuda = job.device == "cuda"
    times: dict[str, list[float]] = {n: [] for n in names}
    cpu: dict[str, list[float]] = {n: [] for n in names}
    peak: dict[str, int] = {n: 0 for n in names}
    own_wall = {n: 0.0 for n in names}  # this rank's wall and main-thread CPU, all blocks
    busy = {n: 0.0 for n in names}
    for rep in range(args.repeats):
        for name in (names if rep % 2 == 0 else names[::-1]):
            b = built[name]
            if cuda:
                torch.cuda.reset_peak_memory_stats(job.dev)
            ranks.barrier()
            t0, c0, b0 = time.perf_counter(), time.process_time(), time.thread_time()
            for _ in range(args.steps):
                b.step(b.batch)
            job.sync()
            t1, c1, b1 = time.perf_counter(), time.process_time(), time.thread_time()
            own_wall[name] += t1 - t0
            busy[name] += b1 - b0
            times[name].append(ranks.reduce(t1 - t0, "max"))
            cpu[name].append(ranks.reduce(c1 - c0, "mean"))
            if cuda:
                peak[name] = max(peak[name], int(ranks.reduce(
                    torch.cuda.max_memory_allocated(job.dev), "max")))

    sides = {}
    for name in names:
        b = built[name]
        step_s = statistics.median(times[name]) / args.steps
        sps = [job.global_batch * args.steps / t for t in times[name]]
        sides[name] = {
            "samples_per_s": statistics.median(sps), "repeats_samples_per_s": sps,
            "step_ms_median": 1000 * step_s,
            "repeats_step_ms": [1000 * t / args.steps for t in times[name]],
            "cpu_ms_per_step_median": 1000 * statistics.median(cpu[name]) / args.steps,
            "peak_mem_bytes": peak[name] if cuda else None,
            "first_loss": first[name], "first_step_s": first_s[name],
            "compile_s": max(first_s[name] - step_s, 0.0) if b.compiled else None,
            "param_bytes_per_rank": b.param_bytes() if callable(b.param_bytes) else
            b.param_bytes, "collectives_per_step": colls[name],
            "mode": b.mode,
            "idle": _idle(ranks.gather(own_wall[name]), ranks.gather(busy[name]),
                          args.steps * args.repeats)}
    return sides


def _idle(wall: list[float], busy: list[float], steps: int) -> dict:
    """Each rank's idle time over the timed steps (the measured pipeline bubble, the same
    method for every runner): ``busy`` = the rank's main-thread CPU time
    (``time.thread_time()``), ``idle`` = its wall time less that, both summed over the
    timed blocks (a block's wall time: from the barrier that starts it to this rank's
    end of its last step).

    Why it measures the bubble: with one torch thread per rank the compute of a step (its
    forward, backward and update kernels, and the Python that issues them) runs in the
    main thread, and a rank that waits for another stage waits in a blocking receive (or
    a collective's ``wait``), which uses no CPU; so idle = the time the rank had nothing
    to compute. Its limits: (1) the work of gloo's own threads (copying and sending the
    transfers, reducing the collectives) is not in the main thread's CPU time: it counts
    as idle, as the transfer time does; (2) on an oversubscribed machine (more busy
    threads than cores: other jobs, gloo's threads, several ranks on few cores) a main
    thread that is ready to run but has no core is counted idle, so the figures are an
    upper bound of the schedule's bubble there; (3) a spin-wait (none in gloo's CPU
    receive) would count as busy; (4) with ``--threads-per-rank`` > 1 the intra-op
    threads' work is not counted (idle is overstated); (5) on CUDA the kernels run
    asynchronously and a synchronising wait may spin: the figure means little there.

    Returns ``{"idle_over_busy": [per rank], "idle_over_busy_max", "idle_over_wall":
    [per rank], "idle_over_wall_max", "busy_ms_per_step": [per rank], "wall_ms_per_step":
    [per rank]}``; ``idle_over_busy`` compares with the theory's bubble ``(p - 1) / m``
    (idle over compute time), ``idle_over_wall`` with ``b / (1 + b)``."""
    idle = [max(w - b, 0.0) for w, b in zip(wall, busy)]
    over_busy = [i / b if b > 0 else float("inf") for i, b in zip(idle, busy)]
    over_wall = [i / w if w > 0 else 0.0 for i, w in zip(idle, wall)]
    return {"idle_over_busy": over_busy, "idle_over_busy_max": max(over_busy),
            "idle_over_wall": over_wall, "idle_over_wall_max": max(over_wall),
            "busy_ms_per_step": [1000 * b / steps for b in busy],
            "wall_ms_per_step": [1000 * w / steps for w in wall]}


# ---------------------------------------------------------------------------- runners
def _train_step(job: Job, model, opt, functional, scaler, context=contextlib.nullcontext):
    """``step(batch) -> loss``: one eager training step (zero grad, forward under
    ``context()`` and the job's autocast, backward, update; through ``scaler`` when given)
    with ``functional`` (``torch.nn.functional`` or sbpflow's)."""
    task = job.spec.task

    def step(batch):
        opt.zero_grad()
        with context(), job.autocast():
            loss = _loss(functional, task, model, *batch)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()
        return loss

    return step


def _torch_step(job: Job, model, opt):
    """``step(batch) -> loss`` of a plain-torch training step (GradScaler under fp16)."""
    import torch

    scaler = torch.amp.GradScaler(job.device) if job.cfg.amp == "fp16" else None
    return _train_step(job, model, opt, torch.nn.functional, scaler)


def _torch_twin(job: Job):
    """The spec's plain-torch twin on ``job.dev``, seeded as sbpflow's model is."""
    import torch

    torch.manual_seed(job.args.seed)
    model = job.spec.build_torch().to(job.dev)
    if job.cfg.channels_last:
        model = model.to(memory_format=torch.channels_last)
    return model.train()


def _torch_group(job: Job):
    """A process group of all ranks for one torch runner (NCCL on CUDA, gloo on the CPU):
    its own, so that no runner's traffic or sequence numbers touch another's."""
    import torch.distributed as dist

    return dist.new_group(backend="nccl" if job.device == "cuda" else "gloo")


def _compile(job: Job, module):
    import torch

    return torch.compile(module, backend=job.args.compile_backend)


def _sbpflow_setup(job: Job):
    """sbpflow's model, placement, batch, parameters, optimizer and loss scaler for
    ``job`` (shared by the eager and the graph runners)."""
    import torch

    import sbpflow
    from sbpflow.nn.parallel import parallelize_module

    tp = job.tp
    pl, data_sbp = layout_placement(job.device, job.dp, tp)
    sbpflow.manual_seed(job.args.seed)
    model = job.spec.build()
    per_rank_batch_norm(model)
    if job.device == "cuda":
        model.to(job.dev)
    if job.cfg.channels_last:
        model._apply_to_tensors(
            lambda t: t.contiguous(memory_format=torch.channels_last) if t.dim() == 4 else t)
    layout = "dp" if tp == 1 else "tp"
    parallelize_module(model, pl, job.spec.plan(layout), tp_axis=-1)
    model.train()
    batch = tuple(sbpflow.from_torch(t).to_global(pl, data_sbp) for t in job.coord_batch)
    params = list(model.parameters())
    opt = job.make_optimizer(sbpflow.optim, params)
    scaler = sbpflow.amp.GradScaler(job.device) if job.cfg.amp == "fp16" else None
    nbytes = sum(p._local.numel() * p._local.element_size()
                 for p in {id(p): p for p in params}.values())
    mode = f"{layout} plan on mesh {list(pl.shape)}"
    return model, pl, batch, opt, scaler, nbytes, mode


def _build_sbpflow(job: Job) -> Built:
    """sbpflow eager: ``spec.build()`` laid out by ``spec.plan(layout)`` on a mesh of
    ``dp x tp`` ranks (1-D when one is 1); the batch ``S(0)`` over data parallel, ``B`` over
    tensor parallel; BatchNorm with per-rank statistics (as DDP without SyncBatchNorm)."""
    import sbpflow

    model, pl, batch, opt, scaler, nbytes, mode = _sbpflow_setup(job)
    step = _train_step(job, model, opt, sbpflow.nn.functional, scaler,
                       lambda: sbpflow.default_placement(pl))

    def collectives():
        with sbpflow.distributed.CommRecorder() as rec:
            step(batch)
        return _collectives_summary((r.kind, r.bytes) for r in rec.records)

    return Built(step, batch, nbytes, f"global tensors, {mode}", collectives,
                 loss_is_global=True)


def _graph(job: Job, *, compiled: bool) -> Built:
    """sbpflow ``nn.Graph``: the eager runner's step (same model, layout, batch, optimizer)
    compiled at the first step into each rank's torch.fx program and replayed;
    ``compiled``: that program handed to ``torch.compile`` (the report's ``compile_s``
    is the first step's extra time: tracing, and compiling; with ``compiled`` the first
    step runs the graph twice, since the compile happens at the first replay, so its
    ``compile_s`` also holds one step)."""
    model, pl, batch, opt, scaler, nbytes, mode = _sbpflow_setup(job)
    graph = _train_graph(job, model, opt, pl, scaler, compiled=compiled)

    def step(b):
        if compiled and not graph._programs:
            first = graph(*b)  # traced; the next call compiles: both in the first step's time
            graph(*b)
            return first  # the first step's loss, as the other runners report
        return graph(*b)

    def collectives():
        # the program's collectives run as functional collectives, unrecorded: report the
        # ones recorded when it was traced (one step's)
        if not graph._programs:
            step(batch)
        return _program_collectives(graph)

    return Built(step, batch, nbytes, f"nn.Graph{' + torch.compile' if compiled else ''}, "
                 f"{mode}", collectives, loss_is_global=True, compiled=True, graph=graph)


def _train_graph(job: Job, model, opt, pl, scaler=None, *, compiled: bool = False):
    """The ``nn.Graph`` of one training step of ``model`` (forward under ``pl`` as the
    default placement and the job's autocast, backward, ``opt``'s update), the AMP and
    loss-scaler settings of the job; ``compiled``: ``torch.compile`` of its program."""
    import torch

    import sbpflow

    task = job.spec.task

    class Step(sbpflow.nn.Graph):
        def __init__(self):
            super().__init__()
            self.model = model
            self.add_optimizer(opt)
            if job.cfg.amp != "none":
                self.config.enable_amp(True, dtype=torch.bfloat16 if job.cfg.amp == "bf16"
                                       else torch.float16)
            if scaler is not None:
                self.set_grad_scaler(scaler)
            self.config.enable_compile(compiled)

        def build(self, *b):
            with sbpflow.default_placement(pl), job.autocast():
                loss = _loss(sbpflow.nn.functional, task, model, *b)
            loss.backward()
            return loss

    return Step()


def _program_collectives(graph) -> dict:
    """The collectives of a graph's program (recorded when it was traced: one step's)."""
    import sbpflow

    events = next(iter(graph._programs.values())).events
    recs = [e for e in events if isinstance(e, sbpflow.distributed.CommRecord)
            and e.kind != "check"]
    return _collectives_summary((r.kind, r.bytes) for r in recs)




def _build_sbpflow_unchecked(job: Job) -> Built:
    """sbpflow eager with the collective agreement check off (``--check-overhead``)."""
    import sbpflow

    b = _build_sbpflow(job)

    def step(batch):
        mode = sbpflow.distributed.check_mode()
        sbpflow.distributed.set_check("off")
        try:
            return b.step(batch)
        finally:
            sbpflow.distributed.set_check(mode)

    return Built(step, b.batch, b.param_bytes, b.mode + ", check off", b.collectives,
                 loss_is_global=True)


def _ddp(job: Job, *, compiled: bool) -> Built:
    """The torch twin under ``DistributedDataParallel`` (defaults: 25 MiB buckets,
    ``broadcast_buffers=True``) on its own group, each rank its ``rank_batch``; on one rank
    the plain module. ``compiled``: ``torch.compile`` of the DDP module (DDPOptimizer splits
    the graph at bucket boundaries so the all-reduces still overlap backward)."""
    import torch

    model = _torch_twin(job)
    ddp = None
    if job.world > 1:
        ddp = torch.nn.parallel.DistributedDataParallel(
            model, process_group=_torch_group(job),
            device_ids=[job.dev.index] if job.device == "cuda" else None)
    run = ddp if ddp is not None else model
    opt = job.make_optimizer(torch.optim, run.parameters())
    if compiled:
        run = _compile(job, run)
    step = _torch_step(job, run, opt)
    batch = job.rank_batch
    mode = "DistributedDataParallel (defaults)" if ddp is not None else \
        "plain module, one process"
    if compiled:
        mode = f"torch.compile(backend={job.args.compile_backend!r}) of the " + mode
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return Built(step, batch, nbytes, mode, lambda: _torch_collectives(
        lambda: step(batch), ddp), compiled=compiled)




def _tp_supported(spec, dp: int, tp: int, world: int) -> str | None:
    if tp == 1:
        return "it is tensor parallelism: it needs --tp > 1"
    if dp > 1:
        return (f"a 2-D mesh (--dp {dp} --tp {tp}) would need DDP or FSDP over DTensor "
                f"parameters; this runner is 1-D tensor parallel only")
    if "tp" not in getattr(spec, "plans", {}):
        return f"{spec.name} has no tensor-parallel plan"
    return None


def _torch_tp_plan(spec, model, tp: int) -> tuple[dict, list[str]]:
    """The model's sbpflow ``"tp"`` plan in torch's terms, per module name (``fnmatch``, the
    first matching pattern wins, as ``sbpflow.nn.parallel.parallelize_module``):
    ``ColwiseParallel`` -> torch's ``ColwiseParallel``, ``RowwiseParallel`` -> torch's
    ``RowwiseParallel``; any other style (``VocabParallel``) is left replicated and named in
    the second value. Sets ``n_head`` to ``n_head // tp`` on each module with an ``n_head``
    whose child is column-parallel (torch's styles hand back local shards).

    Raises:
        ValueError: a module's ``n_head`` not divisible by ``tp``.
    """
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from sbpflow.nn.parallel import ColwiseParallel as SColwise
    from sbpflow.nn.parallel import RowwiseParallel as SRowwise

    patterns = list(spec.plan("tp").items())
    plan, replicated = {}, []
    for name, _ in model.named_modules():
        style = next((s for p, s in patterns if name and fnmatch.fnmatchcase(name, p)), None)
        if isinstance(style, SColwise):
            plan[name] = ColwiseParallel()
        elif isinstance(style, SRowwise):
            plan[name] = RowwiseParallel()
        elif style is not None:
            replicated.append(name)
    for name, mod in model.named_modules():
        heads = getattr(mod, "n_head", None)
        cols = [n for n in plan if n.rsplit(".", 1)[0] == name
                and isinstance(plan[n], ColwiseParallel)]
        if isinstance(heads, int) and cols:
            if heads % tp:
                raise ValueError(f"{spec.name}: {name}.n_head = {heads} heads are not "
                                 f"divisible by --tp {tp}")
            mod.n_head = heads // tp
    return plan, replicated


def _tp(job: Job, *, compiled: bool) -> Built:
    """The torch twin under torch's own tensor parallelism: DTensor
    ``parallelize_module`` with the model's plan in torch's styles (:func:`_torch_tp_plan`:
    attention q/k/v ``ColwiseParallel``, its projection ``RowwiseParallel``, MLP first layer
    colwise, second rowwise; ``n_head / tp`` heads per rank) on a 1-D ``DeviceMesh`` over
    its own group; every rank processes the ``coord_batch`` (the whole batch, like sbpflow's
    ``B`` input). Parameters outside the plan stay replicated plain tensors; their gradients
    agree across ranks because each column-parallel input all-reduces its gradient.
    ``compiled``: ``torch.compile`` of the parallelized module."""
    import torch
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import parallelize_module

    model = _torch_twin(job)
    plan, replicated = _torch_tp_plan(job.spec, model, job.tp)
    mesh = DeviceMesh.from_group(_torch_group(job), job.device)
    parallelize_module(model, mesh, plan)
    opt = job.make_optimizer(torch.optim, model.parameters())
    run = _compile(job, model) if compiled else model
    step = _torch_step(job, run, opt)
    batch = job.coord_batch
    mode = (f"DTensor parallelize_module, {len(plan)} Linear layers on a 1-D mesh of "
            f"{job.tp}" + (f"; replicated: {', '.join(replicated)}" if replicated else ""))
    if compiled:
        mode = f"torch.compile(backend={job.args.compile_backend!r}) of " + mode
    nbytes = 0
    for p in {id(p): p for p in model.parameters()}.values():
        local = p.to_local() if hasattr(p, "to_local") else p
        nbytes += local.numel() * local.element_size()
    return Built(step, batch, nbytes, mode, lambda: _torch_collectives(
        lambda: step(batch), None), compiled=compiled)




# ---------------------------------------------------------------------------- pipelines
def _pp_split(spec, model, stages: int) -> list[list]:
    """Each stage's modules of ``model``: the model's registered split
    (:meth:`ModelSpec.pipeline_stages`, GPT's: embeddings and the first blocks on stage
    0, ``ln_f`` and ``lm_head`` last), as modules."""
    return [[model.get_submodule(name) for name in names]
            for names in spec.pipeline_stages(stages)]


def _pp_blocks(spec, stages: int) -> list[list[int]]:
    """The GPT block indices of each stage in the registered split."""
    return [[int(n.rsplit(".", 1)[1]) for n in names if n.startswith("transformer.h.")]
            for names in spec.pipeline_stages(stages)]


def _pp_split_text(spec, stages: int) -> str:
    """The registered split in words: ``"embeddings + blocks 0-1 | blocks 2-3 + ln_f,
    lm_head"``."""
    parts = []
    for names, blocks in zip(spec.pipeline_stages(stages), _pp_blocks(spec, stages)):
        text = f"block {blocks[0]}" if len(blocks) == 1 else f"blocks {blocks[0]}-{blocks[-1]}"
        if "transformer.wte" in names:
            text = "embeddings + " + text
        tail = [n.rsplit(".", 1)[-1] for n in names if n in ("transformer.ln_f", "lm_head")]
        if tail:
            text += " + " + ", ".join(tail)
        parts.append(text)
    return " | ".join(parts)


def _stage_param_bytes(modules) -> int:
    """Bytes of the parameters of one stage's modules (each once; a weight tied across
    stages counts on both: each of them holds a copy during the step)."""
    params = {id(p): p for m in modules for p in m.parameters()}.values()
    return sum(p.numel() * p.dtype.itemsize for p in params)


def _sbpflow_pipeline(job: Job, schedule: str):
    """sbpflow's pipeline for ``job``: ``(graph, batch, this rank's stage modules)``.

    ``spec.build()`` (seeded), laid out ``B`` on stage 0's placement, then each stage's
    modules (:func:`_pp_split`) put in their stage with
    ``module.to(GraphModule).set_stage(s, placement of rank s)``; the tied ``wte`` /
    ``lm_head`` weight is sbpflow's to handle (it lives on stage 0 and is boxed to the last
    stage when ``lm_head`` runs, its gradient sent back and summed). The training graph
    (:func:`_train_graph`) runs ``job.micro_batches`` micro-batches per call in
    ``schedule``. The batch: ``job.coord_batch`` (the global batch), inputs ``B`` on stage
    0's placement, targets ``B`` on the last stage's."""
    import sbpflow
    from sbpflow.graph import GraphModule
    from sbpflow.sbp import broadcast

    pls = [sbpflow.placement(job.device, [s]) for s in range(job.pp)]
    sbpflow.manual_seed(job.args.seed)
    model = job.spec.build()
    model.to_global(pls[0], broadcast)
    split = _pp_split(job.spec, model, job.pp)
    for s, mods in enumerate(split):
        for mod in mods:
            mod.to(GraphModule).set_stage(s, pls[s])
    model.train()
    opt = job.make_optimizer(sbpflow.optim, model.parameters())
    graph = _train_graph(job, model, opt, pls[0])
    graph.config.set_gradient_accumulation_steps(job.micro_batches)
    graph.config.set_pipeline_schedule(schedule)
    x, y = job.coord_batch
    batch = (sbpflow.tensor(x, placement=pls[0], sbp=broadcast),
             sbpflow.tensor(y, placement=pls[-1], sbp=broadcast))
    return graph, batch, split[job.rank]


def _pipeline(job: Job, schedule: str | None = None) -> Built:
    """sbpflow pipeline parallelism (``--pp``): :func:`_sbpflow_pipeline` with ``schedule``
    (default ``--schedule``), one ``nn.Graph`` call per step (traced at the first: its
    extra time is the report's ``compile_s``)."""
    schedule = schedule or job.schedule
    graph, batch, mine = _sbpflow_pipeline(job, schedule)

    def step(b):
        return graph(*b)

    def collectives():
        if not graph._programs:
            step(batch)
        return _program_collectives(graph)

    mode = (f"nn.Graph, set_stage: {_pp_split_text(job.spec, job.pp)}; "
            f"{job.micro_batches} micro-batches, {schedule}")
    return Built(step, batch, _stage_param_bytes(mine), mode, collectives,
                 loss_is_global=True, compiled=True, graph=graph, schedule=schedule)


def _pipeline_activation_peaks(job: Job, ranks: _Ranks, timed: dict) -> dict:
    """Peak activation memory per stage of sbpflow's pipeline under each schedule:
    ``{"1f1b": [bytes of stage 0, 1, ...], "gpipe": [...], "zero_bubble": [...]}``, from
    ``sbpflow.graph.show.peak_live_bytes`` of each rank's compiled program (the largest
    sum of live intermediate values along the program in its planned order; parameters,
    optimizer state and inputs not counted): a deterministic estimate, not a measurement
    of the allocator. ``timed``: schedule -> the timed runners' graphs, whose programs
    give those schedules' figures (``zero_bubble`` only when one was timed); a graph of
    1F1B or GPipe that was not timed is built and called once (its traced step)."""
    from sbpflow.graph.show import peak_live_bytes

    out = {}
    for schedule in ("1f1b", "gpipe", *(s for s in timed if s not in ("1f1b", "gpipe"))):
        graph = timed.get(schedule)
        if graph is None:
            graph, batch, _ = _sbpflow_pipeline(job, schedule)
            graph(*batch)
        gm = next(iter(graph._programs.values())).gm
        out[schedule] = [int(v) for v in ranks.gather(float(peak_live_bytes(gm)))]
    return out


def _torch_gpt_stage(spec, model, stage: int, stages: int):
    """Stage ``stage`` of a torch GPT as a ``torch.nn.Module`` for ``PipelineStage``: the
    model's forward cut at the stage's boundaries (:func:`_pp_split`): the first stage
    maps token ids to the embedding sum, every stage runs its blocks, the last returns
    ``lm_head(ln_f(x))``, the logits (the loss is the schedule's ``loss_fn``)."""
    import torch

    t = model.transformer
    mine = set(_pp_blocks(spec, stages)[stage])

    class GPTStage(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.first, self.last = stage == 0, stage == stages - 1
            if self.first:
                self.wte, self.wpe, self.drop = t.wte, t.wpe, t.drop
            self.h = torch.nn.ModuleList(
                b for i, b in enumerate(t.h) if i in mine)
            if self.last:
                self.ln_f, self.lm_head = t.ln_f, model.lm_head

        def forward(self, x):
            if self.first:
                pos = torch.arange(x.size(1), dtype=torch.long, device=x.device)
                x = self.drop(self.wte(x) + self.wpe(pos))
            for block in self.h:
                x = block(x)
            if self.last:
                x = self.lm_head(self.ln_f(x))
            return x

    return GPTStage()


def _torch_pipelining(job: Job, schedule: str | None = None) -> Built:
    """PyTorch's own pipeline parallelism on the same split, micro-batches, schedule and
    data as ``sbpflow-pipeline``: the torch twin (``spec.build_torch()``, same seed) cut
    into this rank's stage (:func:`_torch_gpt_stage`), wrapped in
    ``torch.distributed.pipelining.PipelineStage`` (its own gloo/NCCL group) and driven by
    ``Schedule1F1B``, ``ScheduleGPipe`` or, for ``"zero_bubble"``,
    ``ScheduleInterleavedZeroBubble`` over the rank's one stage (torch's ZB1P, whose
    order with one stage per rank is ZB-H1's, sbpflow's ``zero_bubble``: the backward
    split into input (``I``) and weight (``W``) gradients) per ``schedule`` (default
    ``--schedule``), with ``--micro-batches`` micro-batches and the cross entropy as
    ``loss_fn`` (the schedule scales the gradients by ``1/m``: the mean over
    micro-batches, as sbpflow's accumulation). The first stage
    feeds the inputs, the last the targets; every rank then steps its own optimizer over
    its stage's parameters.

    The tied weight (GPT's ``wte.weight is lm_head.weight``), which torch's pipelining
    cannot share across stages: untied as Megatron-LM does, i.e. the last stage's
    ``lm_head.weight`` made a separate parameter with the same initial value, and after
    each step's backward the two copies' gradients all-reduced (summed) between the first
    and the last stage (a group of those two ranks), so that both get the gradient of the
    tied weight, take the same update and stay equal. That all-reduce is in the timed
    step."""
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleavedZeroBubble,
    )

    schedule_name = schedule or job.schedule
    p, s = job.pp, job.rank
    model = _torch_twin(job)
    tied = model.lm_head.weight is model.transformer.wte.weight
    if tied:
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    group = _torch_group(job)
    tie_group = dist.new_group([0, p - 1], backend="nccl" if job.device == "cuda"
                               else "gloo") if tied else None
    mod = _torch_gpt_stage(job.spec, model, s, p)
    stage = PipelineStage(mod, s, p, job.dev, group=group)

    def loss_fn(logits, targets):
        return torch.nn.functional.cross_entropy(logits.view(-1, logits.size(-1)),
                                                 targets.view(-1), ignore_index=-1)

    kind = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe,
            "zero_bubble": ScheduleInterleavedZeroBubble}[schedule_name]
    schedule = kind([stage] if schedule_name == "zero_bubble" else stage, job.micro_batches,
                    loss_fn=loss_fn)
    opt = job.make_optimizer(torch.optim, mod.parameters())
    tied_weight = None
    if tied and s == 0:
        tied_weight = model.transformer.wte.weight
    elif tied and s == p - 1:
        tied_weight = model.lm_head.weight
    none = torch.zeros(())

    def step(batch):
        x, y = batch
        opt.zero_grad()
        losses: list = []
        with job.autocast():
            if s == 0:
                schedule.step(x)
            elif s == p - 1:
                schedule.step(target=y, losses=losses)
            else:
                schedule.step()
        if tied_weight is not None:
            dist.all_reduce(tied_weight.grad, group=tie_group)
        opt.step()
        return torch.stack(losses).float().mean() if losses else none

    batch = job.coord_batch
    mode = (f"torch.distributed.pipelining PipelineStage + {kind.__name__}, "
            f"{_pp_split_text(job.spec, p)}; {job.micro_batches} "
            f"micro-batches" + ("; wte/lm_head untied, their gradients all-reduced (sum) "
                                f"between stages 0 and {p - 1}" if tied else ""))
    return Built(step, batch, _stage_param_bytes([mod]), mode,
                 lambda: _torch_collectives(lambda: step(batch), None), loss_rank=p - 1,
                 schedule=schedule_name)


def _pp_supported(spec, dp: int, tp: int, world: int) -> str | None:
    return "it is pipeline parallelism: run with --pp P (one stage per rank)"


register_runner(Runner("sbpflow", "sbpflow", "sbpflow", _build_sbpflow, groups=()))
register_runner(Runner("sbpflow-graph", "sbpflow nn.Graph", "sbpflow",
                       partial(_graph, compiled=False), groups=()))
register_runner(Runner("sbpflow-graph-compiled", "sbpflow nn.Graph + compile", "sbpflow",
                       partial(_graph, compiled=True), groups=()))
register_runner(Runner("sbpflow-unchecked", "sbpflow (check off)", "sbpflow",
                       _build_sbpflow_unchecked, groups=()))
register_runner(Runner("sbpflow-pipeline", "sbpflow pipeline", "sbpflow", _pipeline,
                       supports=_pp_supported, groups=()))
register_runner(Runner("torch-pipelining", "PyTorch pipelining", "torch", _torch_pipelining,
                       supports=_pp_supported, baseline_for=("pp",), groups=()))
register_runner(Runner("sbpflow-pipeline-zb", "sbpflow pipeline ZB-H1", "sbpflow",
                       partial(_pipeline, schedule="zero_bubble"), supports=_pp_supported,
                       groups=()))
register_runner(Runner("torch-pipelining-zb", "PyTorch pipelining ZB", "torch",
                       partial(_torch_pipelining, schedule="zero_bubble"),
                       supports=_pp_supported, groups=()))
register_runner(Runner("torch-ddp", "PyTorch DDP", "torch", partial(_ddp, compiled=False),
                       baseline_for=("dp", "dp_tp"), groups=("eager", "all")))
register_runner(Runner("torch-ddp-compiled", "PyTorch DDP + compile", "torch",
                       partial(_ddp, compiled=True), groups=("compiled", "all")))
register_runner(Runner("torch-tp", "PyTorch TP", "torch", partial(_tp, compiled=False),
                       supports=_tp_supported, baseline_for=("tp",), groups=("eager", "all")))
register_runner(Runner("torch-tp-compiled", "PyTorch TP + compile", "torch",
                       partial(_tp, compiled=True), supports=_tp_supported,
                       groups=("compiled", "all")))


def _plan_global_batch(job):
    """Every rank's samples concatenated (torch tensors on the job's device): the one
    global batch of a step."""
    import torch

    from sbpflow.models.spec import synthetic_batch

    parts = [synthetic_batch(job.spec, job.cfg.batch, job.cfg.seq_len, r, job.args.seed,
                             job.cfg.image_size or 224) for r in range(job.world)]
    return tuple(torch.cat(ts).to(job.dev) for ts in zip(*parts))


def _plan_runner(job: Job, plan: str) -> Built:
    """A ``--plan`` runner (:mod:`sbpflow.apps.bench.plans`): the job's model trained as
    an nn.Graph under ``plan`` (``"auto"``, ``"file"``: ``--plan FILE``, or a hand plan
    of :data:`~sbpflow.apps.bench.plans.HAND_PLANS`) on the whole global batch."""
    import sbpflow
    from sbpflow.models.spec import layout_placement, per_rank_batch_norm
    from sbpflow.nn.parallel import parallelize_module
    from sbpflow.sbp import broadcast

    world = job.world
    if plan == "pp":
        return _plan_pipeline(job)
    sbpflow.manual_seed(job.args.seed)
    model = job.spec.build()
    per_rank_batch_norm(model)
    if job.device == "cuda":
        model.to(job.dev)
    if plan in ("auto", "file"):  # everything broadcast: all free; every rank in a row,
        # or a plan file's own mesh
        from sbpflow.planner.auto import plan_mesh

        rows, cols = plan_mesh(job.args.plan, world) if plan == "file" else (world, 1)
        pl = layout_placement(job.device, rows, cols)[0]
        data = (broadcast,) * pl.ndim
        model.to_global(pl, broadcast)
        mode = "auto-parallel" if plan == "auto" else f"plan {job.args.plan}"
    else:
        dp, tp = {"tp": (1, world), "dp_tp": (2, world // 2)}.get(plan, (world, 1))
        pl, data = layout_placement(job.device, dp, tp)
        parallelize_module(model, pl, job.spec.plan("dp" if tp == 1 else "tp"), tp_axis=-1)
        mode = f"{plan} on mesh {list(pl.shape)}"
    model.train()
    opt = job.make_optimizer(sbpflow.optim, model.parameters())
    scaler = sbpflow.amp.GradScaler(job.device) if job.cfg.amp == "fp16" else None
    graph = _train_graph(job, model, opt, pl, scaler)
    if plan.startswith("zero"):
        graph.config.enable_zero(True, stage=int(plan[-1]))
    if plan in ("auto", "file"):
        graph.config.enable_auto_parallel(True)
        if plan == "file":
            graph.config.set_auto_parallel_plan(job.args.plan)
        elif job.found_plan is not None:  # built again: the plan the search found
            graph.config.set_auto_parallel_plan(job.found_plan)
        else:
            if job.args.memory_per_rank is not None:
                graph.config.set_auto_parallel_memory_limit(job.args.memory_per_rank)
            if job.args.search_time is not None:
                graph.config.set_auto_parallel_search_time(job.args.search_time)
    batch = tuple(sbpflow.tensor(t, placement=pl, sbp=data) for t in _plan_global_batch(job))

    def param_bytes():
        ps = {id(p): p for p in model.parameters()}.values()
        return sum(p._local.numel() * p._local.element_size() for p in ps)

    def collectives():
        if not graph._programs:
            graph(*batch)
        return _program_collectives(graph)

    return Built(lambda b: graph(*b), batch, param_bytes, f"nn.Graph, {mode}", collectives,
                 loss_is_global=True, compiled=True, graph=graph)


def pp_micro_batches(samples: int, stages: int) -> int:
    """The micro-batches of the ``pp`` hand plan: ``2 x stages`` (a 1F1B bubble of
    ``(p-1)/(2p)``) when they divide the step's ``samples``, else ``stages``."""
    return 2 * stages if samples % (2 * stages) == 0 else stages


def _plan_pipeline(job: Job) -> Built:
    """The ``pp`` hand plan: the model's stages on every rank, one rank each, 1F1B over
    :func:`pp_micro_batches` micro-batches of the whole global batch (the ``--pp``
    runner's pipeline, :func:`_sbpflow_pipeline`). Its prediction
    (:func:`sbpflow.planner.pipeline.predict_pipeline`) prices the logical graph of one
    micro-batch run data parallel with the micro-batch's samples on each rank (the
    shapes a stage runs), op by op on the stage that runs it."""
    from dataclasses import replace

    world, samples = job.world, job.global_batch
    m = pp_micro_batches(samples, world)
    pp_job = replace(job, pp=world, micro_batches=m, schedule="1f1b",
                     coord_batch=_plan_global_batch(job))
    graph, batch, mine = _sbpflow_pipeline(pp_job, "1f1b")

    def predict(hw):
        from sbpflow.planner.auto import graph_optimizer, pricing_dtype, state_per_param
        from sbpflow.planner.pipeline import predict_pipeline

        one = replace(job, cfg=replace(job.cfg, batch=samples // m))  # a micro-batch a rank
        twin = _plan_runner(one, "dp")
        lg = twin.graph.lower(*twin.batch)
        p = predict_pipeline(lg, job.spec.pipeline_stages(world), m, 1, hw,
                             optimizer=graph_optimizer(twin.graph),
                             dtype=pricing_dtype(twin.graph.config, hw),
                             state_per_param=state_per_param(twin.graph), prefix="model.")
        return p, p["memory"]

    def collectives():
        if not graph._programs:
            graph(*batch)
        return _program_collectives(graph)

    return Built(lambda b: graph(*b), batch, _stage_param_bytes(mine),
                 f"nn.Graph, set_stage: {_pp_split_text(job.spec, world)}; {m} "
                 f"micro-batches, 1f1b", collectives, loss_is_global=True, compiled=True,
                 graph=graph, schedule="1f1b", predict=predict)


def _register_plans() -> None:
    from . import plans

    register_runner(Runner("plan-auto", "sbpflow auto-parallel", "sbpflow",
                           partial(_plan_runner, plan="auto"), groups=()))
    register_runner(Runner("plan-file", "sbpflow plan file", "sbpflow",
                           partial(_plan_runner, plan="file"), groups=()))
    for p in plans.HAND_PLANS:
        register_runner(Runner(f"plan-{p}", f"sbpflow {p} (hand)", "sbpflow",
                               partial(_plan_runner, plan=p),
                               supports=partial(plans.supports, p), groups=()))


_register_plans()


def select_runners(args, spec, dp: int, tp: int, world: int) -> list[str]:
    """The runner names of one run, in timing order: ``sbpflow``, the nn.Graph runner when
    ``--graph`` (``sbpflow-graph``; with ``--compile`` also ``sbpflow-graph-compiled``),
    ``sbpflow-unchecked`` when ``--check-overhead``, then the ``--peers``: names or groups
    (``eager``, ``compiled``, ``all``; a group keeps only the runners that support the
    layout). With ``--pp``: ``sbpflow-pipeline`` and ``torch-pipelining``, nothing else
    (``--compare-schedules``: also their zero-bubble twins ``sbpflow-pipeline-zb`` and
    ``torch-pipelining-zb``).

    Raises:
        NotImplementedError: ``--graph`` while no nn.Graph runner is registered.
        ValueError: an unknown name, a named peer that cannot run this layout (the reason),
            or no torch peer left to compare against.
    """
    if getattr(args, "plan", None) is not None:
        from . import plans

        return plans.runner_names(args, spec, world)
    if getattr(args, "pp", None):
        if getattr(args, "compare_schedules", False):
            return ["sbpflow-pipeline", "sbpflow-pipeline-zb", "torch-pipelining",
                    "torch-pipelining-zb"]
        return ["sbpflow-pipeline", "torch-pipelining"]
    names = ["sbpflow"]
    if args.graph:
        names += GRAPH_RUNNERS if args.compile else GRAPH_RUNNERS[:1]
        for n in names[1:]:
            get_runner(n)
    if args.check_overhead:
        names.append("sbpflow-unchecked")
    groups = {g for r in RUNNERS.values() for g in r.groups}
    for token in (t.strip() for t in args.peers.split(",") if t.strip()):
        if token in groups:
            picked = [r.name for r in RUNNERS.values() if token in r.groups
                      and r.supports(spec, dp, tp, world) is None]
        else:
            runner = get_runner(token)
            why = runner.supports(spec, dp, tp, world)
            if why is not None:
                raise ValueError(f"--peers {token}: cannot run {spec.name} with --dp {dp} "
                                 f"--tp {tp}: {why}")
            picked = [token]
        names += [n for n in picked if n not in names]
    if not any(RUNNERS[n].framework == "torch" for n in names):
        raise ValueError(f"--peers {args.peers}: no PyTorch peer left for --dp {dp} --tp "
                         f"{tp} (groups: {sorted(groups)}; runners: {sorted(RUNNERS)})")
    return names


def baseline_runner(names: list[str], layout: str) -> str:
    """The peer the headline ratio is taken against: the first selected runner whose
    ``baseline_for`` has ``layout`` (DDP for data parallel, torch TP for tensor parallel),
    else the first selected torch runner."""
    torch_names = [n for n in names if RUNNERS[n].framework == "torch"]
    return next((n for n in torch_names if layout in RUNNERS[n].baseline_for),
                torch_names[0])


def _measure(spec, cfg: _Config, args, world: int, rank: int, ranks: _Ranks,
             dp: int, tp: int, threads: int, names: list[str]) -> dict:
    """Build the runners ``names`` on this rank and time them (:func:`time_runners`); the
    result dict (meaningful on rank 0)."""
    import torch

    import sbpflow

    device = args.device
    local_rank = int(os.environ.get("LOCAL_RANK", "0") or 0)
    dev = torch.device("cuda", local_rank % max(torch.cuda.device_count(), 1)) \
        if device == "cuda" else torch.device("cpu")
    if device == "cuda":
        torch.cuda.set_device(dev)
        torch.backends.cudnn.benchmark = True
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    fmt = torch.channels_last if cfg.channels_last else torch.contiguous_format

    def to_dev(t):
        t = t.to(dev)
        return t.contiguous(memory_format=fmt) if t.dim() == 4 else t

    def batch_of(r):
        return synthetic_batch(spec, cfg.batch, cfg.seq_len, r, args.seed,
                               cfg.image_size or 224)

    # The same samples for every runner: rank r's batch; the DP coordinate's tp batches
    # (with --pp: every rank's, the pipeline's one global batch).
    pp = args.pp or 1
    coord = rank // tp
    group = range(world) if pp > 1 else range(coord * tp, coord * tp + tp)
    parts = [batch_of(r) for r in group]
    job = Job(spec=spec, cfg=cfg, args=args, world=world, rank=rank, dp=dp, tp=tp, dev=dev,
              optimizer=args.optimizer or ("sgd" if spec.task in ("image", "face") else "adamw"),
              rank_batch=tuple(to_dev(t) for t in batch_of(rank)),
              coord_batch=tuple(to_dev(torch.cat(ts)) for ts in zip(*parts)), pp=pp,
              micro_batches=_micro_batches(args) if pp > 1 else 1,
              schedule=args.schedule or "1f1b")
    from sbpflow.planner.here import _release_memory as release_memory

    from . import plans

    compare = getattr(args, "plan", None) is not None
    if args.one_at_a_time:
        # each built, timed and described, then freed; twice, the second pass in reverse
        # order, each runner's faster pass kept: the first runner a process times runs
        # slower (arcface-1e6 here: 0.82x for the first of two runners of one program)
        built, sides, facts = {}, {}, {}
        for order in (names, names[::-1]):
            for name in order:
                b = get_runner(name).build(job)
                side = time_runners(job, ranks, {name: b})[name]
                if name not in sides:
                    sides[name] = {**side, "passes_ms": [side["step_ms_median"]]}
                else:
                    passes = sides[name]["passes_ms"] + [side["step_ms_median"]]
                    if side["step_ms_median"] < sides[name]["step_ms_median"]:
                        # (the first pass's compile time: the search's, for the auto plan)
                        sides[name] = {**side, "first_step_s": sides[name]["first_step_s"],
                                       "compile_s": sides[name]["compile_s"]}
                    sides[name]["passes_ms"] = passes
                if compare and name.startswith("plan-") and name not in facts:
                    facts[name] = plans.runner_facts(job, name, b, side)
                if name == "plan-auto" and job.found_plan is None:
                    job.found_plan = b.graph.auto_parallel_plan.to_dict()
                del b
                release_memory()
        sides = {name: sides[name] for name in names}
    else:
        built = {name: get_runner(name).build(job) for name in names}
        sides = time_runners(job, ranks, built)
        facts = {name: plans.runner_facts(job, name, b, sides[name])
                 for name, b in built.items() if compare and name.startswith("plan-")}
    for name, side in sides.items():
        side["runner"] = name
        side["label"] = RUNNERS[name].label
    base = baseline_runner(names, job.layout)
    for side in sides.values():
        side["vs_baseline"] = side["samples_per_s"] / sides[base]["samples_per_s"]
    s_side = sides[names[0]]  # sbpflow's headline runner: sbpflow (sbpflow-pipeline)
    layout = {"name": job.layout, "dp": dp, "tp": tp,
              "mesh": [dp, tp] if dp > 1 and tp > 1 else [world]}
    if pp > 1:
        layout["pp"] = pp
    result = {
        "model": cfg.model, "task": spec.task, "device": device, "ranks": world,
        "layout": layout,
        "batch_size_per_rank": cfg.batch, "global_batch": job.global_batch,
        "seq_len": cfg.seq_len, "image_size": cfg.image_size, "amp": cfg.amp,
        "channels_last": cfg.channels_last,
        "optimizer": job.optimizer, "threads_per_rank": threads,
        "warmup": args.warmup, "steps": args.steps, "repeats": args.repeats,
        "synthetic_data": True,
        "environment": {"torch": torch.__version__, "python": sys.version.split()[0],
                        "sbpflow": os.path.dirname(os.path.abspath(sbpflow.__file__)),
                        "cpu_count": os.cpu_count(),
                        "gpu": torch.cuda.get_device_name(dev) if device == "cuda" else None},
        "runners": sides,
        "baseline": base,
        "sbpflow": s_side,
        "torch": sides[base],
        "ratio": s_side["samples_per_s"] / sides[base]["samples_per_s"],
        "ratios": {n: s_side["samples_per_s"] / sides[n]["samples_per_s"]
                   for n in names if RUNNERS[n].framework == "torch"},
    }
    if pp > 1:
        result["pipeline"] = _pipeline_result(job, ranks, sides, built)
    if compare:
        result["plans"] = plans.compare(job, facts, sides)
    result["one_at_a_time"] = bool(args.one_at_a_time)
    if args.check_overhead:
        u_side = sides["sbpflow-unchecked"]
        checked, unchecked = s_side["step_ms_median"], u_side["step_ms_median"]
        result["check_overhead"] = {
            "mode": sbpflow.distributed.check_mode(),
            "checked_step_ms": checked, "unchecked_step_ms": unchecked,
            "unchecked_repeats_step_ms": u_side["repeats_step_ms"],
            "checked_repeats_step_ms": s_side["repeats_step_ms"],
            "overhead": checked / unchecked - 1,
            "collectives_per_step": sum(e["count"] for e in
                                        s_side["collectives_per_step"].values())}
    return result


def bubble_prediction(schedule: str, stages: int, micro_batches: int) -> float:
    """The bubble of ``schedule`` on ``stages`` ranks (one stage each) and
    ``micro_batches``: the worst rank's idle time over its compute time when
    :func:`sbpflow.runtime.schedules.simulate` runs the plan with a forward, an input
    gradient and a weight gradient of one time unit each (a full backward two; transfers
    free): ``(p - 1) / m`` for 1F1B and GPipe, ``(p - 1) / (3 m)`` for zero-bubble
    (ZB-H1) when ``m >= p`` (Qi et al. 2024, Table 2)."""
    from sbpflow.runtime import schedules

    return schedules.simulate(schedules.build(schedule, stages, micro_batches)).bubble


def _pipeline_result(job: Job, ranks: _Ranks, sides: dict, built: dict) -> dict:
    """The ``pipeline`` object of a ``--pp`` result: the split, micro-batches, schedule,
    the theory's bubble (``simulate()`` of the schedule's plan with equal forward, input-
    and weight-gradient times, :func:`bubble_prediction`) next to each runner's measured
    idle time (:func:`_idle`), and sbpflow's peak activation memory per stage under
    1F1B and GPipe (and zero-bubble when timed) (:func:`_pipeline_activation_peaks`)."""
    p, m = job.pp, job.micro_batches
    theory = bubble_prediction(job.schedule, p, m)
    graphs = {b.schedule: b.graph for b in built.values() if b.graph is not None}
    peaks = _pipeline_activation_peaks(job, ranks, graphs)
    return {
        "stages": p, "micro_batches": m, "micro_batch_size": job.global_batch // m,
        "schedule": job.schedule,
        "schedules": {n: b.schedule for n, b in built.items()},
        "split": _pp_split_text(job.spec, p).split(" | "),
        "bubble_theory": theory, "bubble_theory_idle_over_wall": theory / (1 + theory),
        "bubble_simulated": {n: bubble_prediction(b.schedule, p, m)
                             for n, b in built.items()},
        "bubble_measured": {n: {"idle_over_busy_max": side["idle"]["idle_over_busy_max"],
                                "idle_over_busy": side["idle"]["idle_over_busy"],
                                "idle_over_wall_max": side["idle"]["idle_over_wall_max"],
                                "idle_over_wall": side["idle"]["idle_over_wall"]}
                            for n, side in sides.items()},
        "bubble_method": "per rank over the timed steps: busy = main-thread CPU time "
                         "(time.thread_time), idle = wall - busy; idle/busy vs "
                         "simulate()'s idle/compute of the runner's schedule ((p-1)/m for "
                         "1F1B and GPipe)",
        "peak_activation_bytes": peaks,
        "peak_activation_method": "sbpflow.graph.show.peak_live_bytes of each rank's "
                                  "compiled program (an estimate: live intermediate "
                                  "values along the planned order)",
    }


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
    """The 1-rank measurement in a fresh process (no torchrun environment): sbpflow and the
    plain torch model (``--peers``, ``--graph``, ``--compile`` dropped)."""
    base = _strip(argv, {"--nproc-per-node": True, "--dp": True, "--tp": True,
                         "--threads-per-rank": True, "--no-scaling": False, "--out": True,
                         "--child-result": True, "--peers": True, "--graph": False,
                         "--compile": False})
    env = {k: v for k, v in os.environ.items() if k not in _TORCHRUN_ENV}
    env["OMP_NUM_THREADS"] = str(threads)
    env["PYTHONPATH"] = os.pathsep.join(
        [_package_root()] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    with tempfile.TemporaryDirectory(prefix="sbpflow-bench-") as tmp:
        path = os.path.join(tmp, "result.json")
        cmd = [sys.executable, "-m", "sbpflow.apps.bench", *_child_argv(base, path, threads)]
        proc = subprocess.run(cmd, env=env)
        if proc.returncode != 0:
            raise RuntimeError(f"the 1-rank run failed (exit {proc.returncode}): "
                               f"{' '.join(cmd)}")
        with open(path, encoding="utf-8") as f:
            return json.load(f)


def _package_root() -> str:
    """The folder holding this ``sbpflow`` package (first on the ranks' ``PYTHONPATH``)."""
    import sbpflow

    return os.path.dirname(os.path.dirname(os.path.abspath(sbpflow.__file__)))


def _run_ranks(parser, args, argv: list[str]) -> int:
    """This process is a rank (or the only process): measure, and on rank 0 report."""
    import torch

    import sbpflow.distributed as sd
    from sbpflow.distributed.launch import REPORTED_EXIT
    from sbpflow.graph.show import _fmt_bytes
    from sbpflow.planner.auto import MemoryLimitError, PlanError
    from sbpflow.planner.hardware import ProfileError

    if args.threads_per_rank is not None:
        torch.set_num_threads(args.threads_per_rank)
    threads = torch.get_num_threads()
    for mod in args.imports:
        importlib.import_module(mod)
    configs = _configs(parser, args)
    from sbpflow import models

    sd.init()
    world, rank = sd.get_world_size(), sd.get_rank()
    ranks = _Ranks(world)
    results = []
    for cfg in configs:
        spec = models.get(cfg.model)
        dp, tp = _layout(parser, args, spec, world)
        names = _runner_names(parser, args, spec, dp, tp, world)
        try:
            results.append(_measure(spec, cfg, args, world, rank, ranks, dp, tp, threads,
                                    names))
        except ProfileError as e:  # every rank: they read the same file
            if rank == 0:
                print(f"{parser.prog}: error: {e}", file=sys.stderr, flush=True)
            return REPORTED_EXIT
        except PlanError as e:  # --plan FILE not fitting the model: every rank checks it
            if rank == 0:
                print(f"{parser.prog}: error: --plan {args.plan}: {e}", file=sys.stderr,
                      flush=True)
            return REPORTED_EXIT
        except MemoryLimitError as e:  # every rank: the search's ranks agree
            if rank == 0:
                cut = f" in its {e.cut:g} s of search" if e.cut else ""
                print(f"{parser.prog}: error: --memory-per-rank {args.memory_per_rank}: no "
                      f"auto-parallel layout of {cfg.model} found{cut} fits "
                      f"{_fmt_bytes(e.limit)} per rank; the smallest found needs "
                      f"{_fmt_bytes(e.least)}. Raise --memory-per-rank, use more ranks or a "
                      f"smaller --batch-size{', or give it more --search-time' if e.cut else ''}",
                      file=sys.stderr, flush=True)
            return REPORTED_EXIT
        if args.device == "cuda":
            torch.cuda.empty_cache()  # the models of this configuration are gone
    if args.child_result is not None:
        if rank == 0:
            with open(args.child_result, "w", encoding="utf-8") as f:
                json.dump(results, f)
        return 0
    if rank != 0:
        return 0
    if world > 1 and not args.no_scaling and not args.pp and args.plan is None:
        # (a plan's runners compare layouts on the same ranks: no 1-rank scaling run)
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
    ``method``, ``command``; ``runners``: {name: side} for every runner that ran, in timing
    order, each side (see :func:`time_runners`) ``samples_per_s`` (median),
    ``repeats_samples_per_s``, ``step_ms_median``, ``repeats_step_ms``,
    ``cpu_ms_per_step_median``, ``peak_mem_bytes``, ``first_loss``, ``first_step_s``,
    ``compile_s``, ``param_bytes_per_rank``, ``collectives_per_step`` ({kind: {count,
    bytes}}), ``mode``, ``idle`` (each rank's idle over busy and over wall time, see
    :func:`_idle`), plus ``runner``, ``label`` and ``vs_baseline`` (its samples/s over
    the baseline's); ``baseline`` (the peer of the layout: ``torch-ddp``, ``torch-tp`` or
    ``torch-pipelining``); ``sbpflow`` and ``torch``: the sides of ``sbpflow`` (with
    ``--pp``: ``sbpflow-pipeline``) and of the baseline; ``ratio`` (sbpflow / baseline
    samples/s); ``ratios`` ({torch runner: sbpflow / its samples/s}); with ``--pp``,
    ``layout.pp`` and ``pipeline`` (see :func:`_pipeline_result`: stages, micro-batches,
    schedule, split, ``bubble_theory``, ``bubble_measured`` per runner,
    ``peak_activation_bytes`` {"1f1b", "gpipe": [per stage]});
    ``check_overhead`` with ``--check-overhead``; and ``scaling`` (None, or {``sbpflow``,
    ``torch``: N-rank over 1-rank samples/s, the 1-rank figures of sbpflow and the plain
    torch model, ``ratio_1rank``}). Several configurations (``--device cuda``):
    ``{"method", "command", "runs": [object, ...]}``. Also ``OUT/bench.md`` and
    ``OUT/bench.png``.

    Raises:
        SystemExit: bad arguments (code 2, naming the value and the fix), e.g. ``--dp x
            --tp`` not equal to the ranks, an unknown model, ``--device cuda`` without CUDA,
            a ``--peers`` runner that cannot run the layout.
        NotImplementedError: ``--graph`` while no nn.Graph runner is registered.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    require_extra(prog)
    _check_args(parser, args)
    output_dir(parser, args, "bench-" + (args.model or "cuda-suite"), argv)
    nproc = args.nproc_per_node or 1
    from sbpflow import models

    if _under_torchrun() or nproc == 1:
        if not _under_torchrun():
            for mod in args.imports:
                importlib.import_module(mod)
            for cfg in _configs(parser, args):  # model and runner errors before any work
                spec = models.get(cfg.model)
                _runner_names(parser, args, spec, *_layout(parser, args, spec, 1), 1)
        return _run_ranks(parser, args, argv)
    # Check the model, layout and runners here, before launching N processes.
    for mod in args.imports:
        importlib.import_module(mod)
    for cfg in _configs(parser, args):
        spec = models.get(cfg.model)
        _runner_names(parser, args, spec, *_layout(parser, args, spec, nproc), nproc)
    return launch_ranks("sbpflow.apps.bench", argv, nproc, args.threads_per_rank)


#: The files a benchmark writes into its output folder.
BENCH_OUTPUTS = ("bench.json", "bench.md", "bench.png")


def add_out_arguments(p: argparse.ArgumentParser, files: str, default: str) -> None:
    """``--out DIR`` and ``--overwrite`` of a benchmark's command line."""
    p.add_argument("--out", default=None, metavar="DIR",
                   help=f"where {files} go (default {default}, or {default}-2, -3, ... "
                   f"when it already holds results)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the results an existing --out DIR holds")


def output_dir(parser: argparse.ArgumentParser, args, default: str, argv: list[str]
               ) -> str:
    """Choose the benchmark's output folder before any work, so that no run replaces
    another's results unasked, and pin it in ``argv`` (the ranks' command line).

    ``--out DIR`` holding results (any of :data:`BENCH_OUTPUTS`) is refused without
    ``--overwrite`` (exit 2, naming the files and the fixes), and ``--out`` naming
    anything but a folder always. Without ``--out`` the results go to ``out/DEFAULT``,
    or ``out/DEFAULT-2``, ``-3``, ... the first that holds none (set in ``args.out`` and
    appended to ``argv``). Returns the folder."""
    if args.out:
        if os.path.lexists(args.out) and not os.path.isdir(args.out):
            what = "a file" if os.path.isfile(args.out) else "a link, a pipe or a device"
            parser.error(f"--out {args.out} is {what}, not a folder; give a folder (it is "
                         f"made if missing)")
        held = [f for f in BENCH_OUTPUTS if os.path.exists(os.path.join(args.out, f))]
        if held and not args.overwrite:
            parser.error(f"--out {args.out} holds a benchmark's results ({', '.join(held)}); "
                         f"give another --out DIR, or --overwrite to replace them")
        return args.out
    base = out = os.path.join("out", default)
    n = 2
    while any(os.path.exists(os.path.join(out, f)) for f in BENCH_OUTPUTS):
        out, n = f"{base}-{n}", n + 1
    args.out = out
    argv += ["--out", out]
    return out


def launch_ranks(module: str, argv: list[str], nproc: int,
                 threads_per_rank: int | None = None) -> int:
    """Run ``python -m module *argv`` on ``nproc`` local ranks (sbpflow's launcher,
    standalone rendezvous) with this sbpflow first on their ``PYTHONPATH`` (restored
    after); returns the job's exit code."""
    from sbpflow.distributed import launch

    launch_argv = ["--standalone", "--nproc-per-node", str(nproc)]
    if threads_per_rank is not None:
        launch_argv += ["--threads-per-rank", str(threads_per_rank)]
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [_package_root()] + [p for p in (saved or "").split(os.pathsep) if p])
    try:
        return launch.main(launch_argv + ["-m", module, *argv], reported=True)
    finally:
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved


# ---------------------------------------------------------------------------- reporting
def _fmt(x: float) -> str:
    return f"{x:,.1f}" if x >= 10 else f"{x:.2f}"


def _label(r: dict, name: str) -> str:
    side = r["runners"][name]
    if name == "torch-ddp" and r["ranks"] == 1:
        return "PyTorch (1 process)"
    return side["label"] + (" (baseline)" if name == r["baseline"] else "")


def _row_layout(name: str, side: dict, layout: str) -> str:
    """The layout cell of runner ``name``'s row: a ``--plan`` runner's own (its mode:
    ``auto-parallel``, ``tp on mesh [2]``, ``pp (8 micro-batches, 1f1b)``), else the
    job's ``layout``."""
    if not name.startswith("plan-"):
        return layout
    mode = side.get("mode", "")
    if name == "plan-pp":
        m = re.search(r"(\d+) micro-batches", mode)
        return f"pp ({m.group(1)} micro-batches, 1f1b)" if m else "pp"
    return mode.removeprefix("nn.Graph, ") or name[len("plan-"):]


def _table(results: list[dict]) -> list[str]:
    rows = ["| model | ranks | layout (sbpflow) | batch/rank | runner | samples/s (median) "
            "| step ms | CPU ms/step | vs baseline | compile s | scaling (N/1 rank) |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        lay = r["layout"]
        layout = f"{lay['name']} (dp={lay['dp']}, tp={lay['tp']})"
        if r.get("pipeline"):
            pp = r["pipeline"]
            layout = f"pp (stages={pp['stages']}, m={pp['micro_batches']}, {pp['schedule']})"
        batch = f"{r['batch_size_per_rank']}" + (
            f" x {r['seq_len']} tok" if r["seq_len"] else
            f" x {r['image_size']}px" if r.get("image_size") else "")
        sc = r.get("scaling")
        for name, side in r["runners"].items():
            fw = "sbpflow" if name == "sbpflow" else "torch" if name == r["baseline"] else None
            scale = f"{sc[fw]:.2f}x" if sc and fw else "-"
            comp = f"{side['compile_s']:.1f}" if side.get("compile_s") is not None else "-"
            rows.append(f"| {r['model']} | {r['ranks']} | {_row_layout(name, side, layout)} | "
                        f"{batch} | "
                        f"{_label(r, name)} | {_fmt(side['samples_per_s'])} | "
                        f"{side['step_ms_median']:.1f} | {side['cpu_ms_per_step_median']:.1f} | "
                        f"{side['vs_baseline']:.2f}x | {comp} | {scale} |")
        if sc:
            rows.append(f"| {r['model']} | 1 | - | {batch} | sbpflow | "
                        f"{_fmt(sc['sbpflow_1rank_samples_per_s'])} | - | - | "
                        f"{sc['ratio_1rank']:.2f}x | - | - |")
            rows.append(f"| {r['model']} | 1 | - | {batch} | PyTorch (1 process) | "
                        f"{_fmt(sc['torch_1rank_samples_per_s'])} | - | - | 1.00x | - | - |")
    return rows


def _bytes(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def _colls(c: dict) -> str:
    if not c:
        return "none"
    return ", ".join(f"{k} x{v['count']}" + (f" ({_bytes(v['bytes'])})" if v["bytes"] else "")
                     for k, v in c.items())


def _details(r: dict) -> list[str]:
    """The bullets under the table for one result: the ratios, then per runner what ran."""
    ratios = ", ".join(f"{_label(r, n)} {x:.2f}x" for n, x in r["ratios"].items())
    lines = [f"- {r['model']}: sbpflow / each peer (samples/s, same run): {ratios}."]
    for name, side in r["runners"].items():
        mem = f"; peak memory {_bytes(side['peak_mem_bytes'])}" \
            if side.get("peak_mem_bytes") is not None else ""
        comp = (f"; compile {side['compile_s']:.1f} s (first step {side['first_step_s']:.1f} "
                f"s, not in the step times)") if side.get("compile_s") is not None else ""
        passes = ("; --one-at-a-time passes " + " / ".join(
            f"{x:.1f}" for x in side["passes_ms"]) + " ms (the faster kept)") \
            if side.get("passes_ms") else ""
        lines.append(f"- {r['model']} {_label(r, name)} ({side['mode']}): collectives per "
                     f"step and rank: {_colls(side['collectives_per_step'])}; parameters per "
                     f"rank {_bytes(side['param_bytes_per_rank'])}; CPU "
                     f"{side['cpu_ms_per_step_median']:.1f} ms per step and rank; first-step "
                     f"loss {side['first_loss']:.4f}{mem}{comp}{passes}.")
    pp = r.get("pipeline")
    if pp:
        lines.append(f"- {r['model']} pipeline: {pp['stages']} stages "
                     f"({' | '.join(pp['split'])}), {pp['micro_batches']} micro-batches of "
                     f"{pp['micro_batch_size']} samples, {pp['schedule']}.")
        schedules = pp.get("schedules", {})
        for name, b in pp["bubble_measured"].items():
            per = ", ".join(f"{x:.3f}" for x in b["idle_over_busy"])
            sch = schedules.get(name, pp["schedule"])
            theory = pp.get("bubble_simulated", {}).get(name, pp["bubble_theory"])
            formula = "(p-1)/m" if sch in ("1f1b", "gpipe") else f"{sch}, simulate()"
            lines.append(f"- {r['model']} {_label(r, name)} bubble (idle / busy per rank, "
                         f"main-thread CPU time): max {b['idle_over_busy_max']:.3f} (ranks: "
                         f"{per}) vs theory {formula} = {theory:.3f}; idle / wall "
                         f"max {b['idle_over_wall_max']:.3f} vs "
                         f"{theory / (1 + theory):.3f}.")
        peaks = pp["peak_activation_bytes"]
        names = {"1f1b": "1F1B", "gpipe": "GPipe", "zero_bubble": "ZB-H1"}
        per = "; ".join(f"stage {s}: " + ", ".join(
            f"{names.get(k, k)} {_bytes(v[s])}" for k, v in peaks.items())
            for s in range(len(peaks["1f1b"])))
        lines.append(f"- {r['model']} sbpflow pipeline peak activation memory per stage "
                     f"(peak_live_bytes of the compiled program, an estimate): {per}.")
    c = r.get("check_overhead")
    if c:
        lines.append(f"- {r['model']} collective agreement check ({c['mode']}): step "
                     f"{c['checked_step_ms']:.1f} ms checked vs {c['unchecked_step_ms']:.1f} ms "
                     f"with SBPFLOW_CHECK=off (medians, same repeats): "
                     f"{100 * c['overhead']:+.1f}%.")
    return lines


def _report(args, argv: list[str], results: list[dict]) -> None:
    r0 = results[0]
    method = METHOD.format(warmup=args.warmup, repeats=args.repeats, steps=args.steps)
    command = "sbpflow bench " + " ".join(argv)
    out_dir = args.out
    os.makedirs(out_dir, exist_ok=True)
    base = _label(r0, r0["baseline"]).replace(" (baseline)", "")
    lines = [f"Method ({method}).",
             f"Per-rank batch stated below; {r0['threads_per_rank']} torch thread(s) per rank; "
             f"optimizer {r0['optimizer']}; amp {r0['amp']}; device {r0['device']}; "
             f"ratio = sbpflow / PyTorch samples/s, PyTorch = the baseline peer of the layout "
             f"({base}); 'vs baseline' = the row's samples/s over the baseline's.", ""]
    lines += _table(results)
    lines.append("")
    for r in results:
        lines += _details(r)
        if "plans" in r:
            from . import plans

            lines += plans.report_lines(r)
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
    """One group of bars per configuration (and its 1-rank run): a bar per runner, samples/s
    median with the min-max of the repeats; sbpflow's bar labelled with the ratio."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = []  # (label, [(runner label, median, repeats)], ratio)
    for r in results:
        sc = r.get("scaling")
        name = r["model"] + (f" b{r['batch_size_per_rank']}" if len(results) > 1 else "")
        if sc:
            groups.append((f"{name}\n1 rank", [
                ("sbpflow", sc["sbpflow_1rank_samples_per_s"], sc["sbpflow_1rank_repeats"]),
                ("PyTorch (1 process)", sc["torch_1rank_samples_per_s"],
                 sc["torch_1rank_repeats"])], sc["ratio_1rank"]))
        groups.append((f"{name}\n{r['ranks']} rank{'s' if r['ranks'] > 1 else ''} "
                       f"({r['layout']['name']})",
                       [(_label(r, n), s["samples_per_s"], s["repeats_samples_per_s"])
                        for n, s in r["runners"].items()], r["ratio"]))
    width = max(len(bars) for _, bars, _ in groups)
    fig, ax = plt.subplots(figsize=(max(5.0, (0.5 * width + 0.8) * len(groups) + 1), 4))
    w = 0.8 / width
    colors: dict[str, str] = {}  # runner label -> colour; the legend names each once
    for g, (_, bars, ratio) in enumerate(groups):
        for i, (label, med, reps) in enumerate(bars):
            key = label.replace(" (baseline)", "")
            first = key not in colors
            color = colors.setdefault(key, f"C{len(colors)}")
            x = g - 0.4 + w * (i + 0.5)
            ax.bar(x, med, w, color=color, label=key if first else None,
                   yerr=[[med - min(reps)], [max(reps) - med]], capsize=3)
            if i == 0:
                ax.annotate(f"{ratio:.2f}x", (x, med), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(range(len(groups))))
    ax.set_xticklabels([g[0] for g in groups], fontsize=8)
    ax.set_ylabel("samples/s (median; bars: min-max of repeats)")
    r0 = results[0]
    ax.set_title(f"sbpflow bench ({r0['device']}, synthetic data, batch "
                 f"{r0['batch_size_per_rank']}/rank); label: sbpflow / baseline", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

