"""``sbpflow train MODEL``: train a model of :mod:`sbpflow.models` on real data.

Commands (``sbpflow train --help`` lists every option)::

    sbpflow train gpt-mini --nproc-per-node 2             # Shakespeare, char level, TP over 2
    sbpflow train gpt-mini --nproc-per-node 4 --dp 2 --tp 2   # 2x2 mesh: DP x TP
    sbpflow train gpt-mini --pp 2 --dp 2 --tp 2 --micro-batches 8   # 2 stages of 2x2: 8 ranks
    sbpflow train resnet18 --nproc-per-node 2             # digits, data parallel
    sbpflow train gpt-mini --data my_texts/ --tokenizer byte --out runs/mine
    sbpflow train gpt-mini --nproc-per-node 2 --resume    # continue runs/gpt-mini
    sbpflow train gpt-mini --nproc-per-node 2 --overwrite # start runs/gpt-mini over
    sbpflow train gpt-mini --nproc-per-node 2 --max-restarts 3 --ckpt-every 50
    sbpflow launch --nproc-per-node 2 -m sbpflow.apps.train gpt-mini   # the same, via torchrun

With ``--nproc-per-node N`` the command launches N ranks itself (through
:mod:`sbpflow.distributed.launch`, i.e. torchrun); started by torchrun (``RANK`` and
``WORLD_SIZE`` set) it runs as one of the ranks and launches nothing.

**Layout.** ``--dp D --tp T --pp P`` with ``D * T * P`` = world size (``--pp`` default 1).
``T = 1``: a 1-D mesh, parameters replicated, batch S(0) (data parallel). ``D = 1``: a 1-D
mesh, the model's tensor-parallel plan (:meth:`ModelSpec.plan`), batch B. Both: a ``D x
T`` mesh ``[[0..T-1], [T..2T-1], ...]``, DP on axis 0 (batch ``(S(0), B)``), the TP plan
on axis 1. Default: the model's ``default_layout`` over all ranks of a stage (gpt-mini:
TP, ResNet: DP).

``--pp P`` > 1: pipeline parallelism, P stages; stage ``s`` holds ranks ``[s*D*T,
(s+1)*D*T)`` laid out as the ``D x T`` mesh above (so ``--pp 2 --dp 2 --tp 2``: stages
``[[0, 1], [2, 3]]`` and ``[[4, 5], [6, 7]]``). The model's split
(:meth:`ModelSpec.pipeline_stages`; GPT models only: the embeddings and the first blocks
on stage 0, the blocks spread evenly, ``ln_f`` and ``lm_head`` on the last stage, the tied
embedding kept on stage 0 and boxed to the head) puts each module on its stage's
placement with ``GraphModule.set_stage``. The inputs go to stage 0's placement, the
targets to the last stage's (each laid out over DP as above). ``--pp`` turns ``--graph``
on: the compiled :class:`sbpflow.nn.Graph` is the pipeline's runtime, its gradient
accumulation steps (``--grad-accum``, alias ``--micro-batches``) the micro-batches, run in
``--schedule`` order (``1f1b``, default, ``gpipe``, ``zero_bubble`` (ZB-H1), or
``interleaved`` with ``--virtual-stages V`` (default 2): the model cut into ``pp * V``
stages, stage ``s`` on rank group ``s % pp``). Evaluation and the GPT sample run eagerly, the stages
one after another (the sampled tokens come back to stage 0's placement). Checked up
front: the model has a split, at least as many blocks as stages, the micro-batches divide
the batch and each splits over ``--dp``; no ``--compile``. The layout (``pp``,
``schedule``) is recorded in ``config.json`` and the checkpoints, whose tensors reshard on
resume as any layout's: a checkpoint saved with ``--pp 2`` resumes with ``--pp 1`` or
another ``--dp``/``--tp``.

**Data** (:mod:`sbpflow.apps.datasets`): task ``lm``/``mlm`` read text (Shakespeare by
default, whole plays held out for validation; or ``--data`` a text file or folder),
character- or byte-level; task ``image`` reads scikit-learn's digits by default or an
ImageFolder directory; task ``ctr`` (DLRM, Wide & Deep) reads MovieLens-100k from the
``recbole`` package's data (:func:`sbpflow.apps.datasets.load_movielens`: a rating >= 4 is a
click, a random 80/10/10 split seeded by ``--seed``; ``--data`` a folder holding
``ml-100k.inter/.user/.item``), its loss ``binary_cross_entropy_with_logits``, evaluated
on the whole validation split (AUC and log-loss, :mod:`sbpflow.apps.metrics`). The global
batch of step ``s`` is a pure function of ``(--seed, s)``, identical on every rank and for
any layout; each rank loads only its part of dim 0 (S(0) over the DP axis, B over TP).
So the data position of a run is its step number.

**Step.** ``--batch-size`` is the global batch per optimizer step; ``--grad-accum K``
cuts it into K micro-batches run one after another, the first K-1 under
:func:`sbpflow.no_sync` (gradients summed locally, reduced once with the last). AdamW
(weight decay on parameters of 2 or more dims), linear warm-up over ``--warmup`` steps
then cosine decay to ``--min-lr-ratio`` of ``--lr``, gradient clipping to
``--grad-clip``, ``--amp bf16|fp16`` (:func:`sbpflow.autocast`; fp16 with
:class:`sbpflow.amp.GradScaler`). The evaluation scores the same samples whatever
``--grad-accum``: text ``--eval-batches`` batches of ``--batch-size`` windows (run a
micro-batch at a time), images and ``ctr`` the whole validation split.

**Outputs** in ``--out`` (default ``runs/MODEL``), written by rank 0: ``metrics.jsonl``
(one JSON object per logged step: ``step``, ``loss``, ``lr``, ``samples_per_s``, plus
``val_loss`` and, for images, ``val_acc``, for ``ctr`` ``val_auc`` and ``val_logloss``
(the validation split's log-loss, equal to ``val_loss``) when evaluated; standard JSON
throughout, a non-finite value is written as ``null``), ``loss.png`` (matplotlib, at the
end; ``ctr``: the validation AUC on a second axis),
``config.json``, ``tokenizer.json`` (text), ``sample.txt`` (GPT: a generated sample, also
printed), and ``ckpt/`` (:func:`sbpflow.save` format with ``keep=2``: the newest version
and the one before; every ``--ckpt-every`` steps, by default a tenth of ``--steps``
(:func:`default_ckpt_every`), at the end, and when a signal stops the run) holding model,
optimizer, LR scheduler, grad scaler, torch RNG state, the step,
that step's metrics record and the run's identity (``"run"``: model, task, seed, global
batch, block size, tokenizer, model config, a digest of the training data, layout,
grad-accum, pp, schedule). The final checkpoint is written before the final evaluation,
plot and sample, so a failure there loses no training.

**Checked before step 1** (``sbpflow train`` exits with code 2 and a message naming the
value and the fix, before any rank starts): ``--lr`` finite and > 0; ``--min-lr-ratio`` in
[0, 1]; ``--weight-decay`` and ``--grad-clip`` finite and >= 0; ``--warmup`` <=
``--steps``; ``--seed`` in torch's range; for a text task ``--eval-batches`` >= 1, and
both the training and the validation text at least one window (``block size + 1`` tokens)
long; when a sample is generated (GPT, ``--sample-tokens`` > 0) ``--temperature`` finite
and > 0 and every ``--prompt`` character known to the char tokenizer; ``SBPFLOW_TIMEOUT``
a finite number of seconds from 0.001 to 1e9; ``--config`` keys that are fields, of the
default's type, not set by the data (``vocab_size``,
``num_classes``, ``in_channels``), and a ``--config block_size`` not shorter than
``--block-size``; ``--synthetic`` without ``--data``; ``--device cuda`` only with CUDA;
``--pp`` as under Layout; ``--out`` not a file; matplotlib (and tqdm unless
``--no-progress``) installed; with ``--resume`` the checkpoint and ``metrics.jsonl`` as
below. The text is loaded once for this in the launching process. A rank that finds a
problem before step 1 (images: ``--batch-size`` larger than the training set) reports it
once, from rank 0, with exit code 2.

**Non-finite loss.** fp32/bf16: a NaN/inf training loss stops the run before that
step's update, with exit code 1, after writing the step's line (``"loss": null``); the
message names the step and suggests a lower ``--lr``. fp16: the GradScaler skips such a
step (its gradients are not finite) and lowers the scale, as it is meant to; 8 in a row
stop the run (the weights or the forward pass overflow; lower ``--lr`` or use bf16).

**Resume.** ``--resume`` loads ``OUT/ckpt`` (the last complete version), restores all of
the above, drops the lines of ``metrics.jsonl`` after the checkpoint's step (and a torn
last line, what a crash in the middle of a write leaves, with a warning; a damaged line
elsewhere is an error naming the file and line), and continues: the losses are those of an
uninterrupted run (the data stream depends only on the step). Before step 1 (in the
launching process, and again in the ranks) the run must match the checkpoint's record in
what defines the data stream and the parameters: model, seed, global ``--batch-size``,
``--block-size``, tokenizer (kind and vocabulary), model config (``--config`` included)
and training data (its digest); a difference is an error naming the recorded and the given
values. Checkpoints that predate the record are checked on what they hold (model, seed,
batch size). What may change: the layout (``--dp``/``--tp``/``--pp``/``--schedule``/world
size: the checkpoint reshards), ``--grad-accum`` (it cuts the same global batch into
micro-batches; only the dropout draws and summation order differ), ``--steps`` (not below
the checkpoint's step), and ``--warmup``, ``--min-lr-ratio``, ``--lr``,
``--weight-decay``, ``--grad-clip`` (this run's values hold from the next step on: the
schedule is reshaped), ``--amp``, and the evaluation, logging and checkpoint intervals. A
resume of a run whose final checkpoint exists (its step equals ``--steps``) does what is
missing: the final evaluation and line, the plot and the sample. A resume of a finished
run (those outputs all there) is refused before any rank starts, naming its last step and
the ``--steps`` given: ``--steps`` must exceed the last step (an elastic restart is not
refused: it completes what is missing).

**One run per output folder** (:mod:`sbpflow.apps._runlock`). The run holds an exclusive lock
on ``OUT/.lock`` (``flock``; it records pid, host, start time and command) for the whole
job: the launching process holds it, or rank 0 under a plain ``torchrun``. A second run
into ``OUT`` is refused with the holder's pid, host and start time. The kernel drops the
lock when its holder dies, so a killed run leaves nothing to clean up on a local disk;
``--take-over`` replaces a lock still held for a run that is gone (a crashed host, a
network filesystem), never one whose holder runs on this host. A fresh run (no
``--resume``) into a folder that holds a run (``metrics.jsonl`` with a step, or ``ckpt/``)
is refused, naming what is there (a run that stopped before its first step is not one:
the same command runs again); ``--overwrite`` deletes that run's outputs (only the files listed
under Outputs) and starts over. The lock is taken before the ``--resume`` checks, so a
``--resume`` into a folder another run holds names that run. The launcher hands the lock
to its ranks (:meth:`~sbpflow.apps._runlock.RunLock.handoff_env`), which skip it only when the
lock file records their parent, this host and the nonce they were given
(:func:`~sbpflow.apps._runlock.handed_off`); ``SBPFLOW_RUN_LOCK`` set by hand is ignored with a
warning.

**Interrupts.** SIGINT (Ctrl-C) or SIGTERM to ``sbpflow train`` reaches every rank (the
launcher's torchrun agent forwards it). A rank records it and finishes the step in
progress; at each step boundary the ranks agree (one all-reduce of an int), so they stop
after the same step, save a checkpoint of it together (none when that step has one: the
interval's, the final one, or the one resumed from; a second version of a step would push
the version before it out of ``keep=2``), and exit with ``128 + signal`` (130, 143); rank
0 prints the step and the command that continues (this command with ``--resume``). The
launcher waits for the ranks up to torchrun's shutdown timeout (30 s) before SIGKILL; a
second signal acts at once (Python's default: ``KeyboardInterrupt``, or termination).
Before step 1 and after the last step (final evaluation, plot, sample; the final
checkpoint exists) a signal acts at once as well.

**Restarts.** ``--max-restarts N`` hands torchrun its elastic restarts: after a rank fails
(a crash, an OOM kill, SIGKILL), torchrun stops the others and starts all ranks again, up
to N times; a restarted rank (``TORCHELASTIC_RESTART_COUNT`` > 0) resumes from the newest
checkpoint in ``OUT/ckpt`` as ``--resume`` does (from step 0 if there is none yet), so
``metrics.jsonl`` has each step once and the losses are the uninterrupted run's. A restart
redoes the steps since the last checkpoint (``--ckpt-every``, by default every
``max(1, steps // 10)`` steps). Ranks exit
within about a second when their launcher dies (:mod:`sbpflow.distributed._watchdog`), so
a killed ``sbpflow train`` leaves no ranks training behind.

**Defaults** (:data:`TASK_DEFAULTS`, for options left unset): text 500 steps of 32
windows of 128 characters, peak LR 2e-3, warm-up 40; images 300 steps of 64, LR 2e-3;
``ctr`` 400 steps of 1024 ratings (5 epochs of MovieLens-100k), LR 3e-3, no weight decay.
``gpt-mini`` (0.8M parameters), TP over 2 ranks on 2 CPU cores: about 0.28 s a step on
idle cores (0.5 s with other work on the machine); at 600 steps the validation loss was
2.55 at step 100, 2.26 at 300, 2.05 at 500, 2.01 at 600; 500 steps keep the run under 5
minutes with margin.

**Your own model.** ``--plugin FILE.py`` (or a module name) is imported before the model
is looked up, so a file that calls :func:`sbpflow.models.register` adds models.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import hashlib
import importlib
import importlib.util
import json
import math
import os
import shlex
import signal
import sys
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import torch

from sbpflow._argtypes import nonneg_int as _nonneg
from sbpflow._argtypes import positive_int as _positive

from . import _runlock, require_extra

__all__ = ["main", "build_parser", "resolve_layout", "lr_lambda", "TASK_DEFAULTS"]

#: Defaults per task, used for options left unset (chosen so that gpt-mini on Shakespeare
#: and ResNet-18 on digits train on 2 CPU cores in a few minutes).
TASK_DEFAULTS = {
    "lm": dict(steps=500, batch_size=32, lr=2e-3, warmup=40, weight_decay=0.1,
               eval_every=100, eval_batches=8, block_size=128),
    "mlm": dict(steps=500, batch_size=32, lr=1e-3, warmup=40, weight_decay=0.01,
                eval_every=100, eval_batches=8, block_size=128),
    "image": dict(steps=300, batch_size=64, lr=2e-3, warmup=20, weight_decay=5e-4,
                  eval_every=50, eval_batches=0, block_size=None),
    "ctr": dict(steps=400, batch_size=1024, lr=3e-3, warmup=20, weight_decay=0.0,
                eval_every=100, eval_batches=0, block_size=None),
}



def _by_task(key: str) -> str:
    """``--help``'s default of an option the model's task sets: ``lm 500, mlm 500, ...``."""
    return "by the model's task: " + ", ".join(f"{t} {d[key]}" for t, d in TASK_DEFAULTS.items())


# ----------------------------------------------------------------------------- arguments
def _config_item(value: str) -> tuple[str, object]:
    if "=" not in value:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE (e.g. n_layer=2), got {value!r}")
    key, raw = value.split("=", 1)
    try:
        val = ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        val = raw
    return key.strip(), val


def build_parser(prog: str = "sbpflow train") -> argparse.ArgumentParser:
    """The argument parser of ``sbpflow train`` (options left ``None`` take the task's
    :data:`TASK_DEFAULTS`)."""
    p = argparse.ArgumentParser(
        prog=prog, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Train a model of sbpflow.models on real data (Shakespeare text, digits "
                    "images, or --data), on N ranks in a data/tensor/pipeline parallel "
                    "layout.",
        epilog="examples:\n"
               "  %(prog)s gpt-mini --nproc-per-node 2\n"
               "  %(prog)s gpt-mini --nproc-per-node 4 --dp 2 --tp 2\n"
               "  %(prog)s gpt-mini --pp 2 --dp 2 --tp 2 --micro-batches 8\n"
               "  %(prog)s resnet18 --nproc-per-node 2\n"
               "  %(prog)s gpt-mini --nproc-per-node 2 --resume\n"
               "  %(prog)s gpt-mini --nproc-per-node 2 --max-restarts 3 --ckpt-every 50\n"
               "Outputs in --out: metrics.jsonl, loss.png, config.json, ckpt/, sample.txt.\n"
               "One run per --out at a time (a lock, OUT/.lock); a fresh run into a folder "
               "that holds a run\nneeds --resume or --overwrite.")
    p.add_argument("model", help="a model name of sbpflow.models (e.g. gpt-mini, resnet18)")
    g = p.add_argument_group("ranks and layout")
    g.add_argument("--nproc-per-node", "--nproc_per_node", type=_positive, default=None,
                   metavar="N", help="launch N ranks on this machine (default: the "
                   "dp*tp*pp product, else 1); ignored under torchrun, which has started "
                   "the ranks")
    g.add_argument("--dp", type=_positive, default=None, help="data-parallel degree")
    g.add_argument("--tp", type=_positive, default=None, help="tensor-parallel degree "
                   "(dp * tp * pp = world size; default: the model's default layout on all "
                   "ranks of a stage)")
    g.add_argument("--pp", type=_positive, default=1, help="pipeline-parallel stages "
                   "(default 1): stage s runs on ranks [s*dp*tp, (s+1)*dp*tp), laid out "
                   "dp x tp; the micro-batches are --grad-accum (--micro-batches). > 1 turns "
                   "--graph on: the compiled nn.Graph is the pipeline's runtime (GPT models)")
    g.add_argument("--schedule", choices=("1f1b", "gpipe", "interleaved", "zero_bubble"),
                   default=None,
                   help="pipeline schedule with --pp > 1: 1f1b (default; stage s holds at "
                   "most pp - s micro-batches' activations), gpipe (all forwards, then all "
                   "backwards), interleaved (--virtual-stages stages per rank group: a "
                   "bubble of (pp-1)/(v m)) or zero_bubble (ZB-H1: each backward split into "
                   "the input gradient and the weight gradient, run later to fill the "
                   "bubble; 1f1b's activations, about a third of its bubble)")
    g.add_argument("--virtual-stages", type=_positive, default=None, metavar="V",
                   help="with --schedule interleaved: stages per rank group (default 2); "
                   "the model is cut into pp * V stages, stage s on group s %% pp")
    g.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="placement device type (default cpu)")
    g = p.add_argument_group("optimisation")
    g.add_argument("--steps", type=_positive, default=None,
                   help=f"optimizer steps (default: {_by_task('steps')})")
    g.add_argument("--batch-size", type=_positive, default=None,
                   help="global batch per optimizer step (samples over all ranks, gradient "
                   f"accumulation included; default: {_by_task('batch_size')})")
    g.add_argument("--grad-accum", "--micro-batches", dest="grad_accum", type=_positive,
                   default=1, help="micro-batches per step (default 1); batch-size must be "
                   "divisible; with --pp the pipeline's micro-batches")
    g.add_argument("--lr", type=float, default=None,
                   help=f"peak learning rate (AdamW; default: {_by_task('lr')})")
    g.add_argument("--warmup", type=_nonneg, default=None, help="linear warm-up steps "
                   "(default: the task's, at most a tenth of --steps)")
    g.add_argument("--min-lr-ratio", type=float, default=0.1,
                   help="cosine decay ends at lr * this (default 0.1)")
    g.add_argument("--weight-decay", type=float, default=None,
                   help="AdamW weight decay of parameters with >= 2 dims")
    g.add_argument("--grad-clip", type=float, default=1.0,
                   help="clip the global gradient norm to this (0: off; default 1.0)")
    g.add_argument("--amp", choices=("bf16", "fp16"), default=None,
                   help="mixed precision (fp16 uses a GradScaler)")
    g.add_argument("--graph", action="store_true",
                   help="run each step as a compiled sbpflow.nn.Graph (traced at the first "
                        "step, then replayed as each rank's torch.fx program)")
    g.add_argument("--compile", action="store_true",
                   help="with --graph: hand the per-rank program to torch.compile")
    g.add_argument("--plan", default=None, metavar="auto|FILE",
                   help="let sbpflow lay the model out (turns --graph on): 'auto' searches "
                        "the layouts on this machine's calibration (nn.Graph's "
                        "enable_auto_parallel), FILE runs a saved plan (plan.json of an "
                        "earlier run, edited or not) as given. The mesh: --dp x --tp when "
                        "both are given, else all ranks in a row. Written to OUT/plan.json "
                        "and explained in OUT/graph.txt")
    g.add_argument("--seed", type=int, default=0, help="seed of init, dropout and data")
    g = p.add_argument_group("data and model")
    g.add_argument("--data", default=None, metavar="PATH",
                   help="text file/folder (lm, mlm) or ImageFolder directory (image); "
                   "default: Shakespeare (text) or scikit-learn digits (images)")
    g.add_argument("--tokenizer", choices=("char", "byte"), default="char",
                   help="text tokenisation (default char)")
    g.add_argument("--block-size", type=_positive, default=None,
                   help="tokens per training window (text; default 128 or the model's)")
    g.add_argument("--image-size", type=_positive, default=32,
                   help="resize ImageFolder images to this (default 32)")
    g.add_argument("--synthetic", action="store_true",
                   help="random data instead of real data (labelled synthetic)")
    g.add_argument("--config", type=_config_item, action="append", default=[],
                   metavar="KEY=VALUE", help="override a field of the model config "
                   "(repeatable), e.g. --config n_layer=2")
    g.add_argument("--plugin", action="append", default=[], metavar="FILE|MODULE",
                   help="import this Python file or module first (it may register models)")
    g = p.add_argument_group("evaluation, logging, checkpoints")
    g.add_argument("--out", default=None, metavar="DIR", help="output folder "
                   "(default runs/MODEL)")
    g.add_argument("--eval-every", type=_nonneg, default=None,
                   help="validate every this many steps (0: only at the end; default: "
                   f"{_by_task('eval_every')})")
    g.add_argument("--eval-batches", type=_nonneg, default=None,
                   help="validation batches (text; images use the whole validation set; "
                   f"default: {_by_task('eval_batches')})")
    g.add_argument("--log-every", type=_positive, default=1,
                   help="write metrics every this many steps (default 1)")
    g.add_argument("--ckpt-every", type=_nonneg, default=None,
                   help="checkpoint every this many steps (0: only at the end and when "
                   "SIGINT/SIGTERM stops the run; default max(1, steps // 10))")
    g.add_argument("--resume", action="store_true",
                   help="continue from the last checkpoint in OUT/ckpt")
    g.add_argument("--overwrite", action="store_true",
                   help="start over in an --out that holds a run: delete its outputs "
                   "(metrics.jsonl, ckpt/, config.json, tokenizer.json, loss.png, "
                   "sample.txt) first; without it such a fresh run is refused")
    g.add_argument("--take-over", action="store_true",
                   help="take over the lock of --out from a run that is gone although its "
                   "lock is held (its host crashed; a network filesystem); refused while "
                   "the holder runs on this host")
    g.add_argument("--max-restarts", type=_nonneg, default=0, metavar="N",
                   help="restart all ranks up to N times after a rank fails (torchrun's "
                   "elastic restarts); each restart resumes from the newest checkpoint "
                   "(from step 0 if none yet) and loses the steps after it (--ckpt-every)")
    g.add_argument("--sample-tokens", type=_nonneg, default=400,
                   help="tokens of the generated sample at the end (GPT; 0: none)")
    g.add_argument("--prompt", default="\n", help="prompt of the sample (default a newline)")
    g.add_argument("--temperature", type=float, default=0.8,
                   help="sampling temperature (default 0.8)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def _import_plugin(name: str) -> None:
    if name.endswith(".py") or os.path.sep in name:
        path = Path(name).resolve()
        if not path.is_file():
            raise FileNotFoundError(f"--plugin {name!r}: no such file")
        mod_name = f"_sbpflow_plugin_{path.stem}"
        if mod_name in sys.modules:
            return
        spec = importlib.util.spec_from_file_location(mod_name, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[mod_name] = mod
        spec.loader.exec_module(mod)
    else:
        importlib.import_module(name)


def resolve_layout(spec, dp: int | None, tp: int | None, world: int,
                   pp: int = 1) -> tuple[int, int]:
    """``(dp, tp)`` for ``world`` ranks in ``pp`` pipeline stages (each stage holds
    ``world // pp`` ranks as a ``dp x tp`` mesh): the given degrees, the missing one
    derived, or the model's ``default_layout`` over the ranks of a stage.

    Raises:
        ValueError: ``dp * tp * pp != world`` (naming the numbers), a degree that does
            not divide the world (or the ranks of a stage), or ``tp > 1`` for a model
            without a tensor-parallel plan.
    """
    if pp > 1:
        if world % pp:
            raise ValueError(f"--pp {pp} does not divide the world size {world}; pick --pp "
                             f"among {[d for d in range(1, world + 1) if world % d == 0]}, "
                             f"or launch a multiple of {pp} ranks")
        return _resolve_stage(spec, dp, tp, world // pp, pp, world)
    return _resolve_stage(spec, dp, tp, world, 1, world)


def _resolve_stage(spec, dp, tp, ranks: int, pp: int, world: int) -> tuple[int, int]:
    """:func:`resolve_layout` within a stage of ``ranks`` ranks (``world = ranks * pp``)."""
    where = f"the world size {world}" if pp == 1 else \
        f"the {ranks} ranks of a stage (world {world} / --pp {pp})"
    if dp is None and tp is None:
        if spec.default_layout == "tp" and "tp" in spec.plans:
            dp, tp = 1, ranks
        else:
            dp, tp = ranks, 1
    elif dp is None:
        if ranks % tp:
            raise ValueError(f"--tp {tp} does not divide {where}; pick --tp among "
                             f"{[d for d in range(1, ranks + 1) if ranks % d == 0]}")
        dp = ranks // tp
    elif tp is None:
        if ranks % dp:
            raise ValueError(f"--dp {dp} does not divide {where}; pick --dp among "
                             f"{[d for d in range(1, ranks + 1) if ranks % d == 0]}")
        tp = ranks // dp
    if dp * tp != ranks:
        if pp == 1:
            raise ValueError(f"--dp {dp} x --tp {tp} = {dp * tp} ranks, but the world has "
                             f"{world} (--nproc-per-node / WORLD_SIZE); make dp * tp = "
                             f"{world}, or launch {dp * tp} ranks")
        raise ValueError(f"--dp {dp} x --tp {tp} x --pp {pp} = {dp * tp * pp} ranks, but the "
                         f"world has {world} (--nproc-per-node / WORLD_SIZE); make dp * tp * "
                         f"pp = {world}, or launch {dp * tp * pp} ranks")
    if tp > 1 and "tp" not in spec.plans:
        raise ValueError(f"{spec.name} has no tensor-parallel plan; use --dp {ranks} --tp 1")
    return dp, tp


def lr_lambda(step: int, warmup: int, steps: int, min_ratio: float) -> float:
    """Multiplier of the peak LR at optimizer step ``step`` (0-based): linear warm-up
    ``(step + 1) / warmup`` for ``step < warmup``, then cosine from 1 to ``min_ratio`` at
    ``step = steps - 1``."""
    if step < warmup:
        return (step + 1) / warmup
    span = max(1, steps - 1 - warmup)
    t = min(1.0, (step - warmup) / span)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * t))


class _Schedule:
    """:func:`lr_lambda` as LambdaLR's multiplier (LambdaLR's state dict keeps its
    attributes, plain numbers, so checkpoints hold the schedule)."""

    def __init__(self, warmup: int, steps: int, min_ratio: float):
        self.warmup, self.steps, self.min_ratio = warmup, steps, min_ratio

    def __call__(self, step: int) -> float:
        return lr_lambda(step, self.warmup, self.steps, self.min_ratio)


# ----------------------------------------------------------------------------- checks
#: Config fields that the data set (the tokenizer's vocabulary, the images' classes and
#: channels); ``--config`` may not override them.
_DATA_FIELDS = {"lm": ("vocab_size",), "mlm": ("vocab_size",),
                "image": ("num_classes", "in_channels"),
                "ctr": ("vocab_sizes", "bag_vocab", "num_dense")}
#: What a resumed run must share with its checkpoint (see :func:`_resume_problems`).
_RESUME_KEYS = ("model", "task", "seed", "batch_size", "block_size", "tokenizer", "config",
                "data")
#: With ``--amp fp16`` a non-finite loss makes the GradScaler skip the step; this many in
#: a row stop the run (the forward pass itself overflows, which no loss scale cures).
_FP16_NONFINITE_LIMIT = 8


class _RunError(ValueError):
    """A problem a rank finds before step 1 (``code`` 2: the options do not fit the data or
    the checkpoint) or that stops training (``code`` 1: a non-finite loss). Every rank
    raises it at the same point; :meth:`_Trainer.run` reports it once, on rank 0."""

    def __init__(self, msg: str, code: int = 2):
        super().__init__(msg)
        self.code = code


def _model_overrides(spec, args, vocab: int | None = None, images=None, ctr=None
                     ) -> tuple[dict, int | None, bool]:
    """The config overrides of this run, its window length and whether 1-channel images
    are repeated to 3 channels: ``(overrides, block, repeat_channels)``.

    Text: ``vocab_size`` from the tokenizer (``vocab``), the window ``--block-size`` (or
    the model's context length capped at the task default), the context field
    (``block_size``/``max_position``) raised to the window when shorter. Images: classes
    and channels from ``images`` (left out when ``None``, as in :func:`_validate`, which
    checks only the ``--config`` items). Click-through (``ctr``): the tables' vocabularies
    and the dense width from ``ctr`` (a :class:`~sbpflow.apps.datasets.CTRSplit`). Then the
    ``--config`` items.

    Raises:
        ValueError: a ``--config`` key that is not a field, of a field the data set, or
            whose value has another type than the field's default; ``--block-size`` longer
            than an explicit ``--config block_size=``.
    """
    cfg = spec.config
    fields = {f.name: f for f in dataclasses.fields(cfg)} if dataclasses.is_dataclass(cfg) \
        else {}
    user = dict(args.config)
    for key, val in user.items():
        if fields and key not in fields:
            raise ValueError(f"--config {key}=...: {spec.name}'s config has no field {key!r}; "
                             f"fields: {sorted(fields)}")
        if key in _DATA_FIELDS.get(spec.task, ()):
            raise ValueError(f"--config {key}={val!r}: {key} is set from the data; drop it")
        default = getattr(cfg, key, None)
        ok = (isinstance(val, bool) if isinstance(default, bool) else
              isinstance(val, int) and not isinstance(val, bool) if isinstance(default, int)
              else isinstance(val, (int, float)) and not isinstance(val, bool)
              if isinstance(default, float) else
              isinstance(val, str) if isinstance(default, str) else True)
        if not ok:
            raise ValueError(f"--config {key}={val!r}: expected {type(default).__name__} "
                             f"(the default is {key}={default!r})")
    over, block, repeat = {}, None, False
    if spec.task == "ctr":
        if ctr is not None:
            over.update(vocab_sizes=tuple(ctr.vocab_sizes), bag_vocab=ctr.bag_vocab,
                        num_dense=len(ctr.dense_names))
    elif spec.task in ("lm", "mlm"):
        if "vocab_size" not in fields:
            raise ValueError(f"{spec.name}: its config has no vocab_size field to size "
                             f"the vocabulary with")
        if vocab is not None:
            over["vocab_size"] = vocab
        # the context length field: GPT's block_size, BERT's max_position
        block_field = next((f for f in ("block_size", "max_position") if f in fields), None)
        model_block = user.get(block_field, getattr(cfg, block_field)) if block_field \
            else None
        default = TASK_DEFAULTS[spec.task]["block_size"]
        block = args.block_size or (min(model_block, default) if model_block else default)
        if model_block is not None and block > model_block:
            if block_field in user:
                raise ValueError(f"--block-size {block} is longer than --config "
                                 f"{block_field}={model_block}, the model's context; give "
                                 f"--block-size {model_block} or less, or drop the --config")
            over[block_field] = block
    elif images is not None:
        if "num_classes" in fields:
            over["num_classes"] = images.num_classes
        if "in_channels" in fields:
            over["in_channels"] = images.channels
        if "small_input" in fields and max(images.train_x.shape[2:]) <= 64:
            over["small_input"] = True  # an ImageNet stem would shrink 8x8 digits to 1x1
        repeat = "in_channels" not in fields and images.channels == 1
    over.update(user)
    return over, block, repeat


def _data_digest(*parts) -> str:
    """A short digest of the training data (texts or tensors), recorded in checkpoints."""
    h = hashlib.blake2b(digest_size=8)
    for part in parts:
        h.update(part.encode("utf-8") if isinstance(part, str)
                 else np.ascontiguousarray(part.numpy()).tobytes())
        h.update(b"\0")
    return h.hexdigest()


def _plain(obj):
    """``obj`` as JSON gives it back (tuples as lists), for comparing run records."""
    return json.loads(json.dumps(obj, default=str))


def _run_record(spec, args, batch: int, block, over: dict | None, tokenizer=None,
                data: dict | None = None, layout: str | None = None) -> dict:
    """What a checkpoint records about its run (``"run"``); ``None`` for what is not
    known (the parent process does not load images)."""
    config = None
    if over is not None:
        cfg = spec.configure(**over)
        if dataclasses.is_dataclass(cfg):
            config = _plain(dataclasses.asdict(cfg))
    return {"model": spec.name, "task": spec.task, "seed": args.seed, "batch_size": batch,
            "block_size": block, "tokenizer": tokenizer.to_json() if tokenizer else None,
            "config": config, "data": data, "layout": layout, "grad_accum": args.grad_accum,
            "pp": getattr(args, "pp", 1), "schedule": getattr(args, "schedule", None)}


def _data_fix(source: str) -> str:
    if source == "shakespeare":
        return "drop --data and --synthetic"
    if source == "synthetic":
        return "pass --synthetic"
    return f"pass --data {source}"


def _resume_problems(recorded: dict, current: dict) -> list[str]:
    """How ``current`` (this run's :func:`_run_record`) differs from ``recorded`` (the
    checkpoint's), one line each naming both values and the option to give; fields
    either side lacks (older checkpoints record only model, seed and batch size) are not
    compared."""
    out = []
    for key in _RESUME_KEYS:
        r, c = recorded.get(key), current.get(key)
        if r is None or c is None:
            continue
        r, c = _plain(r), _plain(c)
        if r == c or key == "data" and r.get("digest") == c.get("digest"):
            continue  # the data are compared by content: a moved file is the same data
        if key == "model":
            out.append(f"model {r} (this run: {c}); give {r}")
        elif key == "task":
            out.append(f"task {r} (this run: {c})")
        elif key in ("seed", "batch_size", "block_size"):
            opt = "--" + key.replace("_", "-")
            out.append(f"{opt} {r} (this run: {opt} {c}); pass {opt} {r}")
        elif key == "tokenizer":
            if r.get("kind") != c.get("kind"):
                out.append(f"--tokenizer {r.get('kind')} (this run: --tokenizer "
                           f"{c.get('kind')}); pass --tokenizer {r.get('kind')}")
            else:
                out.append(f"a {r.get('kind')} vocabulary of {len(r.get('chars', ''))} "
                           f"characters (this run: {len(c.get('chars', ''))}, from other "
                           f"training text); train on the same --data")
        elif key == "config":
            # the vocabulary size follows the tokenizer, compared on its own
            skip = {"vocab_size"} if recorded.get("tokenizer") and current.get("tokenizer") \
                else set()
            diff = sorted(k for k in set(r) | set(c) if r.get(k) != c.get(k) and k not in skip)
            if not diff:
                continue
            out.append("model config " + ", ".join(f"{k}={r.get(k)!r}" for k in diff)
                       + " (this run: " + ", ".join(f"{k}={c.get(k)!r}" for k in diff)
                       + "); pass the same --config and --block-size")
        elif key == "data":
            same = " (the same source with other contents)" \
                if r.get("source") == c.get("source") else ""
            out.append(f"training data {r.get('source')} (this run: {c.get('source')}{same}); "
                       f"{_data_fix(r.get('source'))}")
    return out


def _resume_message(ckpt: Path, step: int, problems: list[str]) -> str:
    return (f"--resume: this run does not match the checkpoint in {ckpt} (step {step}), "
            f"which was trained with:\n  " + "\n  ".join(problems) + "\n"
            "These must stay the same on resume (the layout, --steps, --warmup, --lr and "
            "--grad-accum may change); match them, or start a new run with another --out.")


def _read_metrics(path: Path) -> tuple[list[dict], str | None]:
    """The records of ``metrics.jsonl`` and its torn last line (``None`` if whole).

    A last line that does not parse and has no newline after it is what a crash in the
    middle of a write leaves: it is returned, not raised. Old files with ``NaN`` tokens
    are read as Python floats.

    Raises:
        ValueError: a line elsewhere that is not a JSON object with an integer ``step``
            (names the file and the line number).
    """
    text = path.read_text(encoding="utf-8", errors="replace")
    lines = text.split("\n")
    records, torn = [], None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            if number == len(lines) and not text.endswith("\n"):
                torn = line
                continue
            raise ValueError(f"{path}, line {number}: not JSON ({e.msg}): {line[:80]!r}; "
                             f"repair or delete that line (one JSON object per line), or "
                             f"start a new run with another --out") from None
        if not isinstance(rec, dict) or not isinstance(rec.get("step"), int):
            raise ValueError(f"{path}, line {number}: not a metrics record (a JSON object "
                             f"with an integer \"step\"): {line[:80]!r}; repair or delete "
                             f"that line, or start a new run with another --out")
        records.append(rec)
    return records, torn


def _finished_message(out: Path, step: int, steps: int, given: bool,
                      sampled: bool) -> str | None:
    """``--resume`` of a run that already finished at ``step`` (its checkpoint's step):
    the error naming the last step and the ``--steps`` value (``given`` by the user, else
    the task's default), or ``None`` when the run is not finished.

    Finished means its outputs are complete: ``metrics.jsonl`` holds step ``step`` with a
    ``val_loss`` (the final evaluation ran), ``loss.png`` exists, and ``sample.txt`` when
    the run samples (``sampled``: a text model with ``--sample-tokens`` > 0). A run
    stopped between its final checkpoint and those outputs is not finished: a resume
    with ``--steps`` equal to its step completes them."""
    if step < steps:
        return None
    path = out / "metrics.jsonl"
    try:
        records, _ = _read_metrics(path) if path.exists() else ([], None)
    except ValueError:
        return None  # reported by the metrics check that follows
    last = next((r for r in reversed(records) if r["step"] == step), None)
    done = last is not None and last.get("val_loss") is not None and \
        (out / "loss.png").exists() and (not sampled or (out / "sample.txt").exists())
    if not done:
        return None
    value = f"--steps {steps}" if given else f"--steps {steps} (the default)"
    return (f"--resume: the run in {out} is finished: its last step is {step} (final "
            f"checkpoint, val_loss {last['val_loss']:.4f}, plot), and {value} is not past "
            f"it, so there is nothing to train; --steps must exceed the last step: give "
            f"--steps {step * 2} (or any number > {step}) to train on, or start a new run "
            f"with --out DIR or --overwrite")


def _refuse(parser: argparse.ArgumentParser, message: str) -> None:
    """Exit 2 with ``message`` alone: a refusal about the output folder, not the command
    line's syntax, so without argparse's usage block (which buried it)."""
    parser.exit(2, f"{parser.prog}: error: {message}\n")


def _resume_steps_hint(out: Path, steps: int) -> str:
    """For the refusal of a fresh run into a folder holding a run: when that run's
    metrics already reach ``steps``, ``--resume`` alone would be refused as finished;
    name the ``--steps`` that continues it (empty otherwise)."""
    try:
        records, _ = _read_metrics(out / "metrics.jsonl")
    except (OSError, ValueError):
        return ""
    last = max((r["step"] for r in records), default=0)
    if not last or last < steps or not _runlock.has_checkpoint(out / "ckpt"):
        return ""
    return (f". That run reached step {last} and --steps is {steps}: to train it on, give "
            f"--resume with --steps {last * 2} (or any number > {last})")


def _json_line(rec: dict) -> str:
    """One line of ``metrics.jsonl``: standard JSON, a non-finite number written as
    ``null`` (``allow_nan=False`` proves none is left)."""
    clean = {k: None if isinstance(v, float) and not math.isfinite(v) else v
             for k, v in rec.items()}
    return json.dumps(clean, allow_nan=False) + "\n"


def _finite(value: float, lo: float, hi: float = math.inf) -> bool:
    return math.isfinite(value) and lo <= value <= hi


def _validate(parser: argparse.ArgumentParser, args, spec, batch: int,
              out: Path) -> dict | None:
    """Check before any rank starts what would otherwise fail late (after training) or
    train on nonsense; each failure is ``parser.error`` (exit code 2) naming the value
    and the fix. See the module doc, "Checked before step 1". Returns this run's record
    (:func:`_run_record`) for the ``--resume`` checks, which :func:`main` makes once it
    holds the output folder's lock (:func:`_check_resume_args`); ``None`` when not
    needed."""
    d = TASK_DEFAULTS[spec.task]
    text_task = spec.task in ("lm", "mlm")
    steps = args.steps or d["steps"]
    if args.lr is not None and not (math.isfinite(args.lr) and args.lr > 0):
        parser.error(f"--lr {args.lr}: the learning rate must be a finite number > 0 "
                     f"(e.g. --lr {d['lr']:g}, this task's default)")
    if not _finite(args.min_lr_ratio, 0.0, 1.0):
        parser.error(f"--min-lr-ratio {args.min_lr_ratio}: the cosine decay ends at lr * "
                     f"this ratio; give a number in [0, 1] (default 0.1)")
    if args.weight_decay is not None and not _finite(args.weight_decay, 0.0):
        parser.error(f"--weight-decay {args.weight_decay}: give a finite number >= 0 "
                     f"(default {d['weight_decay']:g} for this task)")
    if not _finite(args.grad_clip, 0.0):
        parser.error(f"--grad-clip {args.grad_clip}: give a finite number >= 0 (0 turns "
                     f"clipping off; default 1.0)")
    if args.warmup is not None and args.warmup > steps:
        parser.error(f"--warmup {args.warmup} is longer than the run (--steps {steps}): the "
                     f"learning rate would never reach --lr; give --warmup {steps // 10} "
                     f"(a tenth) or at most {steps}")
    if not -2 ** 63 <= args.seed < 2 ** 64:
        parser.error(f"--seed {args.seed}: give an integer in [-2**63, 2**64) (torch's seed "
                     f"range)")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: this machine has no CUDA device (torch.cuda."
                     "is_available() is False); use --device cpu")
    if args.synthetic and args.data is not None:
        parser.error(f"--synthetic and --data {args.data!r} exclude each other; give one")
    if text_task and args.eval_batches == 0:
        parser.error(f"--eval-batches 0: {spec.name} validates on text batches; give "
                     f"--eval-batches 1 or more (default {d['eval_batches']}; --eval-every 0 "
                     f"validates only at the end)")
    sampling = spec.task == "lm" and args.sample_tokens > 0
    if sampling and not (math.isfinite(args.temperature) and args.temperature > 0):
        parser.error(f"--temperature {args.temperature}: sampling divides the logits by it; "
                     f"give a finite number > 0 (default 0.8; lower is more conservative), "
                     f"or --sample-tokens 0 for no sample")
    if out.exists() and not out.is_dir():
        parser.error(f"--out {str(out)!r} is a file; give a folder")
    from sbpflow.distributed import _state

    try:
        _state._env_timeout("SBPFLOW_TIMEOUT", _state.DEFAULT_TIMEOUT_S)
    except ValueError as e:
        parser.error(str(e))
    needed = ["matplotlib"] + ([] if args.no_progress else ["tqdm"])  # loss.png, the bar
    missing = [m for m in needed if importlib.util.find_spec(m) is None]
    if missing:
        parser.error(f"{' and '.join(missing)} not installed (needed for loss.png / the "
                     f"progress bar); pip install {' '.join(missing)}")
    try:
        over, block, _ = _model_overrides(spec, args)
        spec.configure(**over)  # the config's own checks (e.g. heads dividing the width)
    except ValueError as e:
        parser.error(str(e))
    if args.pp > 1:
        v = getattr(args, "virtual_stages", None) or 1
        try:
            spec.pipeline_stages(args.pp * v, **over)
        except ValueError as e:
            parser.error(f"--pp {args.pp}" + (f" --virtual-stages {v}" if v > 1 else "")
                         + f": {e}")
    record = None
    if text_task:
        from . import datasets as ds

        try:
            text = ds.synthetic_text(seed=args.seed) if args.synthetic \
                else ds.load_text(args.data)
        except (FileNotFoundError, ValueError) as e:
            parser.error(str(e))
        tok = ds.make_tokenizer(args.tokenizer, text.train)
        vocab = tok.vocab_size + (1 if spec.task == "mlm" else 0)  # + [MASK]
        over, block, _ = _model_overrides(spec, args, vocab)
        for split, part in (("training", text.train), ("validation", text.val)):
            n = len(tok.encode(part))
            if n < block + 1:
                smaller = f"--block-size {n - 1} or less, or " if n >= 2 else ""
                parser.error(
                    f"the {split} text of {text.source} has {n} tokens, fewer than one "
                    f"window of --block-size + 1 = {block + 1}; give {smaller}more text "
                    f"(the last 10% of a file, or the last tenth of a folder's files, "
                    f"validates)")
        if sampling and hasattr(tok, "chars"):
            unknown = sorted(set(args.prompt or "\n") - set(tok.chars))
            if unknown:
                parser.error(f"--prompt {args.prompt!r}: the characters {unknown} do not "
                             f"occur in the training text, so the char tokenizer cannot "
                             f"encode them; leave them out, or use --tokenizer byte")
        record = _run_record(spec, args, batch, block, over, tok,
                             {"source": text.source, "digest": _data_digest(text.train,
                                                                             text.val)})
    elif spec.task == "ctr":
        from . import datasets as ds

        try:
            ctr = ds.load_movielens(args.seed, args.data)
        except (FileNotFoundError, ValueError) as e:
            parser.error(str(e))
        if batch > len(ctr.train["label"]):
            parser.error(f"--batch-size {batch} is larger than the {len(ctr.train['label'])} "
                         f"training ratings; give --batch-size {len(ctr.train['label'])} or "
                         f"less")
        over, _, _ = _model_overrides(spec, args, ctr=ctr)
        record = _run_record(spec, args, batch, None, over, None, {
            "source": "movielens-100k", "digest": _ctr_digest(ctr)})
    elif args.resume:
        record = _run_record(spec, args, batch, None, None)
    return record


def _ctr_digest(ctr) -> str:
    return _data_digest(*(ctr.train[k] for k in sorted(ctr.train)))


def _samples(spec, args) -> bool:
    """Whether the run ends with a text sample (``sample.txt``)."""
    return spec.task == "lm" and args.sample_tokens > 0


def _check_resume_args(parser, out: Path, record: dict, steps: int, args,
                       spec) -> None:
    """``--resume``: the checkpoint's run against this one, its step against ``--steps``
    (a finished run needs more steps: :func:`_finished_message`; not checked on an
    elastic restart, which completes what is missing), and ``metrics.jsonl`` readable (a
    torn last line is dropped later, with a warning)."""
    import sbpflow

    ckpt = out / "ckpt"
    try:
        with warnings.catch_warnings():  # the ranks' own load warns (once is enough)
            warnings.simplefilter("ignore", sbpflow.checkpoint.CheckpointFallbackWarning)
            ck = sbpflow.load(ckpt)
    except (OSError, ValueError) as e:
        parser.error(f"--resume: cannot read the checkpoint in {ckpt}: {e}")
    step = int(ck["step"])
    recorded = ck.get("run") or {}
    problems = _resume_problems(recorded, record)
    if problems:
        parser.error(_resume_message(ckpt, step, problems))
    finished = None if getattr(args, "restarted", False) else _finished_message(
        out, step, steps, args.steps is not None, _samples(spec, args))
    if finished:
        _refuse(parser, finished)
    if step > steps:
        parser.error(f"--resume: the checkpoint in {ckpt} is at step {step}, past --steps "
                     f"{steps}; give --steps {step} or more")
    unchecked = [k for k in _RESUME_KEYS if recorded.get(k) is None and record.get(k)]
    if unchecked:
        print(f"note: the checkpoint in {ckpt} predates recording {', '.join(unchecked)}; "
              f"those are not checked against this run", file=sys.stderr, flush=True)
    if (out / "metrics.jsonl").exists():
        try:
            _read_metrics(out / "metrics.jsonl")
        except ValueError as e:
            parser.error(f"--resume: {e}")


def _check_pipeline(parser: argparse.ArgumentParser, args, spec) -> None:
    """``--pp``/``--schedule``: what cannot work is an error before any rank starts; with
    ``--pp`` > 1 ``--graph`` is turned on (``args.graph``; the trainer's first line says
    so) and ``args.schedule`` defaults to 1f1b. The model's split against its layers is
    checked in :func:`_validate`, with the ``--config`` overrides."""
    if args.virtual_stages is not None and args.schedule != "interleaved":
        parser.error(f"--virtual-stages {args.virtual_stages} is for --schedule interleaved "
                     f"(add it, or drop --virtual-stages)")
    if args.schedule == "interleaved":
        args.virtual_stages = args.virtual_stages or 2
    if args.pp == 1:
        if args.schedule is not None:
            parser.error(f"--schedule {args.schedule} orders the tasks of pipeline stages; "
                         f"it needs --pp 2 or more (drop --schedule, or add --pp)")
        return
    args.schedule = args.schedule or "1f1b"
    if args.schedule == "interleaved" and args.grad_accum % args.pp:
        up = -(-args.grad_accum // args.pp) * args.pp
        parser.error(f"--schedule interleaved: --micro-batches {args.grad_accum} must be a "
                     f"multiple of --pp {args.pp} (the chunks take micro-batches in groups "
                     f"of pp); e.g. --micro-batches {up}")
    if spec.pipeline_split is None:
        from sbpflow import models

        have = [n for n in models.names() if models.MODELS[n].pipeline_split is not None]
        parser.error(f"--pp {args.pp}: {spec.name} has no pipeline split (a {spec.family} "
                     f"model; ModelSpec.pipeline_split); models with one: {have}; or drop "
                     f"--pp")
    args.graph = True  # the pipeline's runtime


def _plan_mesh(dp: int | None, tp: int | None, world: int,
               plan: str | None = None) -> tuple[int, int]:
    """The mesh ``--plan`` searches on, as ``(rows, columns)``: a plan FILE's own mesh
    (``sbpflow plan`` may choose a 2-D one), else all ranks in a row unless ``--dp``/
    ``--tp`` say otherwise (the missing one derived).

    Raises:
        ValueError: a degree that does not divide the world, or a product that is not it;
            a plan FILE whose mesh does not hold the world's ranks.
    """
    if plan not in (None, "auto") and os.path.isfile(plan):
        from sbpflow.planner.auto import plan_mesh

        mesh = plan_mesh(plan, world)
        if (dp, tp) != (None, None) and (dp or world // (tp or 1),
                                         tp or world // (dp or 1)) != mesh:
            raise ValueError(f"--plan {plan} runs on its own mesh {list(mesh)} (rows, "
                             f"columns); --dp {dp} --tp {tp} asks for another: drop "
                             f"--dp/--tp")
        return mesh
    for flag, v in (("--dp", dp), ("--tp", tp)):
        if v is not None and world % v:
            raise ValueError(f"{flag} {v} does not divide the world size {world}")
    dp = dp or (world // tp if tp else world)
    tp = tp or world // dp
    if dp * tp != world:
        raise ValueError(f"--dp {dp} x --tp {tp} != world size {world}")
    return dp, tp


def _pipeline_plan_args(parser: argparse.ArgumentParser, args, spec,
                        argv: list[str] = ()) -> None:
    """``--plan FILE`` of a pipeline (``sbpflow plan --save`` of a pp row): run as the
    file's ``--pp``, ``--dp`` (its mesh), ``--tp 1``, ``--micro-batches`` and ``--schedule``
    (the pipeline layout below; ``args.plan`` is cleared). The file is checked against
    the run first, each error naming the file's entry: its ranks against the world
    (``--nproc-per-node``, or torchrun's), its stages against the model's split, its
    micro-batches against the batch. A flag the user also typed (``argv``) must agree
    with the file. A plan of layouts, or a file that is not a plan (:func:`_check_plan`
    reports it), is left alone. A batch other than the one the plan was priced for is
    said, not refused."""
    from sbpflow.planner.plan_file import pipeline_plan, pipeline_plan_file

    plan = pipeline_plan_file(args.plan)
    if plan is None:
        return
    pipe, dp = plan["pipeline"], (plan.get("mesh") or [1])[0]
    stages, m = pipe["stages"], pipe["micro_batches"]
    v = pipe.get("virtual_stages")
    where = f"--plan {args.plan}"
    typed = {a.split("=", 1)[0] for a in argv if a.startswith("--")}
    want = {("--pp",): ("pp", stages), ("--dp",): ("dp", dp), ("--tp",): ("tp", 1),
            ("--micro-batches", "--grad-accum"): ("grad_accum", m),
            ("--schedule",): ("schedule", pipe["schedule"]),
            ("--virtual-stages",): ("virtual_stages", v)}
    for flags, (attr, value) in want.items():
        flag = next((f for f in flags if f in typed), None)
        if flag is not None and getattr(args, attr) != value:
            said = f"{flags[0]} {value}" if value is not None else f"no {flags[0]}"
            parser.error(f"{where} is a pipeline ({said}); {flag} "
                         f"{getattr(args, attr)} contradicts it: drop {flag}")
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        world = int(os.environ["WORLD_SIZE"])
    else:
        world = args.nproc_per_node or stages * dp
    try:
        pipeline_plan(plan, world)
        spec.pipeline_stages(stages * (v or 1))
    except ValueError as e:
        chunks = f" x {v} model chunks a rank: {stages * v} parts of the model" if v else ""
        parser.error(f"{where} (a pipeline of {stages} stages{chunks}): {e}".replace(
            "auto-parallel plan a plan given as data: ", ""))
    batch = args.batch_size or TASK_DEFAULTS.get(spec.task, {}).get("batch_size", 0)
    if batch % m or (batch // m) % dp:
        unit, priced = m * dp, plan.get("global_batch")
        e_g = priced if priced and priced % unit == 0 else -(-batch // unit) * unit
        parser.error(f"{where}: its {m} micro-batches of {dp} data-parallel rank(s) each "
                     f"cannot split a batch of {batch} (each micro-batch must split evenly "
                     f"over the ranks of a stage); give --batch-size a multiple of {unit} "
                     f"(e.g. {e_g}{', the one it was priced for' if e_g == priced else ''}), "
                     f"or edit micro_batches in the file")
    for attr, value in want.values():
        setattr(args, attr, value)
    if os.environ.get("RANK") == "0" or ("RANK" not in os.environ
                                         and (args.nproc_per_node or 1) == 1):  # once
        priced = plan.get("global_batch")
        note = f"; it was priced for a global batch of {priced}, this run's is {batch}" \
            if priced and priced != batch else ""
        print(f"{where}: a pipeline of {stages} stages x {dp} data-parallel rank(s), {m} "
              f"micro-batches, {pipe['schedule']} (as --pp {stages} --dp {dp} --tp 1 "
              f"--micro-batches {m} --schedule {pipe['schedule']}"
              f"{f' --virtual-stages {v}' if v else ''}){note}", flush=True)
    args.plan = None


def _check_plan(parser: argparse.ArgumentParser, args, spec) -> None:
    """``--plan``: turns ``--graph`` on; refused with ``--pp`` (stages are not searched)
    and for a FILE that does not exist or is not a plan."""
    if args.plan is None:
        return
    if args.pp > 1:
        parser.error(f"--plan {args.plan} with --pp {args.pp}: pipeline stages are not "
                     f"searched; drop one of them")
    from sbpflow.planner.auto import plan_argument_error

    why = plan_argument_error(args.plan)
    if why:
        parser.error(why)
    args.graph = True


def main(argv: list[str] | None = None, prog: str = "sbpflow train") -> int:
    """Run ``sbpflow train``; returns the exit code (0 on success; 2 when a rank finds
    before step 1 that the options do not fit the data or checkpoint; 1 when a non-finite
    loss stops the run; a launched job's code otherwise).

    Everything the module doc lists under "Checked before step 1" is checked here
    (:func:`_validate`), before any rank is launched.

    Raises:
        SystemExit: ``--help`` (0); bad arguments (2, with a message naming the value and
            the fix: unknown model, missing data path, ``dp * tp`` not the world size, a
            learning rate or temperature that is not a finite positive number, a text
            shorter than one window, ``--resume`` with another seed, batch size,
            tokenizer or model config than the checkpoint's...).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    require_extra(prog)
    from sbpflow import models

    try:
        for plugin in args.plugin:
            _import_plugin(plugin)
    except (ImportError, FileNotFoundError) as e:
        parser.error(f"--plugin: {e}")
    try:
        spec = models.get(args.model)
    except ValueError as e:
        parser.error(str(e))
    if args.data is not None and not os.path.exists(args.data):
        parser.error(f"--data {args.data!r}: no such file or folder")
    if args.data is not None and spec.task == "image" and not os.path.isdir(args.data):
        parser.error(f"--data {args.data!r}: {spec.name} trains on images; give an "
                     f"ImageFolder directory (root/CLASS/*.png)")
    if spec.task == "ctr":
        if args.data is not None and not os.path.isdir(args.data):
            parser.error(f"--data {args.data!r}: {spec.name} trains on MovieLens-100k; give "
                         f"a folder holding ml-100k.inter, ml-100k.user and ml-100k.item, "
                         f"or drop --data (recbole's copy)")
        if args.synthetic:
            parser.error(f"--synthetic: {spec.name} trains on MovieLens-100k only; drop "
                         f"--synthetic (synthetic click data: `sbpflow bench dlrm`)")
    if spec.task not in TASK_DEFAULTS:
        job = " (a synthetic job: `sbpflow bench` and `sbpflow plan` run it)" \
            if spec.task == "face" else ""
        parser.error(f"{spec.name}: task {spec.task!r} is not trainable here{job}; tasks: "
                     f"{sorted(TASK_DEFAULTS)}")
    _pipeline_plan_args(parser, args, spec, argv)
    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if under_torchrun:
        world = int(os.environ["WORLD_SIZE"])
    elif args.nproc_per_node is not None:
        world = args.nproc_per_node
    elif args.dp is not None or args.tp is not None or args.pp > 1:
        world = (args.dp or 1) * (args.tp or 1) * args.pp
    else:
        world = 1
    try:
        dp, tp = _plan_mesh(args.dp, args.tp, world, args.plan) if args.plan is not None else \
            resolve_layout(spec, args.dp, args.tp, world, args.pp)
    except ValueError as e:
        parser.error(str(e))
    d = TASK_DEFAULTS[spec.task]
    batch = args.batch_size or d["batch_size"]
    _check_pipeline(parser, args, spec)
    _check_plan(parser, args, spec)
    if batch % args.grad_accum:
        parser.error(f"--batch-size {batch} is not divisible by --grad-accum "
                     f"{args.grad_accum}; each micro-batch has batch-size / grad-accum samples")
    if batch // args.grad_accum < dp:
        parser.error(f"a micro-batch of {batch // args.grad_accum} samples cannot be split over "
                     f"--dp {dp} ranks; raise --batch-size or lower --grad-accum")
    if args.compile and not args.graph:
        parser.error("--compile compiles the graph's per-rank program: add --graph")
    if args.graph and args.grad_accum > 1 and (batch // args.grad_accum) % dp:
        parser.error(f"--graph with --grad-accum {args.grad_accum}: each micro-batch of "
                     f"{batch // args.grad_accum} samples must split evenly over --dp {dp} "
                     f"ranks (the graph cuts each rank's shard); adjust --batch-size")
    out = Path(args.out or os.path.join("runs", spec.name))
    # An elastic restart (torchrun --max-restarts) continues from the newest checkpoint.
    restarted = under_torchrun and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0"
    if restarted and _runlock.has_checkpoint(out / "ckpt"):
        args.resume = True
    args.restarted = restarted
    if args.resume and args.overwrite:
        parser.error("--resume continues the run in --out, --overwrite deletes it: give one")
    restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0) if under_torchrun \
        else args.max_restarts
    if under_torchrun and args.max_restarts != restarts:
        parser.error(f"--max-restarts {args.max_restarts}: these ranks were started by "
                     f"torchrun with --max-restarts {restarts}; restarts are the launcher's: "
                     f"sbpflow launch --max-restarts N ... -m sbpflow.apps.train ...")
    if args.ckpt_every is None:
        args.ckpt_every = default_ckpt_every(args.steps or d["steps"])
    record = _validate(parser, args, spec, batch, out)
    # The output folder's lock (sbpflow.apps._runlock): held by this process (the launcher, or
    # the only process), or by rank 0 under a plain torchrun; not again by the ranks of
    # a launcher that holds it for them (verified: its pid, host and nonce).
    handed, why = _runlock.handed_off(out) if under_torchrun else (False, None)
    if not under_torchrun and os.environ.get(_runlock.HELD_ENV):
        why = "this process was not started by a launcher (RANK/WORLD_SIZE unset)"
    if why and os.environ.get("RANK", "0") == "0":
        print(f"warning: ignoring {_runlock.HELD_ENV}={os.environ.get(_runlock.HELD_ENV)!r}: "
              f"{why}. sbpflow train's launcher sets it for its own ranks; this run takes "
              f"the lock of {out} itself. Unset it (and {_runlock.NONCE_ENV})",
              file=sys.stderr, flush=True)
    lock = None
    if not handed and (not under_torchrun or os.environ["RANK"] == "0"):
        try:
            lock = _runlock.claim_output(out, resume=args.resume, overwrite=args.overwrite,
                                         take_over=args.take_over, restarted=restarted,
                                         command=[*prog.split(), *argv])
        except _runlock.RunLockedError as e:
            _refuse(parser, str(e))
        except FileExistsError as e:
            _refuse(parser, f"{e}{_resume_steps_hint(out, args.steps or d['steps'])}.")
    try:
        # under the lock: another run cannot be writing the checkpoint meanwhile
        if args.resume:
            if not _runlock.has_checkpoint(out / "ckpt"):
                _refuse(parser, _no_checkpoint_message(out))
            _check_resume_args(parser, out, record, args.steps or d["steps"], args, spec)
        plain = under_torchrun and not handed
        if not under_torchrun and (world > 1 or args.max_restarts):
            from sbpflow.distributed import launch

            return launch.main(["--standalone", "--nproc-per-node", str(world),
                                "--max-restarts", str(args.max_restarts), "-m",
                                "sbpflow.apps.train", *argv], prog=prog, env=lock.handoff_env(),
                               after_signal=lambda: _what_works(out, prog, argv, world,
                                                                plain), reported=True)
        command = _resume_command(prog, argv, world, plain)
        from sbpflow.planner.auto import MemoryLimitError, PlanError
        from sbpflow.planner.hardware import ProfileError

        try:
            return _Trainer(args, spec, dp, tp, out, resume_command=command).run()
        except (PlanError, MemoryLimitError, ProfileError) as e:  # every rank alike: one
            # line, rank 0's
            from sbpflow.distributed.launch import REPORTED_EXIT

            if os.environ.get("RANK", "0") == "0":
                # (on a line of its own: rank 0's progress bar may be mid-line)
                print(f"\n{prog}: error: --plan {args.plan}: {e}", file=sys.stderr, flush=True)
            return REPORTED_EXIT if under_torchrun else 1
        except KeyboardInterrupt:
            # Ctrl-C outside the steps (start-up, the final evaluation, plot and sample) or
            # a second Ctrl-C: no traceback; rank 0 names the command that continues.
            if os.environ.get("RANK", "0") == "0":
                print(_interrupt_message(out, prog, argv, world, plain), file=sys.stderr,
                      flush=True)
            return 128 + signal.SIGINT
    finally:
        if lock is not None:
            lock.release()


def default_ckpt_every(steps: int) -> int:
    """The checkpoint interval when ``--ckpt-every`` is not given: a tenth of the run."""
    return max(1, steps // 10)


def _no_checkpoint_message(out: Path) -> str:
    """``--resume`` into a folder without a checkpoint: what is there and what works."""
    found = _runlock.existing_run(out)
    if found:
        return (f"--resume: no checkpoint in {out / 'ckpt'}: the run in {out} ({found}) "
                f"stopped before its first checkpoint, so there is nothing to continue "
                f"from; start it over with --overwrite instead of --resume (deletes its "
                f"outputs), or start a new run with another --out")
    return (f"--resume: no checkpoint in {out / 'ckpt'}, and {out} holds no run: start "
            f"without --resume, or give the --out of the run to continue")


def _interrupt_message(out: Path, prog: str, argv: list[str], world: int,
                       plain_torchrun: bool) -> str:
    """What ``sbpflow train`` prints when Ctrl-C stops it outside a step (rank 0)."""
    return "sbpflow train: interrupted (SIGINT)" + _what_works(out, prog, argv, world,
                                                                plain_torchrun)


def _what_works(out: Path, prog: str, argv: list[str], world: int,
                plain_torchrun: bool) -> str:
    """After an interrupted run: "; the newest checkpoint ... continue the run with: CMD"
    (:func:`_resume_command`), or, without a checkpoint, " before the run's first
    checkpoint; ... start it again with: CMD" (``--overwrite`` added where the folder
    holds a run)."""
    if _runlock.has_checkpoint(out / "ckpt"):
        return (f"; the newest checkpoint in {out / 'ckpt'} is kept; continue the run "
                f"with: {_resume_command(prog, argv, world, plain_torchrun)}")
    overwrite = bool(_runlock.existing_run(out)) and "--overwrite" not in argv
    how = _rerun_command(prog, argv, world, plain_torchrun, drop=("--resume", "--take-over"),
                         add=("--overwrite",) if overwrite else ())
    return (f" before the run's first checkpoint; nothing to continue from; start it "
            f"again with: {how}")


def _resume_command(prog: str, argv: list[str], world: int, plain_torchrun: bool) -> str:
    """The command that continues this run (``argv`` with ``--resume``, without
    ``--overwrite``/``--take-over``): see :func:`_rerun_command`."""
    return _rerun_command(prog, argv, world, plain_torchrun,
                          drop=("--overwrite", "--take-over"), add=("--resume",))


def _rerun_command(prog: str, argv: list[str], world: int, plain_torchrun: bool, *,
                   drop: tuple[str, ...], add: tuple[str, ...]) -> str:
    """This run's command with the flags ``drop`` removed and ``add`` added: ``prog
    ARGS``, or under a plain torchrun, which this process cannot rerun, the user's launch
    command (with what to add, and an ``sbpflow launch`` example)."""
    words = [w for w in argv if w not in drop]
    words += [w for w in add if w not in words]
    if plain_torchrun:
        if not add:
            return "your launch command"
        return (f"your launch command with {' '.join(add)} added, e.g. " + shlex.join(
            ["sbpflow", "launch", "--nproc-per-node", str(world), "-m", "sbpflow.apps.train",
             *words]))
    return shlex.join([*prog.split(), *words])


# ----------------------------------------------------------------------------- training
class _StopRequest:
    """SIGINT or SIGTERM during training, acted on at the next step boundary.

    Inside ``with`` (the main thread only; Python delivers signals there) the first
    SIGINT/SIGTERM is recorded and the previous handlers come back, so a second signal
    acts at once (SIGINT: ``KeyboardInterrupt``; SIGTERM: the default, terminate). At
    each step boundary every rank calls :meth:`agreed` (an all-reduce of one int: the
    ranks may see the signal at different steps), so that they stop at the same step
    and save the checkpoint together.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.signum = 0
        self._saved: dict = {}

    def _handler(self, signum, frame) -> None:
        self.signum = self.signum or signum
        self._restore()

    def _restore(self) -> None:
        for sig, handler in self._saved.items():
            signal.signal(sig, handler)
        self._saved.clear()

    def __enter__(self) -> _StopRequest:
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._saved[sig] = signal.signal(sig, self._handler)
        return self

    def __exit__(self, *exc) -> None:
        self._restore()

    def agreed(self, world: int) -> int:
        """The signal number some rank received (0: none); collective over the world."""
        if world == 1:
            return self.signum
        from sbpflow import distributed as sd

        flag = torch.tensor([self.signum], dtype=torch.int64)
        return int(sd.all_reduce(flag, tuple(range(world)), op="max").item())


class _Interrupted(Exception):
    """Every rank agreed to stop after step ``step`` (signal ``signum``)."""

    def __init__(self, signum: int, step: int, saved: bool):
        super().__init__(signum, step)
        self.signum, self.step, self.saved = signum, step, saved


class _Trainer:
    def __init__(self, args, spec, dp: int, tp: int, out: Path,
                 resume_command: str | None = None):
        import sbpflow
        from sbpflow import distributed as sd

        self.sbpflow = sbpflow
        self.args, self.spec, self.dp, self.tp, self.out = args, spec, dp, tp, out
        d = TASK_DEFAULTS[spec.task]
        self.steps = args.steps or d["steps"]
        self.batch = args.batch_size or d["batch_size"]
        self.micro = self.batch // args.grad_accum
        self.lr = args.lr if args.lr is not None else d["lr"]
        self.warmup = args.warmup if args.warmup is not None else \
            min(d["warmup"], self.steps // 10)
        self.weight_decay = args.weight_decay if args.weight_decay is not None \
            else d["weight_decay"]
        self.eval_every = args.eval_every if args.eval_every is not None else d["eval_every"]
        self.eval_batches = args.eval_batches if args.eval_batches is not None \
            else d["eval_batches"]
        self.rank, self.world = sd.get_rank(), sd.get_world_size()
        self.is_main = self.rank == 0
        self.pp = pp = getattr(args, "pp", 1)
        if dp * tp * pp != self.world:
            raise ValueError(f"--dp {dp} x --tp {tp} x --pp {pp} != world size {self.world}")
        from sbpflow.sbp import broadcast, split

        # Stage s holds ranks [s*dp*tp, (s+1)*dp*tp), laid out as the dp x tp mesh.
        width = dp * tp
        self.pls = []
        for s in range(pp):
            ranks = np.arange(s * width, (s + 1) * width)
            self.pls.append(sbpflow.placement(args.device, ranks.reshape(dp, tp).tolist()
                                              if dp > 1 and tp > 1 else ranks.tolist()))
        if getattr(args, "plan", None) is not None:  # every rank the whole batch: the
            # plan lays the inputs out (boxing a broadcast batch to a split is a slice)
            self.data_sbp = (broadcast,) * self.pls[0].ndim
        elif dp > 1 and tp > 1:
            self.data_sbp = (split(0), broadcast)
        else:
            self.data_sbp = (broadcast,) if tp > 1 else (split(0),)
        # the first stage's placement: the inputs, the model's own tensors (positions),
        # the sample; the last stage's: the targets (the loss is computed there)
        self.pl, self.pl_last = self.pls[0], self.pls[-1]
        self.layout = f"dp{dp}xtp{tp}" if dp > 1 and tp > 1 else ("tp" if tp > 1 else "dp")
        if pp > 1:
            inner = {"dp": f"dp{dp}", "tp": f"tp{tp}"}.get(self.layout, self.layout)
            self.layout = f"pp{pp}" + ("" if width == 1 else f"x{inner}")
        if getattr(args, "plan", None) is not None:
            self.layout = "auto" if args.plan == "auto" else f"plan {args.plan}"
        self.ckpt_metrics = None  # the metrics record a restored checkpoint holds
        self.saved_step = None  # the step of the newest checkpoint of this run
        self.bar = None
        self.stop = _StopRequest()
        self.resume_command = resume_command or "sbpflow train ... --resume"

    # -- output on rank 0 ---------------------------------------------------------------
    def log(self, msg: str) -> None:
        if self.is_main:
            if self.bar is not None:
                self.bar.write(msg)
            else:
                print(msg, flush=True)

    # -- data ---------------------------------------------------------------------------
    def setup_data(self) -> dict:
        from . import datasets as ds

        a, task = self.args, self.spec.task
        if task in ("lm", "mlm"):
            text = ds.synthetic_text(seed=a.seed) if a.synthetic else ds.load_text(a.data)
            self.tok = ds.make_tokenizer(a.tokenizer, text.train)
            self.train_tokens = self.tok.encode(text.train)
            self.val_tokens = self.tok.encode(text.val)
            self.vocab = self.tok.vocab_size + (1 if task == "mlm" else 0)  # + [MASK]
            self.data_record = {"source": text.source,
                                "digest": _data_digest(text.train, text.val)}
            return {"source": text.source, "train_chars": len(text.train),
                    "val_chars": len(text.val), "val_parts": list(text.val_parts),
                    "tokenizer": self.tok.to_json(), "vocab_size": self.vocab}
        if task == "ctr":
            self.ctr = ctr = ds.load_movielens(a.seed, a.data)
            self.data_record = {"source": "movielens-100k", "digest": _ctr_digest(ctr)}
            return {"source": ctr.source, "train_samples": len(ctr.train["label"]),
                    "val_samples": len(ctr.val["label"]), "test_samples":
                    len(ctr.test["label"]), "positive_rate": ctr.positive_rate,
                    "sparse": list(ctr.sparse_names), "vocab_sizes": list(ctr.vocab_sizes),
                    "bag": ctr.bag_name, "bag_vocab": ctr.bag_vocab,
                    "dense": list(ctr.dense_names)}
        imgs = ds.synthetic_images(seed=a.seed) if a.synthetic else \
            ds.load_images(a.data, a.image_size)
        self.images = imgs
        self.data_record = {"source": imgs.source,
                            "digest": _data_digest(imgs.train_x, imgs.train_y)}
        if self.batch > len(imgs.train_y):
            raise _RunError(f"--batch-size {self.batch} is larger than the "
                            f"{len(imgs.train_y)} training images of {imgs.source}; give "
                            f"--batch-size {len(imgs.train_y)} or less")
        return {"source": imgs.source, "train_images": len(imgs.train_y),
                "val_images": len(imgs.val_y), "classes": list(imgs.classes),
                "image_shape": list(imgs.train_x.shape[1:])}

    def _to_global(self, t: torch.Tensor, pl=None):
        """This rank's part of the global batch ``t`` (dim 0), as a global tensor on ``pl``
        (default: the first stage's placement; a rank outside it holds nothing)."""
        from sbpflow.placement import shard_slices
        from sbpflow.utils.data import to_global_batch

        pl = self.pl if pl is None else pl
        sl = shard_slices((t.shape[0],), pl.shape, self.data_sbp, pl.coord())[0]
        local = t[sl].to(pl.device)
        return to_global_batch(local, pl, self.data_sbp, global_size=t.shape[0])

    def _globals(self, x, y: torch.Tensor):
        """The inputs (a tensor, or a tuple of them: ``ctr``) on the first stage's
        placement, the targets on the last's."""
        xs = tuple(map(self._to_global, x)) if isinstance(x, tuple) else self._to_global(x)
        return xs, self._to_global(y, self.pl_last)

    def _mlm_mask(self, x: torch.Tensor, seed_parts) -> tuple[torch.Tensor, torch.Tensor]:
        from .datasets import mask_tokens, step_seed

        return mask_tokens(x, self.tok.vocab_size, self.tok.vocab_size, step_seed(*seed_parts))

    def micro_batches(self, step: int):
        """The global batch of ``step`` as ``grad_accum`` micro-batches of torch tensors."""
        from . import datasets as ds

        a, task = self.args, self.spec.task
        if task in ("lm", "mlm"):
            x, y = ds.text_batch(self.train_tokens, self.batch, self.block, a.seed, "train",
                                 step)
            if task == "mlm":
                x, y = self._mlm_mask(x, (a.seed, "mask", "train", step))
        elif task == "ctr":
            idx = ds.ctr_batch(len(self.ctr.train["label"]), self.batch, a.seed, step)
            x, y = self._ctr_inputs(self.ctr.train, idx), self.ctr.train["label"][idx]
        else:
            idx = ds.image_batch(len(self.images.train_y), self.batch, a.seed, step)
            x, y = self.images.train_x[idx], self.images.train_y[idx]
        if isinstance(x, tuple):
            return [(tuple(t[i:i + self.micro] for t in x), y[i:i + self.micro])
                    for i in range(0, self.batch, self.micro)]
        return [(x[i:i + self.micro], y[i:i + self.micro])
                for i in range(0, self.batch, self.micro)]

    @staticmethod
    def _ctr_inputs(part: dict, idx) -> tuple:
        """The ``ctr`` model's inputs ``(dense, sparse, bag, bag_weights)`` of samples
        ``idx`` (a tensor of indices or a slice) of a split."""
        return tuple(part[k][idx] for k in ("dense", "sparse", "bag", "bag_weights"))

    def _graph_batch(self, parts):
        """The step's micro-batches as one batch for the graph, ordered so that the graph's
        micro-batches (each rank's shard cut into ``grad_accum`` parts) are the eager
        loop's: rank ``r``'s shard holds its slice of micro-batch 0, then of 1, ..."""
        if len(parts) == 1:
            return parts[0]
        s = self.micro // self.dp
        rows = [torch.cat([p[j][r * s:(r + 1) * s] for p in parts]) for j in (0, 1)
                for r in range(self.dp)]
        return torch.cat(rows[:self.dp]), torch.cat(rows[self.dp:])

    def _make_graph(self):
        """The training step as an :class:`sbpflow.nn.Graph` (``--graph``): forward and
        backward of each micro-batch, gradient clipping, the AdamW update. With ``--pp``
        the model's modules are in stages (:meth:`setup_model`) and the micro-batches run
        as a pipeline in ``--schedule``'s order."""
        trainer, a = self, self.args
        if a.grad_clip > 0:
            for g in self.opt.param_groups:  # clipped together by their joint norm
                g["clip_grad_max_norm"], g["clip_grad_norm_type"] = a.grad_clip, 2.0

        class TrainStep(self.sbpflow.nn.Graph):
            def __init__(self):
                super().__init__()
                self.model = trainer.model
                self.add_optimizer(trainer.opt)
                self.config.set_gradient_accumulation_steps(a.grad_accum)
                if trainer.pp > 1:
                    self.config.set_pipeline_schedule(
                        a.schedule, virtual_stages=a.virtual_stages or 1)
                if trainer.amp_dtype is not None:
                    self.config.enable_amp(True, dtype=trainer.amp_dtype)
                if a.amp == "fp16":
                    self.set_grad_scaler(trainer.scaler)
                self.config.enable_compile(a.compile)
                if a.plan is not None:
                    self.config.enable_auto_parallel(True)
                    if a.plan != "auto":
                        self.config.set_auto_parallel_plan(a.plan)

            def build(self, x, y):
                loss, _ = trainer.forward(x, y)
                loss.backward()
                return loss

        return TrainStep()

    def val_batches(self):
        """The validation samples, in pieces of at most a micro-batch (the memory a
        training step needs). Which samples does not depend on ``--grad-accum``: text
        scores ``--eval-batches`` batches of ``--batch-size`` windows (each cut into
        micro-batches), images and ``ctr`` the whole validation split."""
        from . import datasets as ds

        a, task = self.args, self.spec.task
        if task in ("lm", "mlm"):
            for i in range(max(1, self.eval_batches)):
                x, y = ds.text_batch(self.val_tokens, self.batch, self.block, a.seed, "val", i)
                if task == "mlm":
                    x, y = self._mlm_mask(x, (a.seed, "mask", "val", i))
                for j in range(0, self.batch, self.micro):
                    yield x[j:j + self.micro], y[j:j + self.micro]
        elif task == "ctr":
            n = len(self.ctr.val["label"])
            step = max(self.micro, 4096)  # the whole split in few lookups
            for i in range(0, n, step):
                sl = slice(i, min(i + step, n))
                yield self._ctr_inputs(self.ctr.val, sl), self.ctr.val["label"][sl]
        else:
            n = len(self.images.val_y)
            for i in range(0, n, self.micro):
                yield self.images.val_x[i:i + self.micro], self.images.val_y[i:i + self.micro]

    # -- model --------------------------------------------------------------------------
    def setup_model(self) -> None:
        sbpflow, spec, a = self.sbpflow, self.spec, self.args
        over, self.block, self.repeat_channels = _model_overrides(
            spec, a, getattr(self, "vocab", None), getattr(self, "images", None),
            getattr(self, "ctr", None))
        self.model_overrides = over
        sbpflow.manual_seed(a.seed)
        model = spec.build(**over)
        from sbpflow.nn.parallel import parallelize_module

        if a.plan is not None:  # broadcast: every layout free for the plan
            model.to_global(self.pl, sbpflow.sbp.broadcast)
        else:
            parallelize_module(model, self.pl, spec.plan("tp" if self.tp > 1 else "dp"),
                               tp_axis=-1)
        self.stages = None
        if self.pp > 1:
            # each stage's modules move to its placement, their layout kept (the meshes
            # have one shape); a weight tied across stages stays with the lowest
            from sbpflow.graph import GraphModule

            v = a.virtual_stages or 1  # interleaved: stage s on rank group s % pp
            self.stages = spec.pipeline_stages(self.pp * v, **over)
            for s, names in enumerate(self.stages):
                for name in names:
                    model.get_submodule(name).to(GraphModule).set_stage(
                        s, self.pls[s % self.pp])
        self.model = model
        self.n_params = sum(int(np.prod(p.shape)) for p in model.parameters())
        decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
        no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
        groups = [{"params": decay, "weight_decay": self.weight_decay},
                  {"params": no_decay, "weight_decay": 0.0}]
        groups = [g for g in groups if g["params"]]
        self.group_decay = [g["weight_decay"] for g in groups]
        self.opt = sbpflow.optim.AdamW(groups, lr=self.lr, betas=(0.9, 0.95))
        self.schedule = _Schedule(self.warmup, self.steps, a.min_lr_ratio)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, self.schedule)
        self.scaler = sbpflow.amp.GradScaler(a.device, enabled=a.amp == "fp16")
        self.amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(a.amp)

    def autocast(self):
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return self.sbpflow.autocast(device_type=self.args.device, dtype=self.amp_dtype)

    def forward(self, x, y):
        """Loss (a global scalar) and the logits (images: (N, classes); ctr: (N,))."""
        F = self.sbpflow.nn.functional
        with self.autocast(), self.sbpflow.default_placement(self.pl):
            if self.spec.task in ("lm", "mlm"):
                logits, loss = self.model(x, y)
            elif self.spec.task == "ctr":
                logits = self.model(*x)  # (N,) one logit of a click per sample
                loss = F.binary_cross_entropy_with_logits(logits.float(), y)
            else:
                if self.repeat_channels:
                    x = x.expand(-1, 3, -1, -1)
                logits = self.model(x)
                loss = F.cross_entropy(logits.float(), y)
        return loss.float(), logits

    # -- checkpoints --------------------------------------------------------------------
    def run_record(self) -> dict:
        """This run as its checkpoints record it (see :func:`_resume_problems`)."""
        return _run_record(self.spec, self.args, self.batch, self.block, self.model_overrides,
                           getattr(self, "tok", None), self.data_record, self.layout)

    def save(self, step: int, rec: dict | None = None) -> None:
        """Checkpoint after ``step`` steps; ``rec`` is that step's metrics record, kept so
        that a resume can write the final step's line if the run stopped before it."""
        state = {"model": self.model.state_dict(), "optim": self.opt.state_dict(),
                 "sched": self.sched.state_dict(), "scaler": self.scaler.state_dict(),
                 "rng": torch.get_rng_state(), "step": step, "run": self.run_record(),
                 "metrics": rec}
        self.sbpflow.save(state, self.out / "ckpt", keep=2)
        self.saved_step = step

    def restore(self) -> int:
        """Load ``OUT/ckpt`` into the model, optimizer, schedule, scaler and RNG; returns
        its step.

        Raises:
            _RunError: the checkpoint's run differs from this one in what must stay the
                same (:func:`_resume_problems`), the run is finished and ``--steps`` does
                not exceed its last step (:func:`_finished_message`), or its step is past
                ``--steps``; raised before anything is loaded.
        """
        ckpt = self.out / "ckpt"
        ck = self.sbpflow.load(ckpt)
        step = int(ck["step"])
        problems = _resume_problems(ck.get("run") or {}, self.run_record())
        if problems:
            raise _RunError(_resume_message(ckpt, step, problems))
        finished = None if getattr(self.args, "restarted", False) else _finished_message(
            self.out, step, self.steps, self.args.steps is not None,
            _samples(self.spec, self.args))
        if finished:
            raise _RunError(finished)
        if step > self.steps:
            raise _RunError(f"--resume: the checkpoint in {ckpt} is at step {step}, past "
                            f"--steps {self.steps}; give --steps {step} or more")
        self.model.load_state_dict(ck["model"])
        self.opt.load_state_dict(ck["optim"])
        mine = dict(self.schedule.__dict__)  # this run's --steps/--warmup/--min-lr-ratio
        self.sched.load_state_dict(ck["sched"])
        # LambdaLR restores its multiplier's attributes (into this run's _Schedule object
        # itself) and base LRs, the optimizer its groups' LR and weight decay; this run's
        # options win (the same unless --steps, --warmup, --min-lr-ratio, --lr or
        # --weight-decay changed, which then reshape the rest of the curve from the next
        # step on; found by the fresh-user trial: a run extended with --steps kept the
        # checkpoint's curve, at the minimum learning rate)
        self.schedule.__dict__.update(mine)
        self.sched.lr_lambdas[0].__dict__.update(mine)
        self.sched.base_lrs = [self.lr for _ in self.opt.param_groups]
        lr = self.lr * self.schedule(self.sched.last_epoch)
        for g, wd in zip(self.opt.param_groups, self.group_decay):
            g.update(initial_lr=self.lr, lr=lr, weight_decay=wd)
        self.sched._last_lr = [lr for _ in self.opt.param_groups]
        if ck["scaler"]:
            self.scaler.load_state_dict(ck["scaler"])
        torch.set_rng_state(ck["rng"].full())
        self.ckpt_metrics = ck.get("metrics")
        self.saved_step = step
        return step

    # -- evaluation ---------------------------------------------------------------------
    def evaluate(self) -> dict:
        """The validation metrics (collective): ``val_loss``, the mean loss over the
        samples of :meth:`val_batches` (text: over their scored tokens, every token for
        ``lm``, the masked ones for ``mlm``; so the same whatever the pieces), and
        ``val_acc`` (images) or ``val_auc``/``val_logloss`` (``ctr``)."""
        self.model.eval()
        total, count, correct = 0.0, 0, 0
        scores, labels = [], []
        text = self.spec.task in ("lm", "mlm")
        with torch.no_grad():
            for x, y in self.val_batches():
                xs, ys = self._globals(x, y)  # eagerly the stages run one after another
                loss, logits = self.forward(xs, ys)
                # the loss is a mean over the piece's scored targets (text: labels >= 0;
                # -100/-1 are the models' ignore_index); a piece with none (mlm: no
                # token masked) has a NaN mean and weight 0
                n = int((y >= 0).sum()) if text else len(y)
                value = float(loss.item())
                if n:
                    total += value * n
                    count += n
                if self.spec.task == "image":
                    pred = np.asarray(logits.float().numpy()).argmax(-1)
                    correct += int((torch.from_numpy(pred) == y).sum())
                elif self.spec.task == "ctr":
                    scores.append(torch.from_numpy(np.asarray(logits.float().numpy())))
                    labels.append(y)
        self.model.train()
        out = {"val_loss": total / max(count, 1)}
        if self.spec.task == "image":
            out["val_acc"] = correct / max(count, 1)
        elif self.spec.task == "ctr":
            from .metrics import log_loss, roc_auc

            s, y = torch.cat(scores), torch.cat(labels)
            out["val_auc"] = roc_auc(s, y)
            out["val_logloss"] = log_loss(s, y)
        return out

    def sample(self) -> str | None:
        a = self.args
        if self.spec.task != "lm" or a.sample_tokens == 0 or not hasattr(self.model, "generate"):
            return None
        self.model.eval()
        ids = self.tok.encode(a.prompt or "\n")[None, :].to(self.pl.device)
        idx = self.sbpflow.tensor(ids, placement=self.pl,
                                  sbp=tuple(self.sbpflow.sbp.broadcast for _ in self.pl.shape))
        with torch.no_grad(), self.sbpflow.default_placement(self.pl), \
                self._outputs_on_first_stage():
            out = self.model.generate(idx, a.sample_tokens, temperature=a.temperature)
        self.model.train()
        return self.tok.decode(np.asarray(out.numpy())[0].tolist())

    @contextlib.contextmanager
    def _outputs_on_first_stage(self):
        """With ``--pp``: the model's outputs (the logits, made on the last stage) come
        back to the first stage's placement, where the prompt lives, so that a generation
        loop (sample, ``cat`` with the tokens so far) runs there as without stages."""
        if self.pp == 1:
            yield
            return
        from torch.utils import _pytree as pytree

        from sbpflow.runtime.stages import stage_placement_sbp

        pl = self.pl

        def back(x):
            if isinstance(x, self.sbpflow.Tensor) and x.is_global and x.placement != pl:
                return x.to_global(pl, stage_placement_sbp(x, pl))
            return x

        hook = self.model.register_forward_hook(lambda mod, args, out: pytree.tree_map(
            back, out))
        try:
            yield
        finally:
            hook.remove()

    # -- outputs ------------------------------------------------------------------------
    def _metrics_start(self, start: int) -> tuple:
        """Open ``metrics.jsonl`` for this run (rank 0): on resume keep the lines up to
        step ``start`` (a torn last line, left by a crash mid-write, is dropped with a
        warning). Returns the file and, when resuming at the end (``start == steps``:
        the final checkpoint exists, the final line may not), the final step's record to
        complete (that line, else the record the checkpoint holds); otherwise ``None``."""
        path = self.out / "metrics.jsonl"
        kept = []
        if start > 0 and path.exists():
            records, torn = _read_metrics(path)
            if torn is not None:
                print(f"warning: {path}: dropped a torn last line (a crash in the middle of "
                      f"a write): {torn[:80]!r}", file=sys.stderr, flush=True)
            kept = [r for r in records if r["step"] <= start]
        final = None
        if start == self.steps:
            if kept and kept[-1]["step"] == start:
                final = kept.pop()
            else:
                final = dict(self.ckpt_metrics or {"step": start})
        elif start > 0 and (not kept or kept[-1]["step"] < start) and \
                (self.ckpt_metrics or {}).get("step") == start:
            kept.append(dict(self.ckpt_metrics))  # the checkpoint's own line was torn
        with open(path, "w") as f:
            f.writelines(_json_line(rec) for rec in kept)
        self.history = kept
        return open(path, "a"), final

    def _write(self, metrics, rec: dict) -> None:
        metrics.write(_json_line(rec))
        metrics.flush()
        self.history.append(rec)

    def plot(self) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        def val(x):
            return math.nan if x is None else x

        steps = [r["step"] for r in self.history]
        fig, ax = plt.subplots(figsize=(7, 4.5))
        ax.plot(steps, [val(r.get("loss")) for r in self.history], lw=1, label="train loss")
        evals = [(r["step"], val(r["val_loss"])) for r in self.history if "val_loss" in r]
        if evals:
            ax.plot(*zip(*evals), "o-", label="validation loss")
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("cross-entropy (nats)")
        aucs = [(r["step"], val(r["val_auc"])) for r in self.history if "val_auc" in r]
        if aucs:  # ctr: the validation AUC on its own axis
            ax2 = ax.twinx()
            ax2.plot(*zip(*aucs), "s--", color="tab:green", label="validation AUC")
            ax2.set_ylabel("validation AUC")
            ax2.legend(loc="center right")
        ax.set_title(f"sbpflow train {self.spec.name} ({self.layout}, {self.world} "
                     f"rank{'s' if self.world > 1 else ''}, "
                     f"batch {self.batch})")
        ax.grid(alpha=0.3)
        ax.legend(loc="lower left" if aucs else "best")
        fig.tight_layout()
        fig.savefig(self.out / "loss.png", dpi=110)
        plt.close(fig)

    # -- the loop -----------------------------------------------------------------------
    def run(self) -> int:
        """Train (see the module doc); returns the exit code. A :class:`_RunError` is
        reported once, by rank 0, as ``prog: error: ...``; every rank returns its code."""
        try:
            return self._run()
        except _RunError as e:
            if self.bar is not None:
                self.bar.close()
            if self.is_main:
                print(f"sbpflow train: error: {e}", file=sys.stderr, flush=True)
            else:
                # Every rank raises it at the same point; give rank 0 time to report
                # before the launcher sees this rank exit and stops the others.
                time.sleep(1.0)
            return e.code

    def _nonfinite(self, done: int, loss_val: float, lr: float) -> None:
        """A non-finite training loss at step ``done`` (the same on every rank). fp32 and
        bf16: stop before the optimizer step (the weights stay those of the step before).
        fp16: the GradScaler skips the step (its gradients are not finite) and lowers
        the scale; :data:`_FP16_NONFINITE_LIMIT` such steps in a row stop the run."""
        a = self.args
        if a.amp == "fp16":
            self.nonfinite_run += 1
            self.log(f"step {done}: loss {loss_val} in fp16; the GradScaler skips this step")
            if self.nonfinite_run < _FP16_NONFINITE_LIMIT:
                return
            why = (f"{self.nonfinite_run} steps in a row up to step {done} had a non-finite "
                   f"fp16 loss ({loss_val}), which lowering the loss scale does not cure")
            fix = (f"lower --lr (this run: {self.lr:g}), or use --amp bf16 (fp16's range "
                   f"ends at 65504) or no --amp")
        else:
            why = f"step {done}: the training loss is {loss_val}"
            clip = "keep --grad-clip on" if a.grad_clip > 0 else "clip with --grad-clip 1.0"
            fix = (f"lower --lr (this run: {self.lr:g}), lengthen --warmup (this run: "
                   f"{self.warmup}) or {clip}")
        if self.is_main:
            self._write(self.metrics, {"step": done, "loss": loss_val, "lr": lr})
        since = "no checkpoint was written" if self.saved_step is None else (
            f"--resume continues from the checkpoint of step {self.saved_step} (if its "
            f"weights are still sound; else start a new run)")
        raise _RunError(f"{why}; training stopped before this step's update (the metrics line "
                        f"records loss null); {fix}; {since}", code=1)

    def _run(self) -> int:
        sbpflow, a = self.sbpflow, self.args
        self.bar = None
        self.nonfinite_run = 0
        if self.is_main:
            self.out.mkdir(parents=True, exist_ok=True)
        data_info = self.setup_data()
        self.setup_model()
        start = self.restore() if a.resume else 0
        final = self.final = None
        if self.is_main:
            cfg = {"model": self.spec.name, "task": self.spec.task, "world_size": self.world,
                   "dp": self.dp, "tp": self.tp, "mesh": list(self.pl.shape),
                   "pp": self.pp, "schedule": a.schedule if self.pp > 1 else None,
                   "virtual_stages": a.virtual_stages,
                   "stages": None if self.stages is None else [
                       {"ranks": self.pls[s % self.pp].ranks.tolist(), "modules": names}
                       for s, names in enumerate(self.stages)],
                   "steps": self.steps, "batch_size": self.batch,
                   "grad_accum": a.grad_accum, "block_size": self.block, "lr": self.lr,
                   "warmup": self.warmup, "min_lr_ratio": a.min_lr_ratio,
                   "weight_decay": self.weight_decay, "grad_clip": a.grad_clip,
                   "amp": a.amp, "seed": a.seed, "parameters": self.n_params,
                   "model_overrides": self.model_overrides, "data": data_info}
            (self.out / "config.json").write_text(json.dumps(cfg, indent=1, default=str))
            if self.spec.task in ("lm", "mlm"):
                (self.out / "tokenizer.json").write_text(json.dumps(self.tok.to_json()))
            self.metrics, final = self._metrics_start(start)
            synthetic = " (SYNTHETIC data)" if a.synthetic else ""
            print(f"sbpflow train {self.spec.name}: {self.n_params:,} parameters, "
                  f"{self.world} rank{'s' if self.world > 1 else ''} ({self.layout}, mesh "
                  f"{list(self.pl.shape)}), "
                  f"data {data_info['source']}{synthetic}, batch {self.batch} "
                  f"({a.grad_accum} micro-batch{'es' if a.grad_accum > 1 else ''} of "
                  f"{self.micro}), steps {start}->{self.steps}, out "
                  f"{self.out}", flush=True)
            if self.pp > 1:
                per = self.dp * self.tp
                print(f"pipeline: {self.pp} stages of {per} rank{'s' if per > 1 else ''}, "
                      f"{a.grad_accum} micro-batches, schedule {a.schedule}; --pp runs the "
                      f"step as a compiled nn.Graph (--graph is on: the pipeline's runtime; "
                      f"evaluation and the sample run the stages eagerly, one after "
                      f"another)", flush=True)
                if a.grad_accum < self.pp:
                    print(f"note: {a.grad_accum} micro-batch(es) for {self.pp} stages: the "
                          f"stages mostly wait for each other; give --micro-batches "
                          f"{2 * self.pp} or more to fill the pipeline", flush=True)
            if start == self.steps:
                print(f"resumed at the end (step {start}, the final checkpoint): the final "
                      f"evaluation, plot and sample follow", flush=True)
            if not a.no_progress:
                from tqdm import tqdm

                self.bar = tqdm(total=self.steps, initial=start, desc="train",
                                dynamic_ncols=True, file=sys.stderr, mininterval=0.5)
        self.graph = self._make_graph() if a.graph else None
        if self.world > 1:
            sbpflow.distributed.ensure_groups([tuple(range(self.world))])  # _StopRequest's
        try:
            with self.stop:
                self._train(start)
        except _Interrupted as e:
            return self._interrupted(e)
        return self._finish(final)

    def _train(self, start: int) -> None:
        """Steps ``start`` to ``--steps`` (raises :class:`_Interrupted` at a step boundary
        after a SIGINT/SIGTERM)."""
        sbpflow, a = self.sbpflow, self.args
        for step in range(start, self.steps):
            t0 = time.perf_counter()
            lr = self.opt.param_groups[0]["lr"]
            if self.graph is not None:
                x, y = self._graph_batch(self.micro_batches(step))
                # nn.Graph packs the micro-batches' losses (OneFlow): their mean
                loss_val = float(self.graph(*self._globals(x, y)).mean().item())
                if step == start and self.is_main:
                    (self.out / "graph.txt").write_text(str(self.graph) + "\n")
                    plan = self.graph.auto_parallel_plan
                    if plan is not None:  # this run's own file (the run folder is ours)
                        plan.save(str(self.out / "plan.json"), overwrite=True)
                        self.log(str(plan))  # (above the progress bar)
                if a.compile and step == start + 1 and self.is_main:  # the first compiled
                    secs = [p.compile_s for p in self.graph._programs.values()
                            if p.compile_s is not None]
                    if secs:
                        self.log(f"torch.compile of the step's program took "
                                 f"{max(secs):.1f}s (first compiled call; in graph.txt)")
                    (self.out / "graph.txt").write_text(str(self.graph) + "\n")
                done = step + 1
                if math.isfinite(loss_val):
                    self.nonfinite_run = 0
                else:
                    self._nonfinite(done, loss_val, lr)
                self.sched.step()
                self._after_step(step, done, loss_val, lr, t0)
                continue
            losses = []
            parts = self.micro_batches(step)
            for i, (x, y) in enumerate(parts):
                xs, ys = self._globals(x, y)
                sync = contextlib.nullcontext() if i == len(parts) - 1 else sbpflow.no_sync()
                with sync:
                    loss, _ = self.forward(xs, ys)
                    scaled = loss / len(parts) if len(parts) > 1 else loss
                    self.scaler.scale(scaled).backward()
                losses.append(float(loss.item()))
            loss_val = sum(losses) / len(losses)
            done = step + 1
            if math.isfinite(loss_val):
                self.nonfinite_run = 0
            else:
                self._nonfinite(done, loss_val, lr)
            if a.grad_clip > 0:
                self.scaler.unscale_(self.opt)
                sbpflow.nn.utils.clip_grad_norm_(self.model.parameters(), a.grad_clip)
            self.scaler.step(self.opt)
            self.scaler.update()
            self.sched.step()
            self.opt.zero_grad(set_to_none=True)
            self._after_step(step, done, loss_val, lr, t0)
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def _after_step(self, step: int, done: int, loss_val: float, lr: float, t0: float):
        """Metrics, evaluation, checkpoints and progress after the update of ``step``."""
        a = self.args
        dt = time.perf_counter() - t0
        rec = {"step": done, "loss": loss_val, "lr": lr, "samples_per_s": self.batch / dt}
        if done == self.steps:
            # The final checkpoint goes out before the final evaluation and sample, so
            # a failure there loses no training. It holds this step's record: a resume
            # at the end (start == steps) completes and writes the line.
            self.save(done, rec)
            self.final = rec
        else:
            if self.eval_every and done % self.eval_every == 0:
                ev = self.evaluate()
                rec.update(ev)
                self.log(f"step {done}: loss {loss_val:.4f} " + _fmt(ev))
            # The step's metrics line goes out before its checkpoint: a run killed
            # after the checkpoint commits has every line up to it (resume drops later
            # ones).
            if self.is_main and (done % a.log_every == 0 or "val_loss" in rec):
                self._write(self.metrics, rec)
            if a.ckpt_every and done % a.ckpt_every == 0:
                self.save(done, rec)
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss_val:.4f}",
                                 samples_s=f"{rec['samples_per_s']:.1f}", refresh=False)
            self.bar.update(1)
        signum = self.stop.agreed(self.world)
        if signum:
            # A checkpoint of this step, unless it has one (the interval's, the final
            # one, or the one this run resumed from): never a second version of a step,
            # which would push the version before it out of save(keep=2).
            saved = self.saved_step != done
            if saved:
                self.save(done, rec)
            raise _Interrupted(signum, done, saved)

    def _interrupted(self, e: _Interrupted) -> int:
        """Report a stop by SIGINT/SIGTERM (rank 0) and return its exit code, 128 + the
        signal number, as a process killed by it."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if self.is_main:
            self.metrics.close()
            name = signal.Signals(e.signum).name
            what = "saved a checkpoint of" if e.saved else "the newest checkpoint is that of"
            rest = ("continue the run with" if e.step < self.steps else
                    "this is the final step: the final evaluation, plot and sample follow "
                    "with")
            print(f"sbpflow train: stopped by {name} after step {e.step} of {self.steps}; "
                  f"{what} step {e.step} in {self.out / 'ckpt'}; {rest}: "
                  f"{self.resume_command}", file=sys.stderr, flush=True)
        return 128 + e.signum

    def _finish(self, final) -> int:
        final = self.final if self.final is not None else final
        # The end: the final evaluation completes the final step's line (on every rank:
        # evaluate is collective; only rank 0 holds the record), then plot and sample.
        ev = self.evaluate()
        if self.is_main:
            final.update(ev)
            loss = final.get("loss")
            self.log(f"step {self.steps}: loss "
                     f"{'?' if loss is None else format(loss, '.4f')} " + _fmt(ev))
            self._write(self.metrics, final)
        text = self.sample()
        if self.is_main:
            self.metrics.close()
            self.plot()
            if text is not None:
                (self.out / "sample.txt").write_text(text)
                print(f"--- sample ({len(text)} characters) ---\n{text}\n---", flush=True)
            print(f"done: {self.steps} steps; {_fmt(ev)}; outputs in {self.out}", flush=True)
        return 0


def _fmt(ev: dict) -> str:
    return " ".join(f"{k} {v:.4f}" for k, v in ev.items())


if __name__ == "__main__":
    sys.exit(main())
