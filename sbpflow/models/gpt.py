"""GPT: a decoder-only transformer language model, after nanoGPT's ``model.py`` (GPT-2's
architecture: learned positions, pre-LayerNorm blocks, causal attention, GELU MLP, the
output head tied to the token embedding).

Written with ``sbpflow.nn`` only, so the same code runs on local tensors (one process) and
on global tensors (data parallel, tensor parallel, or both on a 2-D mesh), and, loaded as its
torch twin (``spec.build_torch()``, see ``_twin.py``), as a plain ``torch.nn.Module``.

Tensor parallelism (Megatron-LM, Shoeybi et al. 2019), the ``"tp"`` plan below: q, k, v and
the MLP's first layer are column-parallel (each rank holds whole heads / a slice of the
hidden units), the attention and MLP output projections row-parallel (their output is a
partial sum, all-reduced once), the token embedding and LM head vocabulary-parallel (the
cross entropy never gathers the logits). A block's forward then runs two all-reduces and
its backward two, and nothing is gathered. The head count must be divisible by the TP degree.

Shapes: B batch, T sequence length, C = n_embd, nh = n_head, hs = C // nh, V = vocab_size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import sbpflow  # the tensor library (torch in the twin)
import sbpflow.nn as nn
import sbpflow.nn.functional as F
from sbpflow.models._twin import twin_builder
from sbpflow.models.spec import ModelSpec, register
from sbpflow.nn.parallel import ColwiseParallel, RowwiseParallel, VocabParallel


@dataclass
class GPTConfig:
    block_size: int = 128  # longest context; positions 0..block_size-1 are learned
    vocab_size: int = 256  # token ids 0..vocab_size-1 (256: bytes; set from the data)
    n_layer: int = 4  # transformer blocks
    n_head: int = 4  # attention heads per block (divides n_embd, and by the TP degree)
    n_embd: int = 128  # model width C
    dropout: float = 0.0  # on the embeddings, the attention weights and each residual branch
    bias: bool = True  # biases in the Linear and LayerNorm layers (GPT-2: True)

    def __post_init__(self):
        """Raises ValueError for a width the heads cannot share (checked when the config
        is made, so ``sbpflow train --config`` refuses it before starting ranks)."""
        if self.n_embd % self.n_head:
            raise ValueError(f"GPT: n_embd {self.n_embd} is not divisible by n_head "
                             f"{self.n_head}; give an n_head that divides it")


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where position t sees positions <= t. Separate q, k, v
    projections (not one fused c_attn) so that a column split gives each rank whole heads."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.q = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.k = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.v = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head  # a tensor-parallel torch twin holds n_head / tp here
        self.head_size = config.n_embd // config.n_head  # hs, whatever n_head holds
        self.dropout = config.dropout

    def forward(self, x):
        B, T, C = x.size()
        hs = self.head_size
        q = self.q(x).view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = self.k(x).view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        v = self.v(x).view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training
                                           else 0.0, is_causal=True)  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, self.n_head * hs)  # (B, T, C): heads
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    """Position-wise feed-forward: C -> 4C -> GELU -> C."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):  # (B, T, C)
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))  # (B, T, C)


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x):  # (B, T, C)
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """The language model: ``model(idx, targets=None) -> (logits, loss)``.

    ``idx`` and ``targets`` are (B, T) int64 token ids with T <= block_size; with targets
    the logits are (B, T, V) and the loss the mean cross entropy (targets -1 ignored);
    without, the logits of the last position only, (B, 1, V), and loss None.
    """

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),  # token embedding
            wpe=nn.Embedding(config.block_size, config.n_embd),  # position embedding
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying (Press & Wolf 2017)
        # GPT-2's initialisation: N(0, 0.02) everywhere, zero biases, and the projections
        # that write into the residual stream scaled by 1/sqrt(2 * n_layer).
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def get_num_params(self, non_embedding: bool = True) -> int:
        """Parameter count (the tied embedding once); ``non_embedding`` leaves out the
        position embedding, as nanoGPT reports it."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.transformer.wpe.weight.numel() if non_embedding else n

    def forward(self, idx, targets=None):
        B, T = idx.size()
        if T > self.config.block_size:
            raise ValueError(f"GPT: sequence of length {T} is longer than block_size "
                             f"{self.config.block_size}; crop it to the last block_size")
        tok = self.transformer.wte(idx)  # (B, T, C)
        pos = self.transformer.wpe.weight[:T]  # (T, C): wpe(arange(T)), without an arange
        x = self.transformer.drop(tok + pos)  # (B, T, C)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        if targets is None:  # generation: only the last position's logits are needed
            return self.lm_head(x[:, -1:, :]), None  # (B, 1, V)
        logits = self.lm_head(x)  # (B, T, V)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1),
                               ignore_index=-1)
        return logits, loss

    @sbpflow.no_grad()
    def generate(self, idx, max_new_tokens: int, temperature: float = 1.0, top_k=None):
        """Extend ``idx`` (B, T) by ``max_new_tokens`` sampled tokens -> (B, T +
        max_new_tokens). Each step feeds the last block_size tokens, divides the last
        logits by ``temperature`` and, with ``top_k``, keeps only the k most likely tokens.
        Call ``model.eval()`` first (dropout)."""
        for _ in range(max_new_tokens):
            idx_cond = idx if idx.size(1) <= self.config.block_size \
                else idx[:, -self.config.block_size:]
            logits, _ = self(idx_cond)
            logits = logits[:, -1, :] / temperature  # (B, V)
            if top_k is not None:
                v, _ = sbpflow.topk(logits, min(top_k, logits.size(-1)))  # (B, k)
                logits = logits.masked_fill(logits < v[:, -1:], float("-inf"))
            probs = F.softmax(logits, dim=-1)  # (B, V)
            idx_next = sbpflow.multinomial(probs, num_samples=1)  # (B, 1)
            idx = sbpflow.cat((idx, idx_next), dim=1)
        return idx


# Megatron tensor parallelism (see the module doc); "dp" is {} (everything replicated).
TP_PLAN = {
    "transformer.wte": VocabParallel(),  # rows split by vocabulary: output P -> B
    "transformer.h.*.attn.[qkv]": ColwiseParallel(),  # whole heads per rank: (B, T, C) S(2)
    "transformer.h.*.attn.c_proj": RowwiseParallel(),  # S(2) in, P out -> all-reduce to B
    "transformer.h.*.mlp.c_fc": ColwiseParallel(),  # hidden units split: (B, T, 4C) S(2)
    "transformer.h.*.mlp.c_proj": RowwiseParallel(),  # P out -> all-reduce to B
    "lm_head": VocabParallel(),  # logits (B, T, V) S(2): vocabulary-parallel cross entropy
}


def pipeline_split(config: GPTConfig, stages: int) -> list[list[str]]:
    """GPT's pipeline stages (``ModelSpec.pipeline_split``): the embeddings and the first
    blocks on stage 0, the blocks spread evenly (block ``i`` on stage ``i * stages //
    n_layer``), ``ln_f`` and ``lm_head`` with the last blocks on the last stage. The head
    is tied to the token embedding: sbpflow keeps the weight on stage 0 and boxes it to
    the last stage when the head runs (its gradient comes back and is summed). Any model
    with nanoGPT's module names (``transformer.wte/wpe/drop/h/ln_f``, ``lm_head``) can
    use it.

    Raises:
        ValueError: fewer blocks than stages (every stage holds at least one block).
    """
    n = config.n_layer
    if n < stages:
        raise ValueError(f"GPT: {n} blocks (n_layer) cannot fill {stages} pipeline stages "
                         f"(each stage holds at least one block); use at most {n} stages, "
                         f"or n_layer >= {stages}")
    out: list[list[str]] = [[] for _ in range(stages)]
    out[0] += ["transformer.wte", "transformer.wpe", "transformer.drop"]
    for i in range(n):
        out[i * stages // n].append(f"transformer.h.{i}")
    out[-1] += ["transformer.ln_f", "lm_head"]
    return out


def _spec(name: str, config: GPTConfig) -> ModelSpec:
    return register(ModelSpec(name=name, family="gpt", task="lm", config=config, builder=GPT,
                              plans={"tp": TP_PLAN}, default_layout="tp",
                              torch_builder=twin_builder(__name__, "GPT"),
                              pipeline_split=pipeline_split))


# CPU-sized: 0.8M parameters; trains on Shakespeare characters in minutes.
_spec("gpt-mini", GPTConfig())
# GPT-2 (Radford et al. 2019); vocabulary 50257 padded to 50304 (a multiple of 64) as in
# nanoGPT, and no dropout (pre-training).
_spec("gpt2", GPTConfig(block_size=1024, vocab_size=50304, n_layer=12, n_head=12,
                        n_embd=768))
_spec("gpt2-medium", GPTConfig(block_size=1024, vocab_size=50304, n_layer=24, n_head=16,
                               n_embd=1024))
