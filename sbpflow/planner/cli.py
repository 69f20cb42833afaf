"""``sbpflow plan``: predict and search GPT layouts on a hardware profile.

Two modes: GPT models at scale (Megatron-style tensor, pipeline and data parallelism,
:mod:`sbpflow.planner.simulate`), and with ``--nproc-per-node`` a zoo model's whole plan
on this machine's ranks (meshes, layouts, ZeRO stage: :mod:`sbpflow.planner.here`).
"""

from __future__ import annotations

import argparse
import sys

from .._argtypes import positive_int
from .hardware import load, names, unwritable
from .simulate import NARAYANAN_2021_TABLE_1, GPTShape, Layout, search_gpt, simulate_gpt

__all__ = ["build_parser", "main"]


def build_parser(prog: str = "sbpflow plan") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog, description="Predict a GPT training step on a hardware profile and search "
        "its tensor/pipeline/data-parallel layout, micro-batch size and schedule.",
        epilog="examples:\n  sbpflow plan --megatron-table-1\n  sbpflow plan gpt2 "
        "--hardware h100 --devices 64 --global-batch 512\n  sbpflow plan --layers 128 "
        "--hidden 25600 --heads 160 --devices 3072 --global-batch 3072 --tp 8 --pp 64",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", help="a GPT of sbpflow.models (gpt-mini, gpt2, "
                   "gpt2-medium); or give --layers/--hidden/--heads. With "
                   "--nproc-per-node: any zoo model (text, images, click-through, face)")
    p.add_argument("--layers", type=positive_int)
    p.add_argument("--hidden", type=positive_int)
    p.add_argument("--heads", type=positive_int)
    p.add_argument("--seq", type=positive_int, default=None,
                   help="sequence length (default 2048, or the model's)")
    p.add_argument("--vocab", type=positive_int, default=None,
                   help="vocabulary (default 51200, or the model's)")
    p.add_argument("--hardware", default=None, help=f"profile: {', '.join(names())} "
                   f"or a JSON file, e.g. one `sbpflow calibrate` wrote (default a100-80g; "
                   f"with --nproc-per-node, this machine's calibration)")
    p.add_argument("--dtype", default=None, help="the matmuls' dtype, a key of the profile's "
                   "peak_flops (default bfloat16, else float16, else the profile's first)")
    p.add_argument("--devices", type=positive_int, help="devices in all (nodes x devices per "
                   "node)")
    p.add_argument("--global-batch", type=positive_int, help="sequences per step")
    p.add_argument("--tp", type=positive_int, help="predict this layout instead of searching "
                   "(with --pp; data parallelism takes the rest)")
    p.add_argument("--pp", type=positive_int)
    p.add_argument("--micro-batch", type=positive_int, default=None,
                   help="micro-batch size in sequences (default: searched over 1, 2, 4, 8; "
                   "1 with --tp/--pp)")
    p.add_argument("--top", type=positive_int, default=5, help="plans to print (default 5)")
    here = p.add_argument_group("this machine (a zoo model's layouts on its ranks)")
    here.add_argument("--nproc-per-node", type=positive_int, default=None, metavar="N",
                      help="rank MODEL's layouts on N local ranks from their logical graphs "
                      "(default profile: this machine's calibration, measured first if none "
                      "is cached)")
    here.add_argument("--batch-size", type=positive_int, default=None,
                      help="samples per rank (default: `sbpflow bench`'s for the model's "
                           "task: 8 text and images, 256 click-through, 64 face)")
    here.add_argument("--seq-len", type=positive_int, default=128,
                      help="tokens per sample of a text model (default 128)")
    here.add_argument("--image-size", type=positive_int, default=128,
                      help="pixels per side of an image model (default 128)")
    here.add_argument("--save", default=None, metavar="FILE",
                      help="write the chosen plan (mesh, ZeRO stage, layouts) to FILE, a "
                      "JSON plan that `sbpflow train MODEL --plan FILE` runs (never "
                      "replaces a file)")
    here.add_argument("--search-time", type=float, default=10.0, metavar="SECONDS",
                      help="each mesh's layout search stops after this long, keeping the "
                      "best found (default 10)")
    here.add_argument("--memory-per-rank", type=positive_int, default=None, metavar="BYTES",
                      help="plans needing more (predicted: parameters, gradients, optimizer "
                      "state, activations) are ranked after those that fit (default: no "
                      "limit)")
    p.add_argument("--megatron-table-1", action="store_true",
                   help="predict Narayanan et al. (SC'21) Table 1 beside the published "
                   "figures, and the plan this search picks for each row")
    return p


def _shape(parser, args) -> GPTShape:
    if args.model:
        import sbpflow.models

        try:
            cfg = sbpflow.models.get(args.model).config
            dims = (cfg.n_layer, cfg.n_embd, cfg.n_head)
        except (ValueError, KeyError, AttributeError):
            parser.error(f"{args.model!r} is not a GPT of sbpflow.models; give "
                         f"--layers/--hidden/--heads")
        if args.layers or args.hidden or args.heads:
            parser.error("give a model name or --layers/--hidden/--heads, not both")
        seq, vocab = args.seq or cfg.block_size, args.vocab or cfg.vocab_size
    else:
        if not (args.layers and args.hidden and args.heads):
            parser.error("give a model name or --layers, --hidden and --heads")
        dims = (args.layers, args.hidden, args.heads)
        seq, vocab = args.seq or 2048, args.vocab or 51200
    try:
        return GPTShape(*dims, seq, vocab)
    except ValueError as e:
        parser.error(str(e))


def _gib(n: float) -> str:
    return f"{n / 2 ** 30:.1f} GiB" if n >= 2 ** 30 else f"{n / 2 ** 20:.1f} MiB"


def _seconds(x: float) -> str:
    return f"{x:.3f} s" if x >= 1 else f"{x * 1e3:.3g} ms"


def _row(lay: Layout, pred) -> str:
    terms = ", ".join(f"{k} {v / pred.step_s:.0%}" for k, v in pred.terms.items()
                      if v >= 0.005 * pred.step_s)
    return (f"| t{lay.tp} p{lay.pp} d{lay.dp} | {lay.micro_batch} | "
            f"{'1F1B' if lay.virtual == 1 else f'interleaved v={lay.virtual}'} | "
            f"{_seconds(pred.step_s)} | {pred.tflops_per_device:.3g} | "
            f"{_gib(pred.memory_bytes)} | {terms} |")


_HEAD = ("| layout | micro-batch | schedule | step | TFLOP/s per device | memory per device "
         "| where the time goes |\n|---|---|---|---|---|---|---|")


def _table_1(hw, dtype) -> str:
    out = ["| params | published (t, p, d) | published TFLOP/s | predicted | ratio | "
           "chosen plan | its prediction | its memory |", "|---|---|---|---|---|---|---|---|"]
    for row in NARAYANAN_2021_TABLE_1:
        billions, a, h, l, t, p, n, batch, published = row
        shape, d = GPTShape(l, h, a), n // (t * p)
        preds = [simulate_gpt(shape, Layout(t, p, d, b), batch, hw, dtype)
                 for b in (1, 2, 4, 8) if batch % (d * b) == 0]
        fit = [x for x in preds if x.fits]
        if fit:
            pred = max(fit, key=lambda x: x.tflops_per_device)
            mine = f"{pred.tflops_per_device:.1f} | {pred.tflops_per_device / published:.2f}"
        else:
            mine = f"does not fit ({_gib(min(x.memory_bytes for x in preds))}) | -"
        best = search_gpt(shape, n, batch, hw, dtype, top=1)
        if best:
            lay, b = best[0]
            chosen = (f"t{lay.tp} p{lay.pp} d{lay.dp} b{lay.micro_batch} v{lay.virtual} | "
                      f"{b.tflops_per_device:.1f} | {_gib(b.memory_bytes)}")
        else:
            chosen = "none fits | - | -"
        out.append(f"| {billions}B | ({t}, {p}, {d}) | {published} | {mine} | {chosen} |")
    return "\n".join(out)


def main(argv=None, prog: str = "sbpflow plan") -> int:
    """Run ``sbpflow plan``; returns the exit code (1: no layout fits)."""
    try:
        return _main(argv, prog)
    except BrokenPipeError:  # `sbpflow plan ... | head`: the reader left, not an error
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


#: ``sbpflow plan``'s flags for a GPT on a hardware profile, refused with
#: ``--nproc-per-node`` (which runs a zoo model's own shape on this machine's ranks).
_GPT_ONLY = ("layers", "hidden", "heads", "seq", "vocab", "dtype", "devices", "global_batch",
             "tp", "pp", "micro_batch", "megatron_table_1")


def _here(parser, args) -> int:
    """``--nproc-per-node``: calibrate when needed, then run :mod:`sbpflow.planner.here`
    on the ranks."""
    import os

    import sbpflow.models

    from . import calibrate
    from .here import layouts

    n = args.nproc_per_node
    if n == 1 and (args.save or args.memory_per_rank):
        parser.error(f"{'--save' if args.save else '--memory-per-rank'} chooses among plans "
                     f"of 2 or more ranks (the whole-plan search); give --nproc-per-node 2 "
                     f"or more")
    if not 0 < args.search_time < float("inf"):
        parser.error(f"--search-time {args.search_time}: give a number of seconds > 0")
    try:
        spec = sbpflow.models.get(args.model or "")
    except (ValueError, KeyError):
        parser.error(f"{'no model ' + repr(args.model) if args.model else 'no model given'}: "
                     f"--nproc-per-node ranks a zoo model's layouts: give one of "
                     f"{sbpflow.models.names()}")
    gpt_only = [f"--{k.replace('_', '-')}" for k in _GPT_ONLY
                if getattr(args, k) not in (None, False)]
    if gpt_only:
        parser.error(f"{', '.join(gpt_only)}: price{'s' if len(gpt_only) == 1 else ''} a "
                     f"GPT on a hardware profile (without --nproc-per-node); with "
                     f"--nproc-per-node the model's own shape runs (--batch-size, --seq-len, "
                     f"--image-size) and its layouts are searched: leave "
                     f"{'it' if len(gpt_only) == 1 else 'them'} out")
    if args.save == "":
        parser.error("--save '': give a file name for the plan")
    hardware = args.hardware or calibrate.cache_path(n)
    if args.hardware is None and not os.path.exists(hardware):
        print(f"sbpflow plan: no calibration of this machine for {n} ranks yet; measuring "
              f"(sbpflow calibrate --nproc-per-node {n})")
        code = calibrate.main(["--nproc-per-node", str(n)])
        if code:
            return code
    try:  # this machine's calibration: its calibrate-written fields there, for n ranks
        hw = load(hardware) if args.hardware else calibrate.load_cached(hardware, n)
    except ValueError as e:  # (ProfileError) one line, as bench and train give it
        fix = f"; fix or delete it (`sbpflow calibrate --nproc-per-node {n} --force` " \
              f"measures it again)" if args.hardware is None else \
            f"; a calibration of this machine is measured by `sbpflow calibrate " \
            f"--nproc-per-node {n} --out FILE`" if os.path.isfile(args.hardware) else ""
        print(f"sbpflow plan: error: {e}{fix}", file=sys.stderr)
        return 2
    why = calibrate.wrong_ranks(hw, n)
    if why:  # (a given file: the cached one was checked above)
        print(f"sbpflow plan: error: --hardware {args.hardware}: {why}; measure this "
              f"machine on --nproc-per-node {n} (`sbpflow calibrate --nproc-per-node {n} "
              f"--out FILE`, then --hardware FILE)", file=sys.stderr)
        return 2
    if args.save and os.path.exists(args.save):
        parser.error(f"--save {args.save}: exists; give another path (a plan is never "
                     f"replaced)")
    why = unwritable(args.save, make=False) if args.save else ""
    if why:  # before the search (it takes up to a minute)
        parser.error(f"--save {args.save}: cannot write it ({why}); give a file in a folder "
                     f"you can write")
    print(f"sbpflow plan: {args.model} on {n} rank{'s' if n > 1 else ''}: layouts "
          f"{', '.join(layouts(spec, n))}"
          f"{', the auto-parallel search' if n > 1 else ''}"
          f"{' and pipelines' if n > 1 and spec.pipeline_split is not None else ''}")
    from sbpflow.distributed import launch
    from sbpflow.models.spec import default_batch

    return launch.main(["--standalone", "--nproc-per-node", str(n), "--threads-per-rank",
                        "1", "-m", "sbpflow.planner.here", args.model, hardware,
                        str(args.batch_size or default_batch(spec.task)), str(args.seq_len),
                        str(args.image_size),
                        os.path.abspath(args.save) if args.save else "",
                        str(args.memory_per_rank or ""), str(args.search_time)],
                       reported=True)


def _main(argv, prog: str) -> int:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    if args.nproc_per_node:
        return _here(parser, args)
    try:
        hw = load(args.hardware or "a100-80g")
    except ValueError as e:
        parser.error(str(e))
    dtype = args.dtype or hw.default_dtype
    if dtype not in hw.peak_flops:
        parser.error(f"--dtype {dtype}: profile {hw.name} lists {sorted(hw.peak_flops)}")
    if args.megatron_table_1:
        print(f"Narayanan et al., SC'21, Table 1 on {hw.name}, {dtype} (sequence 2048, "
              f"vocabulary 51200; predicted at the published degrees with the best "
              f"micro-batch of 1-8, 1F1B):\n")
        print(_table_1(hw, dtype))
        return 0
    here_only = [f for f, v in (("--save", args.save), ("--memory-per-rank",
                                                        args.memory_per_rank))
                 if v]
    if here_only:
        parser.error(f"{here_only[0]} is for the whole-plan search on this machine's ranks: "
                     f"add --nproc-per-node N (at least 2); a GPT predicted on --devices "
                     f"fits in the --hardware profile's memory")
    shape = _shape(parser, args)
    if not args.devices or not args.global_batch:
        parser.error("give --nproc-per-node N (plan on this machine's ranks), or "
                     "--devices and --global-batch (predict a GPT on the --hardware "
                     "profile's devices)")
    print(f"GPT: {shape.layers} layers, hidden {shape.hidden}, {shape.heads} heads, sequence "
          f"{shape.seq}, vocabulary {shape.vocab}: {shape.params / 1e9:.3g}B parameters; "
          f"{args.devices} x {hw.name} ({dtype}), global batch {args.global_batch}\n")
    if args.tp or args.pp:
        t, p = args.tp or 1, args.pp or 1
        if args.devices % (t * p):
            parser.error(f"--devices {args.devices} is not a multiple of tp x pp = {t * p}")
        if hw.devices_per_node % t and t < hw.devices_per_node or \
                t > hw.devices_per_node and t % hw.devices_per_node:
            print(f"note: a tensor-parallel group of {t} does not line up with nodes of "
                  f"{hw.devices_per_node} devices; the prediction assumes it does\n")
        lay = Layout(t, p, args.devices // (t * p), args.micro_batch or 1)
        try:
            pred = simulate_gpt(shape, lay, args.global_batch, hw, dtype)
        except ValueError as e:
            parser.error(str(e))
        print(_HEAD)
        print(_row(lay, pred))
        if not pred.fits:
            print(f"\ndoes not fit: {_gib(pred.memory_bytes)} per device, "
                  f"{_gib(hw.memory_bytes)} available")
        return 0
    try:
        plans = search_gpt(shape, args.devices, args.global_batch, hw, dtype,
                           micro_batches=(args.micro_batch,) if args.micro_batch else
                           (1, 2, 4, 8), top=args.top)
    except ValueError as e:
        parser.error(str(e))
    if not plans:
        print(f"no layout fits {_gib(hw.memory_bytes)} per device; use more devices")
        return 1
    print(_HEAD)
    for lay, pred in plans:
        print(_row(lay, pred))
    return 0


if __name__ == "__main__":
    sys.exit(main())
