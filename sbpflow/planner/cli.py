"""``sbpflow plan``: predict and search GPT layouts on a hardware profile.

This first version plans GPT models at scale (Megatron-style tensor, pipeline and data
parallelism, :mod:`sbpflow.planner.simulate`); the whole-plan search over the zoo on this
machine's ranks (issue 23) builds on it.
"""

from __future__ import annotations

import argparse
import sys

from .hardware import load, names
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
                   "gpt2-medium); or give --layers/--hidden/--heads")
    p.add_argument("--layers", type=int)
    p.add_argument("--hidden", type=int)
    p.add_argument("--heads", type=int)
    p.add_argument("--seq", type=int, default=2048, help="sequence length (default 2048)")
    p.add_argument("--vocab", type=int, default=51200, help="vocabulary (default 51200)")
    p.add_argument("--hardware", default="a100-80g", help=f"profile: {', '.join(names())} "
                   f"or a JSON file (default a100-80g)")
    p.add_argument("--devices", type=int, help="devices in all (nodes x devices per node)")
    p.add_argument("--global-batch", type=int, help="sequences per step")
    p.add_argument("--tp", type=int, help="predict this layout instead of searching "
                   "(with --pp; data parallelism takes the rest)")
    p.add_argument("--pp", type=int)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--top", type=int, default=5, help="plans to print (default 5)")
    p.add_argument("--megatron-table-1", action="store_true",
                   help="predict Narayanan et al. (SC'21) Table 1 beside the published "
                   "figures, and the plan this search picks for each row")
    return p


def _shape(parser, args) -> GPTShape:
    if args.model:
        import sbpflow.models

        try:
            cfg = sbpflow.models.get(args.model).config
            return GPTShape(cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.block_size,
                            cfg.vocab_size)
        except (ValueError, KeyError, AttributeError):
            parser.error(f"{args.model!r} is not a GPT of sbpflow.models; give "
                         f"--layers/--hidden/--heads")
    if not (args.layers and args.hidden and args.heads):
        parser.error("give a model name or --layers, --hidden and --heads")
    return GPTShape(args.layers, args.hidden, args.heads, args.seq, args.vocab)


def _gib(n: float) -> str:
    return f"{n / 2 ** 30:.1f} GiB"


def _row(lay: Layout, pred) -> str:
    terms = ", ".join(f"{k} {v / pred.step_s:.0%}" for k, v in pred.terms.items() if v > 0)
    return (f"| t{lay.tp} p{lay.pp} d{lay.dp} | {lay.micro_batch} | "
            f"{'1F1B' if lay.virtual == 1 else f'interleaved v={lay.virtual}'} | "
            f"{pred.step_s:.3f} | {pred.tflops_per_device:.1f} | {_gib(pred.memory_bytes)} | "
            f"{terms} |")


_HEAD = ("| layout | micro-batch | schedule | step s | TFLOP/s per device | memory per device "
         "| where the time goes |\n|---|---|---|---|---|---|---|")


def _table_1(hw) -> str:
    out = ["| params | published (t, p, d) | published TFLOP/s | predicted | ratio | "
           "chosen plan | its prediction | its memory |", "|---|---|---|---|---|---|---|---|"]
    for row in NARAYANAN_2021_TABLE_1:
        billions, a, h, l, t, p, n, batch, published = row
        shape, d = GPTShape(l, h, a), n // (t * p)
        preds = [simulate_gpt(shape, Layout(t, p, d, b), batch, hw) for b in (1, 2, 4, 8)
                 if batch % (d * b) == 0]
        pred = max((x for x in preds if x.fits), key=lambda x: x.tflops_per_device)
        lay, best = search_gpt(shape, n, batch, hw, top=1)[0]
        out.append(f"| {billions}B | ({t}, {p}, {d}) | {published} | "
                   f"{pred.tflops_per_device:.1f} | {pred.tflops_per_device / published:.2f} | "
                   f"t{lay.tp} p{lay.pp} d{lay.dp} b{lay.micro_batch} v{lay.virtual} | "
                   f"{best.tflops_per_device:.1f} | {_gib(best.memory_bytes)} |")
    return "\n".join(out)


def main(argv=None, prog: str = "sbpflow plan") -> int:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    try:
        hw = load(args.hardware)
    except ValueError as e:
        parser.error(str(e))
    if args.megatron_table_1:
        print(f"Narayanan et al., SC'21, Table 1 on {hw.name} (sequence 2048, vocabulary "
              f"51200; predicted at the published degrees with the best micro-batch of "
              f"1-8, 1F1B):\n")
        print(_table_1(hw))
        return 0
    shape = _shape(parser, args)
    if not args.devices or not args.global_batch:
        parser.error("give --devices and --global-batch")
    print(f"GPT: {shape.layers} layers, hidden {shape.hidden}, {shape.heads} heads, sequence "
          f"{shape.seq}, vocabulary {shape.vocab}: {shape.params / 1e9:.2f}B parameters; "
          f"{args.devices} x {hw.name}, global batch {args.global_batch}\n")
    if args.tp or args.pp:
        t, p = args.tp or 1, args.pp or 1
        if args.devices % (t * p):
            parser.error(f"--devices {args.devices} is not a multiple of tp x pp = {t * p}")
        lay = Layout(t, p, args.devices // (t * p), args.micro_batch)
        try:
            pred = simulate_gpt(shape, lay, args.global_batch, hw)
        except ValueError as e:
            parser.error(str(e))
        print(_HEAD)
        print(_row(lay, pred))
        if not pred.fits:
            print(f"\ndoes not fit: {_gib(pred.memory_bytes)} per device, "
                  f"{_gib(hw.memory_bytes)} available")
        return 0
    plans = search_gpt(shape, args.devices, args.global_batch, hw, top=args.top)
    if not plans:
        print(f"no layout fits {_gib(hw.memory_bytes)} per device; use more devices")
        return 1
    print(_HEAD)
    for lay, pred in plans:
        print(_row(lay, pred))
    return 0


if __name__ == "__main__":
    sys.exit(main())
