"""The cost model against one GPU: predicted step time and memory of zoo models' training
steps (``nn.Graph``, one rank) beside what they measure, and the GPU's achieved matmul rate
and memory bandwidth beside its named hardware profile's peaks.

Run on a machine with a GPU (a plain process is a world of 1)::

    python scripts/cuda_plan_check.py            # the default configurations
    python scripts/cuda_plan_check.py --device cpu --configs gpt-mini:2:64:none   # try it here

Each configuration is ``MODEL:BATCH:SEQ_OR_IMAGE:AMP`` (a zoo model, samples, tokens per
sample or image side, ``none``/``bf16``/``fp16``). For each it prints the prediction
(:func:`sbpflow.planner.predict.predict_step` on the profile automatic parallelism would
use: the named profile matching the GPU, else this machine's calibration), the measured
median of ``--steps`` synchronized steps, their ratio, the program's node count and the
host seconds per node (the same step at batch 2 and the smallest size, where the device
has almost nothing to do: the time the program's Python and kernel launches take), and
the predicted memory beside the allocator's peak. CI never runs it; a GPU session's note
quotes it.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import sbpflow
from sbpflow.models import spec as zoo
from sbpflow.planner.auto import graph_optimizer, pricing_dtype, resolve_hardware
from sbpflow.planner.predict import predict_memory, predict_step
from sbpflow.sbp import broadcast

DEFAULT = ("gpt-mini:8:128:bf16", "gpt2:8:1024:bf16", "bert-base:32:128:bf16",
           "resnet50:128:224:bf16", "resnet18:64:224:bf16")


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def _step_graph(spec, device: str, amp: str):
    sbpflow.manual_seed(0)
    model = spec.build()
    zoo.per_rank_batch_norm(model)
    pl = sbpflow.placement(device, [0])
    model.to(device)
    model.to_global(pl, broadcast)
    model.train()
    opt = sbpflow.optim.AdamW(model.parameters(), lr=1e-4)

    class Step(sbpflow.nn.Graph):
        def __init__(self):
            super().__init__()
            self.model = model
            self.add_optimizer(opt)
            if amp != "none":
                self.config.enable_amp(True, dtype=getattr(torch, {"bf16": "bfloat16",
                                                                   "fp16": "float16"}[amp]))

        def build(self, *b):
            with sbpflow.default_placement(pl):
                loss = zoo.task_loss(sbpflow.nn.functional, spec.task, model, *b)
            loss.backward()
            return loss

    return Step(), pl


def _batch(spec, pl, batch: int, size: int):
    seq = size if spec.task != "image" else None
    ts = zoo.synthetic_batch(spec, batch, seq, 0, 0, size)
    return tuple(sbpflow.tensor(t.to(pl.device.type), placement=pl, sbp=broadcast)
                 for t in ts)


def _time(graph, batch, device: str, steps: int) -> float:
    for _ in range(3):
        graph(*batch)
    _sync(device)
    ts = []
    for _ in range(steps):
        t0 = time.perf_counter()
        graph(*batch)
        _sync(device)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def check(config: str, device: str, steps: int) -> None:
    name, batch, size, amp = config.split(":")
    batch, size = int(batch), int(size)
    spec = zoo.get(name)
    graph, pl = _step_graph(spec, device, amp)
    b = _batch(spec, pl, batch, size)
    hw = resolve_hardware(None, device)
    lg = graph.lower(*b)
    p = predict_step(lg, hw, pricing_dtype(graph.config, hw), 1, graph_optimizer(graph))
    mem = predict_memory(lg, 2.0)["total"]
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    measured = _time(graph, b, device, steps)
    peak = torch.cuda.max_memory_allocated() if device == "cuda" else 0
    nodes = sum(n.op == "call_function"
                for prog in graph._programs.values() for n in prog.gm.graph.nodes)
    small = _batch(spec, pl, 2, 32 if spec.task == "image" else 16)  # batch norm: 2
    host = _time(graph, small, device, steps)
    print(f"{config}: predicted {p['total'] * 1e3:.2f} ms (compute {p['compute'] * 1e3:.2f}, "
          f"update {p['update'] * 1e3:.2f}, host {p.get('host', 0) * 1e3:.2f}; "
          f"{lg.calls} calls) [{hw.name}], measured {measured * 1e3:.2f} ms, "
          f"predicted/measured {p['total'] / measured:.2f}; program nodes {nodes}, at batch 2 "
          f"{host * 1e3:.2f} ms = {host / max(nodes, 1) * 1e6:.1f} us per node, "
          f"{host / max(lg.calls, 1) * 1e6:.1f} per call counted; memory predicted "
          f"{mem / 2**20:.0f} MiB, "
          + (f"measured peak {peak / 2**20:.0f} MiB ({mem / peak:.2f})" if peak else
             "no allocator peak on the CPU"), flush=True)
    del graph
    if device == "cuda":
        torch.cuda.empty_cache()


def rates(device: str) -> None:
    """Achieved matmul rate per dtype and copy bandwidth, against the profile's peaks."""
    hw = resolve_hardware(None, device)
    for dtype, key in ((torch.bfloat16, "bfloat16"), (torch.float32, "float32")):
        for n in (1024, 4096, 8192):
            a = torch.randn(n, n, device=device, dtype=dtype)
            c = torch.randn(n, n, device=device, dtype=dtype)
            t = _time_fn(lambda a=a, c=c: a @ c, device)
            peak = hw.peak_flops.get(key)
            print(f"matmul {key} {n}: {2 * n ** 3 / t / 1e12:.3g} TFLOP/s"
                  + (f" = {2 * n ** 3 / t / peak:.2f} of {hw.name}'s {peak / 1e12:.3g}"
                     if peak else ""), flush=True)
    for mib in (64, 1024):
        x = torch.empty(mib * 2 ** 18, device=device)
        y = torch.empty_like(x)
        t = _time_fn(lambda x=x, y=y: y.copy_(x), device)
        bw = 2 * x.nbytes / t
        print(f"copy {mib} MiB: {bw / 1e12:.3g} TB/s = {bw / hw.memory_bandwidth:.2f} of "
              f"{hw.name}'s {hw.memory_bandwidth / 1e12:.3g}", flush=True)


def _time_fn(fn, device: str, reps: int = 10) -> float:
    for _ in range(3):
        fn()
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    _sync(device)
    return (time.perf_counter() - t0) / reps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                   help="where the steps run (default cuda; cpu tries the script here)")
    p.add_argument("--configs", nargs="*", default=DEFAULT, metavar="MODEL:BATCH:SIZE:AMP",
                   help="e.g. gpt2:8:1024:bf16 (SIZE: tokens per sample, or an image's side; "
                   f"AMP: none, bf16 or fp16); default {' '.join(DEFAULT)}")
    p.add_argument("--steps", type=int, default=10,
                   help="timed steps per configuration, median reported (default 10); the "
                   "host time per call is the same step at batch 2 and the smallest size")
    p.add_argument("--no-rates", action="store_true",
                   help="skip the matmul and copy rates (on the CPU they are skipped unless "
                   "--rates)")
    p.add_argument("--rates", action="store_true", help="measure the rates on the CPU too")
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("skipped: no CUDA device here (--device cpu tries it on the CPU)")
        return
    if args.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}", flush=True)
    if not args.no_rates and (args.device == "cuda" or args.rates):
        rates(args.device)
    for c in args.configs:
        try:
            check(c, args.device, args.steps)
        except Exception as e:  # one configuration's failure must not hide the others'
            print(f"{c}: FAILED {type(e).__name__}: {e}", flush=True)


if __name__ == "__main__":
    main()
