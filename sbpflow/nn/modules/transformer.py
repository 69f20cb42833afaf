"""TransformerEncoderLayer, TransformerEncoder, TransformerDecoderLayer,
TransformerDecoder, Transformer (torch.nn's arguments, submodule names, state-dict keys
and initialisation: a torch state_dict loads into them and back).

Masks follow torch: ``*_mask`` (L, S) or (N * nhead, L, S), bool (True = not allowed)
or float (added); ``*_key_padding_mask`` (N, S), bool (True = ignore) or float. With
global inputs a mask may be global (any layout the attention accepts) or local: a local
mask is taken as the whole value, replicated (B) on the input's placement without
communication (every rank must pass the same mask, as with a seeded model).

``*_is_causal`` is a hint as in torch: ``None`` (default) trusts the given mask, ``True``
with no mask applies the causal mask (torch raises there; sbpflow builds it shard-locally).
torch's inference fast path (nested tensors for padded batches) is not reproduced:
outputs at padded positions are computed as in training mode instead of being zeros.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch

from ...sbp import broadcast
from ...tensor import Tensor
from .. import functional as F
from .. import init
from ..module import Module
from .activation import MultiheadAttention
from .container import ModuleList
from .linear import Linear
from .norm import LayerNorm
from .pooling import Dropout

__all__ = ["TransformerEncoderLayer", "TransformerEncoder", "TransformerDecoderLayer",
           "TransformerDecoder", "Transformer"]


def _activation(activation):
    if isinstance(activation, str):
        if activation not in ("relu", "gelu"):
            raise ValueError(f"activation should be relu/gelu, not {activation}")
        return F.relu if activation == "relu" else F.gelu
    if not callable(activation):
        raise TypeError(f"activation must be 'relu', 'gelu' or a callable, got "
                        f"{type(activation).__name__}")
    return activation


def _like(mask, x):
    """``mask`` on ``x``'s placement: a local mask with a global ``x`` becomes B there
    (no communication: every rank holds the same mask)."""
    if mask is None or not isinstance(x, Tensor) or not x.is_global:
        return mask
    if isinstance(mask, torch.Tensor):
        mask = Tensor(mask)
    if mask.is_local:
        pl = x.placement
        return Tensor(mask._local.to(x._local.device), pl, (broadcast,) * pl.ndim,
                      tuple(mask.shape))
    return mask


def _local_mask(mask):
    return Tensor(mask) if isinstance(mask, torch.Tensor) else mask


def _clones(module: Module, n: int) -> ModuleList:
    """``n`` deep copies (torch's ``_get_clones``: every layer starts with the same
    parameters)."""
    return ModuleList([copy.deepcopy(module) for _ in range(n)])


class TransformerEncoderLayer(Module):
    """Self-attention and feed-forward blocks with residuals and LayerNorm
    (``torch.nn.TransformerEncoderLayer``; post-norm by default, ``norm_first`` pre-norm).
    src (S, N, E), or (N, S, E) with ``batch_first``."""

    def __init__(self, d_model: int, nhead: int, dim_feedforward: int = 2048,
                 dropout: float = 0.1, activation: str | Callable = "relu",
                 layer_norm_eps: float = 1e-5, batch_first: bool = False,
                 norm_first: bool = False, bias: bool = True, device=None, dtype=None):
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        self.self_attn = MultiheadAttention(d_model, nhead, dropout=dropout, bias=bias,
                                            batch_first=batch_first, **kw)
        self.linear1 = Linear(d_model, dim_feedforward, bias=bias, **kw)
        self.dropout = Dropout(dropout)
        self.linear2 = Linear(dim_feedforward, d_model, bias=bias, **kw)
        self.norm_first = norm_first
        self.norm1 = LayerNorm(d_model, eps=layer_norm_eps, bias=bias, **kw)
        self.norm2 = LayerNorm(d_model, eps=layer_norm_eps, bias=bias, **kw)
        self.dropout1 = Dropout(dropout)
        self.dropout2 = Dropout(dropout)
        self.activation = _activation(activation)

    def forward(self, src, src_mask=None, src_key_padding_mask=None, is_causal: bool = False):
        x = src
        src_mask = _like(_local_mask(src_mask), x)
        src_key_padding_mask = _like(_local_mask(src_key_padding_mask), x)
        if self.norm_first:
            x = x + self._sa_block(self.norm1(x), src_mask, src_key_padding_mask, is_causal)
            x = x + self._ff_block(self.norm2(x))
        else:
            x = self.norm1(x + self._sa_block(x, src_mask, src_key_padding_mask, is_causal))
            x = self.norm2(x + self._ff_block(x))
        return x

    def _sa_block(self, x, attn_mask, key_padding_mask, is_causal):
        x = self.self_attn(x, x, x, attn_mask=attn_mask, key_padding_mask=key_padding_mask,
                           need_weights=False, is_causal=is_causal)[0]
        return self.dropout1(x)

    def _ff_block(self, x):
        return self.dropout2(self.linear2(self.dropout(self.activation(self.linear1(x)))))


class TransformerEncoder(Module):
    """A stack of ``num_layers`` copies of ``encoder_layer`` (``layers.0``...), then
    ``norm`` when given (``torch.nn.TransformerEncoder``; every layer starts with the same
    parameters, as torch's deep copies do). ``enable_nested_tensor`` and ``mask_check``
    are accepted for torch's signature and have no effect (no nested-tensor fast path).

    ``forward(src, mask=None, src_key_padding_mask=None, is_causal=None)``: src (S, N, E)
    or (N, S, E) with the layers' ``batch_first``; SBP: a batch-split src stays split
    (data parallel, no collective in forward).
    """

    def __init__(self, encoder_layer: Module, num_layers: int, norm: Module | None = None,
                 enable_nested_tensor: bool = True, mask_check: bool = True):
        super().__init__()
        if not isinstance(num_layers, int) or num_layers < 0:
            raise ValueError(f"num_layers must be a non-negative int, got {num_layers!r}")
        self.layers = _clones(encoder_layer, num_layers)
        self.num_layers, self.norm = num_layers, norm
        self.enable_nested_tensor, self.mask_check = enable_nested_tensor, mask_check

    def forward(self, src, mask=None, src_key_padding_mask=None, is_causal: bool | None = None):
        mask = _like(_local_mask(mask), src)
        src_key_padding_mask = _like(_local_mask(src_key_padding_mask), src)
        out = src
        for mod in self.layers:
            out = mod(out, src_mask=mask, is_causal=bool(is_causal),
                      src_key_padding_mask=src_key_padding_mask)
        if self.norm is not None:
            out = self.norm(out)
        return out


class TransformerDecoderLayer(Module):
    """Self-attention, cross-attention on ``memory`` and feed-forward blocks with
    residuals and LayerNorm (``torch.nn.TransformerDecoderLayer``; post-norm by default,
    ``norm_first`` pre-norm). Submodules as torch's: ``self_attn``, ``multihead_attn``,
    ``linear1``, ``dropout``, ``linear2``, ``norm1..3``, ``dropout1..3``.

    ``forward(tgt, memory, tgt_mask=None, memory_mask=None, tgt_key_padding_mask=None,
    memory_key_padding_mask=None, tgt_is_causal=False, memory_is_causal=False)``: tgt
    (T, N, E), memory (S, N, E) (batch first with ``batch_first``) -> (T, N, E).
    """

    def __init__(self, d_model: int, nhead: int, dim_feedforward: int = 2048,
                 dropout: float = 0.1, activation: str | Callable = "relu",
                 layer_norm_eps: float = 1e-5, batch_first: bool = False,
                 norm_first: bool = False, bias: bool = True, device=None, dtype=None):
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        self.self_attn = MultiheadAttention(d_model, nhead, dropout=dropout, bias=bias,
                                            batch_first=batch_first, **kw)
        self.multihead_attn = MultiheadAttention(d_model, nhead, dropout=dropout, bias=bias,
                                                 batch_first=batch_first, **kw)
        self.linear1 = Linear(d_model, dim_feedforward, bias=bias, **kw)
        self.dropout = Dropout(dropout)
        self.linear2 = Linear(dim_feedforward, d_model, bias=bias, **kw)
        self.norm_first = norm_first
        self.norm1 = LayerNorm(d_model, eps=layer_norm_eps, bias=bias, **kw)
        self.norm2 = LayerNorm(d_model, eps=layer_norm_eps, bias=bias, **kw)
        self.norm3 = LayerNorm(d_model, eps=layer_norm_eps, bias=bias, **kw)
        self.dropout1 = Dropout(dropout)
        self.dropout2 = Dropout(dropout)
        self.dropout3 = Dropout(dropout)
        self.activation = _activation(activation)

    def forward(self, tgt, memory, tgt_mask=None, memory_mask=None, tgt_key_padding_mask=None,
                memory_key_padding_mask=None, tgt_is_causal: bool = False,
                memory_is_causal: bool = False):
        x = tgt
        tgt_mask, memory_mask, tgt_key_padding_mask, memory_key_padding_mask = (
            _like(_local_mask(m), x) for m in (tgt_mask, memory_mask, tgt_key_padding_mask,
                                               memory_key_padding_mask))
        if self.norm_first:
            x = x + self._sa_block(self.norm1(x), tgt_mask, tgt_key_padding_mask,
                                   tgt_is_causal)
            x = x + self._mha_block(self.norm2(x), memory, memory_mask,
                                    memory_key_padding_mask, memory_is_causal)
            x = x + self._ff_block(self.norm3(x))
        else:
            x = self.norm1(x + self._sa_block(x, tgt_mask, tgt_key_padding_mask,
                                              tgt_is_causal))
            x = self.norm2(x + self._mha_block(x, memory, memory_mask, memory_key_padding_mask,
                                               memory_is_causal))
            x = self.norm3(x + self._ff_block(x))
        return x

    def _sa_block(self, x, attn_mask, key_padding_mask, is_causal):
        x = self.self_attn(x, x, x, attn_mask=attn_mask, key_padding_mask=key_padding_mask,
                           need_weights=False, is_causal=bool(is_causal))[0]
        return self.dropout1(x)

    def _mha_block(self, x, mem, attn_mask, key_padding_mask, is_causal):
        x = self.multihead_attn(x, mem, mem, attn_mask=attn_mask,
                                key_padding_mask=key_padding_mask, need_weights=False,
                                is_causal=bool(is_causal))[0]
        return self.dropout2(x)

    def _ff_block(self, x):
        return self.dropout3(self.linear2(self.dropout(self.activation(self.linear1(x)))))


class TransformerDecoder(Module):
    """A stack of ``num_layers`` copies of ``decoder_layer`` (``layers.0``...), then
    ``norm`` when given (``torch.nn.TransformerDecoder``). ``forward(tgt, memory,
    tgt_mask=None, memory_mask=None, tgt_key_padding_mask=None,
    memory_key_padding_mask=None, tgt_is_causal=None, memory_is_causal=False)``."""

    def __init__(self, decoder_layer: Module, num_layers: int, norm: Module | None = None):
        super().__init__()
        if not isinstance(num_layers, int) or num_layers < 0:
            raise ValueError(f"num_layers must be a non-negative int, got {num_layers!r}")
        self.layers = _clones(decoder_layer, num_layers)
        self.num_layers, self.norm = num_layers, norm

    def forward(self, tgt, memory, tgt_mask=None, memory_mask=None, tgt_key_padding_mask=None,
                memory_key_padding_mask=None, tgt_is_causal: bool | None = None,
                memory_is_causal: bool = False):
        tgt_mask, memory_mask, tgt_key_padding_mask, memory_key_padding_mask = (
            _like(_local_mask(m), tgt) for m in (tgt_mask, memory_mask, tgt_key_padding_mask,
                                                 memory_key_padding_mask))
        out = tgt
        for mod in self.layers:
            out = mod(out, memory, tgt_mask=tgt_mask, memory_mask=memory_mask,
                      tgt_key_padding_mask=tgt_key_padding_mask,
                      memory_key_padding_mask=memory_key_padding_mask,
                      tgt_is_causal=bool(tgt_is_causal), memory_is_causal=memory_is_causal)
        if self.norm is not None:
            out = self.norm(out)
        return out


class Transformer(Module):
    """Encoder-decoder transformer (``torch.nn.Transformer``; "Attention Is All You Need").

    Submodules ``encoder`` (TransformerEncoder with a final LayerNorm ``encoder.norm``)
    and ``decoder`` (likewise), or ``custom_encoder``/``custom_decoder``; parameters with
    more than one dim are re-initialised xavier-uniform in ``parameters()`` order, as
    torch does, so the same seed gives torch's parameters.

    ``forward(src, tgt, src_mask=None, tgt_mask=None, memory_mask=None,
    src_key_padding_mask=None, tgt_key_padding_mask=None, memory_key_padding_mask=None,
    src_is_causal=None, tgt_is_causal=None, memory_is_causal=False)``: src (S, N, E), tgt
    (T, N, E) (batch first with ``batch_first``) -> (T, N, E). SBP: batch-split inputs
    stay split (data parallel), parameters B.

    Raises:
        RuntimeError: the batch sizes of src and tgt differ, or a feature size is not
            ``d_model`` (torch's errors).
    """

    def __init__(self, d_model: int = 512, nhead: int = 8, num_encoder_layers: int = 6,
                 num_decoder_layers: int = 6, dim_feedforward: int = 2048,
                 dropout: float = 0.1, activation: str | Callable = "relu",
                 custom_encoder: Module | None = None, custom_decoder: Module | None = None,
                 layer_norm_eps: float = 1e-5, batch_first: bool = False,
                 norm_first: bool = False, bias: bool = True, device=None, dtype=None):
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        if custom_encoder is not None:
            self.encoder = custom_encoder
        else:
            layer = TransformerEncoderLayer(d_model, nhead, dim_feedforward, dropout,
                                            activation, layer_norm_eps, batch_first,
                                            norm_first, bias, **kw)
            self.encoder = TransformerEncoder(layer, num_encoder_layers,
                                              LayerNorm(d_model, eps=layer_norm_eps, bias=bias,
                                                        **kw))
        if custom_decoder is not None:
            self.decoder = custom_decoder
        else:
            layer = TransformerDecoderLayer(d_model, nhead, dim_feedforward, dropout,
                                            activation, layer_norm_eps, batch_first,
                                            norm_first, bias, **kw)
            self.decoder = TransformerDecoder(layer, num_decoder_layers,
                                              LayerNorm(d_model, eps=layer_norm_eps, bias=bias,
                                                        **kw))
        self._reset_parameters()
        self.d_model, self.nhead, self.batch_first = d_model, nhead, batch_first

    def _reset_parameters(self) -> None:
        for p in self.parameters():
            if p.ndim > 1:
                init.xavier_uniform_(p)

    def forward(self, src, tgt, src_mask=None, tgt_mask=None, memory_mask=None,
                src_key_padding_mask=None, tgt_key_padding_mask=None,
                memory_key_padding_mask=None, src_is_causal: bool | None = None,
                tgt_is_causal: bool | None = None, memory_is_causal: bool = False):
        if src.ndim == 3:
            b = 0 if self.batch_first else 1
            if src.shape[b] != tgt.shape[b]:
                raise RuntimeError(f"the batch number of src and tgt must be equal (src "
                                   f"{tuple(src.shape)}, tgt {tuple(tgt.shape)}, batch dim {b})")
        if src.shape[-1] != self.d_model or tgt.shape[-1] != self.d_model:
            raise RuntimeError(f"the feature number of src and tgt must be equal to d_model "
                               f"({self.d_model}); got {src.shape[-1]} and {tgt.shape[-1]}")
        memory = self.encoder(src, mask=src_mask, src_key_padding_mask=src_key_padding_mask,
                              is_causal=src_is_causal)
        return self.decoder(tgt, memory, tgt_mask=tgt_mask, memory_mask=memory_mask,
                            tgt_key_padding_mask=tgt_key_padding_mask,
                            memory_key_padding_mask=memory_key_padding_mask,
                            tgt_is_causal=tgt_is_causal, memory_is_causal=memory_is_causal)

    @staticmethod
    def generate_square_subsequent_mask(sz: int, device=None, dtype=None) -> Tensor:
        """A local (sz, sz) float mask: ``-inf`` above the diagonal, 0 elsewhere
        (``torch.nn.Transformer.generate_square_subsequent_mask``). Pass it with global
        inputs as is (it is replicated on their placement without communication)."""
        return Tensor(torch.triu(torch.full((sz, sz), float("-inf"), dtype=dtype,
                                            device=device), diagonal=1))
