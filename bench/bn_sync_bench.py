"""BatchNorm running-statistics sync: per layer vs coalesced, paired on the same ranks.

ResNet-18 (``resnet18-digits``) data parallel over the launch's ranks with per-rank
BatchNorm statistics (``sync_stats=False``, as ``sbpflow bench``). Mode A flushes the
deferred statistics after every BatchNorm layer (one broadcast per layer, 20 a step: what
sbpflow did before the statistics were coalesced); mode B is the default (one coalesced
broadcast per step, :mod:`sbpflow.nn._buffer_sync`). Training steps alternate A B B A so
that a slow phase of a shared machine hits both alike; prints the collectives of a step in
each mode, the median wall and CPU time of a step (ms), and the sync alone (20 broadcasts
of (mean, var) vs one ``broadcast_coalesced`` of all of them, median of 100).

Run::

    sbpflow launch --nproc-per-node 2 bench/bn_sync_bench.py [IMAGE_SIZE=8] [STEPS=40]
"""
import statistics
import sys
import time

import torch

torch.set_num_threads(1)
import sbpflow  # noqa: E402
from sbpflow import models  # noqa: E402
from sbpflow.distributed import CommRecorder, broadcast, broadcast_coalesced  # noqa: E402
from sbpflow.nn import _buffer_sync  # noqa: E402
from sbpflow.nn.modules.norm import _BatchNorm  # noqa: E402
from sbpflow.nn.parallel import parallelize_module  # noqa: E402
from sbpflow.sbp import split  # noqa: E402

size = int(sys.argv[1]) if len(sys.argv) > 1 else 8
n = int(sys.argv[2]) if len(sys.argv) > 2 else 40
rank = sbpflow.distributed.get_rank()
spec = models.get("resnet18-digits")
sbpflow.manual_seed(0)
m = spec.build()
bns = [mod for mod in m.modules() if isinstance(mod, _BatchNorm)]
for b in bns:
    b.sync_stats = False
pl = sbpflow.placement.all("cpu")
parallelize_module(m, pl, spec.plan("dp"))
per_layer = [False]
for b in bns:
    b.register_forward_hook(lambda mod, i, o: _buffer_sync.flush() if per_layer[0] else None)
opt = sbpflow.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)
g = torch.Generator().manual_seed(0)
x = torch.randn(16, 1, size, size, generator=g)
y = torch.randint(0, 10, (16,), generator=g)
xs, ys = (sbpflow.tensor(t, placement=pl, sbp=split(0)) for t in (x, y))


def step():
    opt.zero_grad()
    loss = sbpflow.nn.functional.cross_entropy(m(xs), ys)
    loss.backward()
    opt.step()


for mode in (True, False):
    per_layer[0] = mode
    with CommRecorder() as rec:
        step()
    if rank == 0:
        print("per-layer" if mode else "coalesced", "broadcasts/step:", rec.count("broadcast"),
              "all_reduces/step:", rec.count("all_reduce"), flush=True)
wall = {True: [], False: []}
cpu = {True: [], False: []}
for i in range(2 * n):
    mode = (i % 4) in (0, 3)  # ABBA
    per_layer[0] = mode
    sbpflow.distributed.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    step()
    wall[mode].append(time.perf_counter() - t0)
    cpu[mode].append(time.process_time() - c0)

# the buffer sync alone: 20 broadcasts of (mean, var) vs one coalesced broadcast
stats = [b.running_mean._local for b in bns] + [b.running_var._local for b in bns]
pairs = [torch.cat([b.running_mean._local, b.running_var._local]) for b in bns]
world = tuple(range(sbpflow.distributed.get_world_size()))
sync = {"20 broadcasts": [], "1 coalesced": []}
for _ in range(100):
    sbpflow.distributed.barrier()
    t0 = time.perf_counter()
    for p in pairs:
        broadcast(p, world, 0)
    sync["20 broadcasts"].append(time.perf_counter() - t0)
    sbpflow.distributed.barrier()
    t0 = time.perf_counter()
    broadcast_coalesced(stats, world, 0)
    sync["1 coalesced"].append(time.perf_counter() - t0)
med = statistics.median
print(f"rank {rank} image {size}px, {n} steps each: step wall median per-layer "
      f"{1000 * med(wall[True]):.1f} ms vs coalesced {1000 * med(wall[False]):.1f} ms; "
      f"cpu median {1000 * med(cpu[True]):.1f} vs {1000 * med(cpu[False]):.1f} ms; "
      f"sync alone median: 20 broadcasts {1000 * med(sync['20 broadcasts']):.2f} ms, "
      f"1 coalesced {1000 * med(sync['1 coalesced']):.2f} ms", flush=True)
