"""Predict a GPT training step at a scale this machine cannot run: Megatron-style tensor,
pipeline and data parallelism (PTD-P, Narayanan et al., SC'21) on a hardware profile.

The step is built from the cost model's terms (:mod:`sbpflow.planner.cost`), per
micro-batch of ``b`` sequences of ``s`` tokens, layer by layer (hidden size ``h``, ``a``
heads, tensor-parallel degree ``t``):

* matrix multiplies, forward: ``(24 b s h^2 + 4 b s^2 h) / t`` FLOPs (the QKV, projection
  and MLP GEMMs and the attention scores and values; Narayanan et al., eq. 3's terms);
  backward twice that; a recomputed forward once more under activation checkpointing;
* memory-bound kernels (layer norms, bias-GeLU, softmax, dropouts, residual adds, 2-byte
  values), forward: ``2 b s (14 h + (14 h + 4.5 a s) / t)`` bytes read and written (the
  layer norms, dropouts and residuals run on every tensor-parallel rank, the rest on its
  shard; the attention's scale-mask-softmax and dropout touch ``a s^2`` values per
  sequence); backward twice, the recomputation once more;
* tensor parallelism: per layer two all-reduces of ``2 b s h`` bytes in forward, two in
  backward, two in the recomputation, inside a node;
* the last stage's logits (``2 b s h V / t`` FLOPs forward, three times in all) and its
  cross-entropy over ``V / t`` logits per token; the first stage's embedding all-reduce;
* pipeline parallelism: each stage sends the micro-batch's activations on and receives
  their gradient (``2 b s h / t`` bytes each, Megatron's scatter/gather), between nodes
  when a stage fills one; the schedule's time for ``m`` micro-batches is
  ``m T_max + (sum of the stages' T - T_max) / v`` (1F1B: ``v = 1``; interleaved: ``v``
  model chunks per rank), ``T`` being a stage's forward and backward of one micro-batch;
* data parallelism: the gradients (fp32, Megatron's ``--accumulate-allreduce-grads-in-fp32``)
  all-reduced after the pipeline drains, between nodes, not overlapped (Megatron 2021);
* the Adam update: 30 bytes per parameter read and written (fp32 master, gradient, two
  moments; the fp16 copy).

Memory per device (the largest stage's): 18 bytes per parameter (fp16 weights, fp32
gradients, master weights and two moments; no ZeRO), and the activations: with
checkpointing each layer's input (``2 b s h`` bytes) per micro-batch in flight (1F1B:
stage ``s`` of ``p`` holds ``p - s``) plus one layer's activations for its backward,
``s b h (10 + 24/t + 5 a s / (h t))`` bytes (Korthikanti et al., "Reducing Activation
Recomputation in Large Transformer Models", 2022, eq. 2), and the last stage's fp32
logits.

Left out: kernel launch gaps, the embedding's lookup, the optimizer's global-norm
clipping, data loading, overlap of communication with compute (none assumed), stragglers
and network congestion. Published figures it is checked against (tests/test_planner.py):
:data:`NARAYANAN_2021_TABLE_1`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .cost import collective_time, op_time
from .hardware import Hardware

__all__ = ["GPTShape", "Layout", "NARAYANAN_2021_TABLE_1", "Prediction", "model_flops",
           "search_gpt", "simulate_gpt"]


@dataclass(frozen=True)
class GPTShape:
    """A GPT: ``layers``, ``hidden``, ``heads``, sequence length ``seq``, ``vocab``."""

    layers: int
    hidden: int
    heads: int
    seq: int = 2048
    vocab: int = 51200

    def __post_init__(self):
        bad = {k: v for k, v in vars(self).items() if not isinstance(v, int) or v < 1}
        if bad:
            raise ValueError(f"GPTShape: {bad} must be integers >= 1")
        if self.hidden % self.heads:
            raise ValueError(f"GPTShape: hidden size {self.hidden} is not divisible by "
                             f"{self.heads} heads")

    @property
    def params(self) -> float:
        """Parameters (Narayanan et al., eq. 2): ``12 l h^2 (1 + 13/(12 h) + (V + s)/(12 l h))``."""
        l, h = self.layers, self.hidden
        return 12 * l * h * h * (1 + 13 / (12 * h) + (self.vocab + self.seq) / (12 * l * h))


@dataclass(frozen=True)
class Layout:
    """Tensor, pipeline and data-parallel degrees, the micro-batch size (sequences),
    the pipeline schedule's model chunks per rank (``virtual``: 1 is 1F1B, more is
    Megatron's interleaved schedule) and full activation recomputation."""

    tp: int
    pp: int
    dp: int
    micro_batch: int = 1
    virtual: int = 1
    recompute: bool = True

    def __post_init__(self):
        bad = {k: v for k, v in vars(self).items()
               if k != "recompute" and (not isinstance(v, int) or v < 1)}
        if bad:
            raise ValueError(f"Layout: {bad} must be integers >= 1")

    @property
    def devices(self) -> int:
        return self.tp * self.pp * self.dp


@dataclass
class Prediction:
    """A predicted training step: ``step_s`` seconds, split into ``terms`` (seconds:
    compute, tensor-parallel communication, pipeline transfers, pipeline bubble,
    data-parallel communication, optimizer), the model FLOP/s per device by Narayanan et
    al.'s count (``tflops_per_device``, in TFLOP/s), ``memory_bytes`` per device (the
    largest stage's) and whether it fits the device."""

    step_s: float
    terms: dict = field(default_factory=dict)
    tflops_per_device: float = 0.0
    memory_bytes: float = 0.0
    fits: bool = True


def model_flops(shape: GPTShape, global_batch: int, recompute: bool = True) -> float:
    """FLOPs of one training step (Narayanan et al., eq. 3, which counts the recomputed
    forward: ``96 B s l h^2 (1 + s/(6h) + V/(16 l h))``; without recomputation 3/4 of the
    layers' part)."""
    b, s, l, h, v = global_batch, shape.seq, shape.layers, shape.hidden, shape.vocab
    layers = (96 if recompute else 72) * b * s * l * h * h * (1 + s / (6 * h))
    return layers + 6 * b * s * h * v


def _layer_times(shape: GPTShape, lay: Layout, hw: Hardware, dtype: str) -> tuple:
    """(compute seconds, tensor-parallel seconds) of one layer for one micro-batch:
    forward, backward and (with checkpointing) the recomputed forward."""
    b, s, h, a, t = lay.micro_batch, shape.seq, shape.hidden, shape.heads, lay.tp
    passes = 4 if lay.recompute else 3  # forward 1, backward 2, recomputation 1
    gemm = (24 * b * s * h * h + 4 * b * s * s * h) / t
    mem = 2 * b * s * (14 * h + (14 * h + 4.5 * a * s) / t)
    compute = passes * (op_time(gemm, 0, hw, dtype) + op_time(0, mem, hw, dtype))
    link = hw.link(inter_node=t > hw.devices_per_node)
    reduces = 4 + (2 if lay.recompute else 0)
    comm = reduces * collective_time("all_reduce", 2 * b * s * h, t, link)
    return compute, comm


def simulate_gpt(shape: GPTShape, lay: Layout, global_batch: int, hw: Hardware,
                 dtype: str | None = None) -> Prediction:
    """Predict one training step of ``shape`` laid out as ``lay`` on ``lay.devices``
    devices of ``hw`` with ``global_batch`` sequences per step (see the module doc).
    ``dtype``: the matmuls' (a key of ``hw.peak_flops``; default ``hw.default_dtype``).

    Raises:
        ValueError: layers not divisible by ``pp * virtual``, heads or hidden size by
            ``tp``, a global batch < 1 or not divisible by ``dp * micro_batch``.
        KeyError: ``hw`` lists no peak for ``dtype``.
    """
    dtype = dtype or hw.default_dtype
    t, p, d, b, v = lay.tp, lay.pp, lay.dp, lay.micro_batch, lay.virtual
    if not isinstance(global_batch, int) or global_batch < 1:
        raise ValueError(f"global batch {global_batch!r}: give an integer >= 1")
    if shape.layers % (p * v):
        raise ValueError(f"{shape.layers} layers cannot be cut into {p} x {v} equal stages")
    if shape.heads % t or shape.hidden % t:
        raise ValueError(f"{shape.heads} heads / hidden {shape.hidden} not divisible by "
                         f"tensor parallelism {t}")
    if global_batch % (d * b):
        raise ValueError(f"global batch {global_batch} is not a multiple of data "
                         f"parallelism {d} x micro-batch {b}")
    s, h, V = shape.seq, shape.hidden, shape.vocab
    m = global_batch // (d * b)  # micro-batches per pipeline
    per_stage = shape.layers // p
    compute_l, tp_l = _layer_times(shape, lay, hw, dtype)
    # the last stage's logits and cross-entropy; the first stage's embedding all-reduce
    intra = hw.link(inter_node=t > hw.devices_per_node)
    logits = 3 * op_time(2 * b * s * h * V / t, 0, hw, dtype) + \
        op_time(0, 2 * 4 * b * s * V / t * 2, hw, dtype)
    logits_tp = 3 * collective_time("all_reduce", 4 * b * s, t, intra)
    embed_tp = 2 * collective_time("all_reduce", 2 * b * s * h, t, intra)
    stages = []
    for st in range(p):
        c = per_stage * compute_l + (logits if st == p - 1 else 0.0)
        c_tp = per_stage * tp_l + (logits_tp if st == p - 1 else 0.0) + \
            (embed_tp if st == 0 else 0.0)
        stages.append((c, c_tp))
    between = hw.link(inter_node=t * p > hw.devices_per_node or t >= hw.devices_per_node)
    p2p = 2 * collective_time("send_recv", 2 * b * s * h / t, 2, between) if p > 1 else 0.0
    per_mb = [c + c_tp + p2p for c, c_tp in stages]
    slow = max(per_mb)
    pipeline = m * slow + (sum(per_mb) - slow) / v
    busy = m * (sum(c for c, _ in stages) / p)
    comm_tp = m * sum(c_tp for _, c_tp in stages) / p
    # data parallelism and the update, on the stage with the most parameters
    layer_params = 12 * h * h + 13 * h
    stage_params = [per_stage * layer_params + (V * h + s * h if st in (0, p - 1) else 0)
                    for st in range(p)]
    params = max(stage_params) / t
    dp_link = hw.link(inter_node=t * p * d > hw.devices_per_node)
    dp = collective_time("all_reduce", 4 * params, d, dp_link)
    update = op_time(0, 30 * params, hw, "float32")
    step = pipeline + dp + update
    bubble = pipeline - busy - comm_tp - m * p2p
    terms = {"compute": busy, "tensor-parallel communication": comm_tp,
             "pipeline transfers": m * p2p,
             "pipeline bubble": bubble if bubble > 1e-9 * pipeline else 0.0,
             "data-parallel communication": dp, "optimizer": update}
    # memory, per stage: stage st of a 1F1B pipeline holds p - st micro-batches in flight
    # (interleaved: about (p - 1) / v more on the first); the last also its fp32 logits
    a = shape.heads
    act_layer = s * b * h * (10 + 24 / t + 5 * a * s / (h * t))
    memory = 0.0
    for st in range(p):
        in_flight = min(m, p - st) if v == 1 else min(m, p - st + (p - 1) // v)
        if lay.recompute:
            acts = in_flight * per_stage * 2 * b * s * h + act_layer
        else:
            acts = in_flight * per_stage * act_layer
        logits_mem = 4 * b * s * V / t if st == p - 1 else 0.0
        memory = max(memory, 18 * stage_params[st] / t + acts + logits_mem)
    flops = model_flops(shape, global_batch, lay.recompute)
    return Prediction(step, terms, flops / (lay.devices * step) / 1e12, memory,
                      memory <= hw.memory_bytes)


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def search_gpt(shape: GPTShape, devices: int, global_batch: int, hw: Hardware,
               dtype: str | None = None, micro_batches=(1, 2, 4, 8), virtual=(1, 2, 4),
               top: int = 5) -> list[tuple[Layout, Prediction]]:
    """The ``top`` fastest layouts of ``shape`` on ``devices`` devices of ``hw`` that fit
    its memory, fastest first: every tensor-parallel degree dividing the heads, the
    hidden size and a node's devices, pipeline degree dividing the layers, data parallelism for
    the rest, each micro-batch size in ``micro_batches`` dividing the batch and model
    chunks per rank in ``virtual`` (activation recomputation on); equal times: the one
    with less memory first. Empty when none fits.

    Raises:
        ValueError: ``devices`` < 1 or ``global_batch`` < 1, or no layout divides the
            batch (``global_batch`` not a multiple of any data-parallel degree times
            micro-batch size).
    """
    if devices < 1 or global_batch < 1 or top < 1:
        raise ValueError(f"search_gpt: devices={devices}, global_batch={global_batch} and "
                         f"top={top} must be >= 1")
    found, tried = [], 0
    for t in _divisors(devices):
        if hw.devices_per_node % t or shape.heads % t or shape.hidden % t:
            continue  # a tensor-parallel group inside one node, nodes split evenly
        for p in _divisors(devices // t):
            if shape.layers % p:
                continue
            d = devices // (t * p)
            for b in micro_batches:
                if global_batch % (d * b):
                    continue
                for v in virtual:
                    if (v > 1 and p == 1) or shape.layers % (p * v):
                        continue
                    lay = Layout(t, p, d, b, v)
                    pred = simulate_gpt(shape, lay, global_batch, hw, dtype)
                    tried += 1
                    if pred.fits:
                        found.append((lay, pred))
    if not tried:
        raise ValueError(
            f"no layout of {devices} devices divides the global batch of {global_batch} "
            f"sequences (data parallelism x micro-batch, micro-batches {list(micro_batches)})"
            f"; make the batch a multiple of the data-parallel degree")
    found.sort(key=lambda lp: (lp[1].step_s, lp[1].memory_bytes))  # ties: less memory
    return found[:top]


# Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
# Megatron-LM", SC'21, Table 1 (weak scaling on DGX A100 80GB, sequence 2048, vocabulary
# 51200): (billions of parameters, heads, hidden, layers, tensor-parallel,
# pipeline-parallel, GPUs, global batch, achieved TFLOP/s per GPU).
NARAYANAN_2021_TABLE_1 = (
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
    (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
    (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
    (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
)
