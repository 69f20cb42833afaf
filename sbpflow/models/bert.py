"""BERT: a bidirectional transformer encoder trained by masked language modelling (Devlin et
al. 2019), with the original's post-LayerNorm blocks, learned position and token-type
embeddings, GELU, and the masked-language-model head whose output layer is tied to the
word embedding. The next-sentence head and the pooler are left out (MLM only).

Written with ``sbpflow.nn`` only: the same code runs locally, on global tensors in any
layout, and (as the torch twin, ``spec.build_torch()``) as a plain ``torch.nn.Module``.
Tensor parallelism follows the GPT file: q, k, v and the first MLP layer column-parallel,
the attention output and second MLP layer row-parallel (one all-reduce each), the word
embedding and the tied MLM decoder vocabulary-parallel.

Shapes: B batch, T sequence length, H = hidden, nh = n_head, hs = H // nh, V = vocab_size.
"""

from __future__ import annotations

from dataclasses import dataclass

import sbpflow.nn as nn
import sbpflow.nn.functional as F
from sbpflow.models._twin import twin_builder
from sbpflow.models.spec import ModelSpec, register
from sbpflow.nn.parallel import ColwiseParallel, RowwiseParallel, VocabParallel


@dataclass
class BertConfig:
    vocab_size: int = 256  # token ids 0..vocab_size-1 (256: bytes; set from the data)
    max_position: int = 128  # longest sequence (learned positions)
    type_vocab_size: int = 2  # segment (token type) ids: sentence A / B
    n_layer: int = 4  # encoder blocks
    n_head: int = 4  # attention heads (divides hidden, and by the TP degree)
    hidden: int = 128  # model width H
    intermediate: int = 512  # MLP hidden units (BERT: 4 H)
    dropout: float = 0.1  # on the embeddings, the attention weights and each residual branch
    layer_norm_eps: float = 1e-12  # BERT's LayerNorm epsilon

    def __post_init__(self):
        """Raises ValueError for a width the heads cannot share (see GPTConfig)."""
        if self.hidden % self.n_head:
            raise ValueError(f"BERT: hidden {self.hidden} is not divisible by n_head "
                             f"{self.n_head}; give an n_head that divides it")


class SelfAttention(nn.Module):
    """Multi-head self-attention over all positions (padding masked out if asked)."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.q = nn.Linear(config.hidden, config.hidden)
        self.k = nn.Linear(config.hidden, config.hidden)
        self.v = nn.Linear(config.hidden, config.hidden)
        self.proj = nn.Linear(config.hidden, config.hidden)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head  # a tensor-parallel torch twin holds n_head / tp here
        self.head_size = config.hidden // config.n_head  # hs, whatever n_head holds
        self.dropout = config.dropout

    def forward(self, x, mask=None):  # x (B, T, H); mask (B, 1, 1, T) bool, True = attend
        B, T, H = x.size()
        hs = self.head_size
        q = self.q(x).view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = self.k(x).view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        v = self.v(x).view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                           dropout_p=self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).contiguous().view(B, T, self.n_head * hs)  # (B, T, H)
        return self.resid_dropout(self.proj(y))


class MLP(nn.Module):
    """Position-wise feed-forward: H -> intermediate -> GELU -> H."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.fc = nn.Linear(config.hidden, config.intermediate)
        self.gelu = nn.GELU()
        self.proj = nn.Linear(config.intermediate, config.hidden)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):  # (B, T, H)
        return self.dropout(self.proj(self.gelu(self.fc(x))))  # (B, T, H)


class Block(nn.Module):
    """Post-LayerNorm encoder block (as BERT): ln(x + attn(x)), then ln(x + mlp(x))."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.attn = SelfAttention(config)
        self.ln_1 = nn.LayerNorm(config.hidden, eps=config.layer_norm_eps)
        self.mlp = MLP(config)
        self.ln_2 = nn.LayerNorm(config.hidden, eps=config.layer_norm_eps)

    def forward(self, x, mask=None):  # (B, T, H)
        x = self.ln_1(x + self.attn(x, mask))
        return self.ln_2(x + self.mlp(x))


class Embeddings(nn.Module):
    """word + position + token type, then LayerNorm and dropout."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.word = nn.Embedding(config.vocab_size, config.hidden)
        self.position = nn.Embedding(config.max_position, config.hidden)
        self.token_type = nn.Embedding(config.type_vocab_size, config.hidden)
        self.ln = nn.LayerNorm(config.hidden, eps=config.layer_norm_eps)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, input_ids, token_type_ids=None):  # (B, T) int64
        T = input_ids.size(1)
        x = self.word(input_ids) + self.position.weight[:T]  # (B, T, H); positions 0..T-1
        if token_type_ids is None:
            x = x + self.token_type.weight[0]  # every token in segment 0
        else:
            x = x + self.token_type(token_type_ids)
        return self.drop(self.ln(x))


class MLMHead(nn.Module):
    """Dense + GELU + LayerNorm, then the decoder to vocabulary logits (its weight is the
    word embedding; its bias its own)."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden, config.hidden)
        self.gelu = nn.GELU()
        self.ln = nn.LayerNorm(config.hidden, eps=config.layer_norm_eps)
        self.decoder = nn.Linear(config.hidden, config.vocab_size)

    def forward(self, x):  # (B, T, H)
        return self.decoder(self.ln(self.gelu(self.dense(x))))  # (B, T, V)


class Bert(nn.Module):
    """The masked language model: ``model(input_ids, labels=None, token_type_ids=None,
    attention_mask=None) -> (logits, loss)``.

    ``input_ids`` (B, T) int64 with T <= max_position; ``labels`` (B, T) int64, the original
    token where the input was masked and -100 elsewhere (ignored); ``token_type_ids``
    (B, T), default all 0; ``attention_mask`` (B, T), 1 for real tokens and 0 for padding
    (default: attend everywhere). Logits (B, T, V); loss the mean cross entropy over the
    labelled positions, or None without labels.
    """

    def __init__(self, config: BertConfig):
        super().__init__()
        self.config = config
        self.embeddings = Embeddings(config)
        self.blocks = nn.ModuleList([Block(config) for _ in range(config.n_layer)])
        self.head = MLMHead(config)
        self.head.decoder.weight = self.embeddings.word.weight  # weight tying
        # BERT's initialisation: N(0, 0.02) weights, zero biases, LayerNorm 1 and 0.
        self.apply(self._init_weights)

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)

    def forward(self, input_ids, labels=None, token_type_ids=None, attention_mask=None):
        B, T = input_ids.size()
        if T > self.config.max_position:
            raise ValueError(f"BERT: sequence of length {T} is longer than max_position "
                             f"{self.config.max_position}")
        mask = None
        if attention_mask is not None:
            mask = (attention_mask != 0).view(B, 1, 1, T)  # (B, 1, 1, T): True = attend
        x = self.embeddings(input_ids, token_type_ids)  # (B, T, H)
        for block in self.blocks:
            x = block(x, mask)
        logits = self.head(x)  # (B, T, V)
        if labels is None:
            return logits, None
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1),
                               ignore_index=-100)
        return logits, loss


# Megatron tensor parallelism, as in gpt.py; "dp" is {} (everything replicated).
TP_PLAN = {
    "embeddings.word": VocabParallel(),  # rows split by vocabulary: output P -> B
    "blocks.*.attn.[qkv]": ColwiseParallel(),  # whole heads per rank: (B, T, H) S(2)
    "blocks.*.attn.proj": RowwiseParallel(),  # P out -> all-reduce to B
    "blocks.*.mlp.fc": ColwiseParallel(),  # hidden units split
    "blocks.*.mlp.proj": RowwiseParallel(),  # P out -> all-reduce to B
    "head.decoder": VocabParallel(),  # logits (B, T, V) S(2): vocabulary-parallel loss
}


def _spec(name: str, config: BertConfig) -> ModelSpec:
    return register(ModelSpec(name=name, family="bert", task="mlm", config=config,
                              builder=Bert, plans={"tp": TP_PLAN}, default_layout="dp",
                              torch_builder=twin_builder(__name__, "Bert")))


# CPU-sized: 0.9M parameters.
_spec("bert-mini", BertConfig())
# BERT-base (uncased WordPiece vocabulary of 30522): 110M parameters.
_spec("bert-base", BertConfig(vocab_size=30522, max_position=512, n_layer=12, n_head=12,
                              hidden=768, intermediate=3072))
