"""A tour of global tensors and boxing, run on several ranks. Prints what it does.

Run (4 ranks on one machine, gloo; each rank gets one torch thread)::

    sbpflow launch --nproc-per-node 4 examples/demo_boxing.py

On 2 ranks the 2-D mesh part is skipped; on 1 rank everything is local arithmetic.
Rank 0 prints the narrative; every rank prints its own shard where that is the point.
"""

from __future__ import annotations

import torch

import sbpflow
from sbpflow.distributed import CommRecorder
from sbpflow.sbp import broadcast as B
from sbpflow.sbp import partial_sum as P
from sbpflow.sbp import split

rank = sbpflow.distributed.get_rank()
world = sbpflow.distributed.get_world_size()


def say(*args) -> None:
    if rank == 0:
        print(*args, flush=True)


def shards(x: sbpflow.Tensor, label: str) -> None:
    """Every rank prints its shard, in rank order."""
    for r in range(world):
        if r == rank:
            print(f"  rank {r} {label}: {x.to_local().to_torch().tolist()}", flush=True)
        sbpflow.distributed.barrier()


def comms(rec: CommRecorder) -> str:
    return ", ".join(f"{r.kind}(axis {r.axis}, {r.bytes} B)" for r in rec.records) or "no comm"


say(f"== sbpflow demo on {world} rank(s), torch {torch.__version__}")
pl = sbpflow.placement.all("cpu")
say(f"placement: {pl!r}  (mesh shape {pl.shape})")

# 1. A global tensor, split on dim 0 (uneven: 7 rows over the ranks).
sbpflow.manual_seed(0)
x = sbpflow.randn(7, 3, placement=pl, sbp=split(0), requires_grad=True)
say(f"\n1. x = sbpflow.randn(7, 3, sbp=S(0)): global shape {tuple(x.shape)}; each rank holds rows")
shards(x, "x rows")
torch.manual_seed(0)
same = torch.allclose(torch.from_numpy(x.numpy()), torch.randn(7, 3))
say(f"   same values as torch.randn(7, 3) on one process with seed 0: {same}")

# 2. Boxing: every layout change runs the collective of ARCHITECTURE's table.
say("\n2. Boxing x between layouts (the recorder logs the collectives that ran):")
for dst in [B, split(1), P]:
    with CommRecorder() as rec:
        y = x.to_global(sbp=dst)
    say(f"   S(0) -> {dst!r:<5} {comms(rec)}")
p = x.to_global(sbp=P)
for dst in [B, split(0)]:
    with CommRecorder() as rec:
        p.to_global(sbp=dst)
    say(f"   P    -> {dst!r:<5} {comms(rec)}")

# 3. Autograd: the gradient comes back in the dual layout and the leaf's grad in its own.
say("\n3. Backward through S(0) -> B: the gradient returns by reduce-scatter (dual of all-gather)")
y = x.to_global(sbp=B)
with CommRecorder() as rec:
    y.backward(sbpflow.ones(7, 3, placement=pl, sbp=B))
say(f"   backward ran: {comms(rec)}; x.grad sbp {x.grad.sbp}, sum {x.grad.numpy().sum():.0f} "
    f"(= 7*3)")

# 4. Data-parallel in miniature: B weight, S(0) batch -> P gradient -> all-reduce.
say("\n4. Data parallel: weight B, batch S(0); the weight's P gradient is all-reduced to B")
w = sbpflow.ones(3, placement=pl, sbp=B, requires_grad=True)
batch = sbpflow.tensor(torch.arange(21.0).reshape(7, 3), placement=pl, sbp=split(0))
local_loss = (batch.to_local().to_torch() * w.to_local().to_torch()).sum()
loss = sbpflow.from_torch(local_loss).to_global(pl, P)
with CommRecorder() as rec:
    loss.backward()
say(f"   loss = {loss.item():.0f} (torch: {torch.arange(21.0).sum().item():.0f}); backward ran "
    f"{comms(rec)}; w.grad = {w.grad.tolist()}")

# 5. A 2-D mesh and nd-SBP, and a change of placement (pipeline-style hand-off).
if world >= 4:
    mesh = sbpflow.placement("cpu", [[0, 1], [2, 3]])
    say(f"\n5. 2x2 mesh {mesh!r}: (S(0), S(1)) -> (B, B) gathers axis 1 then axis 0")
    z = sbpflow.tensor(torch.arange(20.0).reshape(4, 5), placement=mesh, sbp=(split(0), split(1)))
    shards(z, "(S(0), S(1)) shard")
    with CommRecorder() as rec:
        zb = z.to_global(sbp=(B, B))
    say(f"   {comms(rec)}; equal to the original: {zb.numpy().tolist() == z.numpy().tolist()}")
    stage0, stage1 = sbpflow.placement("cpu", [0, 1]), sbpflow.placement("cpu", [2, 3])
    a = sbpflow.tensor(torch.arange(8.0), placement=stage0, sbp=split(0))
    with CommRecorder() as rec:
        b = a.to_global(stage1, split(0))
    say(f"   stage hand-off ranks [0,1] -> [2,3], S(0) -> S(0): "
        f"{comms(rec) if rank == 0 else ''} -> {b.tolist()}")
say("\ndone.")
