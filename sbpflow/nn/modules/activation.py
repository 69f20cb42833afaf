"""Activations, Softmax/LogSoftmax, MultiheadAttention (torch.nn's arguments and names)."""

from __future__ import annotations

import torch

from ...ops.creation import full
from ...sbp import broadcast
from .. import functional as F
from .. import init
from ..module import Module
from ._common import empty_param, optional_param
from .linear import Linear

__all__ = ["ReLU", "GELU", "SiLU", "Tanh", "Sigmoid", "Softmax", "Softmax2d", "LogSoftmax",
           "MultiheadAttention", "CELU", "ELU", "GLU", "Hardshrink", "Hardsigmoid", "Hardswish",
           "Hardtanh", "LeakyReLU", "LogSigmoid", "Mish", "PReLU", "ReLU6", "SELU", "Softmin",
           "Softplus", "Softshrink", "Softsign", "Tanhshrink", "Threshold"]


class ReLU(Module):
    def __init__(self, inplace: bool = False):
        super().__init__()
        self.inplace = inplace

    def forward(self, input):  # noqa: A002
        return F.relu(input, inplace=self.inplace)


class GELU(Module):
    """``approximate``: ``'none'`` (exact, erf) or ``'tanh'``."""

    def __init__(self, approximate: str = "none"):
        super().__init__()
        self.approximate = approximate

    def forward(self, input):  # noqa: A002
        return F.gelu(input, approximate=self.approximate)

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"


class SiLU(Module):
    def __init__(self, inplace: bool = False):
        super().__init__()
        self.inplace = inplace

    def forward(self, input):  # noqa: A002
        return F.silu(input, inplace=self.inplace)


class Tanh(Module):
    def forward(self, input):  # noqa: A002
        return F.tanh(input)


class Sigmoid(Module):
    def forward(self, input):  # noqa: A002
        return F.sigmoid(input)


class Softmax(Module):
    """Softmax over ``dim``; over a split dim: all-reduce MAX and SUM, not a gather."""

    def __init__(self, dim: int | None = None):
        super().__init__()
        self.dim = dim

    def forward(self, input):  # noqa: A002
        return F.softmax(input, self.dim)

    def extra_repr(self) -> str:
        return f"dim={self.dim}"


class Softmax2d(Module):
    """Softmax over the channels of each spatial position (``torch.nn.Softmax2d``): input
    (N, C, H, W) or (C, H, W), softmax over dim -3. SBP as :func:`sbpflow.nn.functional.
    softmax` (a split C: all-reduce MAX and SUM, no gather).

    Raises:
        ValueError: an input that is not 3-D or 4-D.
    """

    def forward(self, input):  # noqa: A002
        if input.ndim not in (3, 4):
            raise ValueError(f"Softmax2d: expected input to be 3D or 4D, got {input.ndim}D "
                             f"instead")
        return F.softmax(input, -3)


class LogSoftmax(Softmax):
    def forward(self, input):  # noqa: A002
        return F.log_softmax(input, self.dim)


class Softmin(Softmax):
    """``softmax(-x, dim)``; over a split dim: all-reduce MAX and SUM, not a gather."""

    def forward(self, input):  # noqa: A002
        return F.softmin(input, self.dim)


class _Inplace(Module):
    """An elementwise activation with torch's ``inplace`` flag (``F.<fn>(x, inplace=)``)."""

    fn = None

    def __init__(self, inplace: bool = False):
        super().__init__()
        self.inplace = inplace

    def forward(self, input):  # noqa: A002
        return type(self).fn(input, inplace=self.inplace)

    def extra_repr(self) -> str:
        return "inplace=True" if self.inplace else ""


class _Plain(Module):
    """An elementwise activation without arguments."""

    fn = None

    def forward(self, input):  # noqa: A002
        return type(self).fn(input)


class Hardswish(_Inplace):
    fn = staticmethod(F.hardswish)


class Hardsigmoid(_Inplace):
    fn = staticmethod(F.hardsigmoid)


class Mish(_Inplace):
    fn = staticmethod(F.mish)


class SELU(_Inplace):
    fn = staticmethod(F.selu)


class LogSigmoid(_Plain):
    fn = staticmethod(F.logsigmoid)


class Softsign(_Plain):
    fn = staticmethod(F.softsign)


class Tanhshrink(_Plain):
    fn = staticmethod(F.tanhshrink)


class LeakyReLU(Module):
    def __init__(self, negative_slope: float = 1e-2, inplace: bool = False):
        super().__init__()
        self.negative_slope, self.inplace = negative_slope, inplace

    def forward(self, input):  # noqa: A002
        return F.leaky_relu(input, self.negative_slope, self.inplace)

    def extra_repr(self) -> str:
        return f"negative_slope={self.negative_slope}" + (", inplace=True" if self.inplace else "")


class ELU(Module):
    def __init__(self, alpha: float = 1.0, inplace: bool = False):
        super().__init__()
        self.alpha, self.inplace = alpha, inplace

    def forward(self, input):  # noqa: A002
        return F.elu(input, self.alpha, self.inplace)

    def extra_repr(self) -> str:
        return f"alpha={self.alpha}" + (", inplace=True" if self.inplace else "")


class CELU(ELU):
    def forward(self, input):  # noqa: A002
        return F.celu(input, self.alpha, self.inplace)


class Hardtanh(Module):
    """``min_value``/``max_value`` are torch's deprecated spellings of ``min_val``/``max_val``."""

    def __init__(self, min_val: float = -1.0, max_val: float = 1.0, inplace: bool = False,
                 min_value: float | None = None, max_value: float | None = None):
        super().__init__()
        min_val = min_val if min_value is None else min_value
        max_val = max_val if max_value is None else max_value
        if max_val <= min_val:
            raise ValueError(f"Hardtanh: max_val ({max_val}) must be greater than min_val "
                             f"({min_val})")
        self.min_val, self.max_val, self.inplace = min_val, max_val, inplace

    def forward(self, input):  # noqa: A002
        return F.hardtanh(input, self.min_val, self.max_val, self.inplace)

    def extra_repr(self) -> str:
        return (f"min_val={self.min_val}, max_val={self.max_val}"
                + (", inplace=True" if self.inplace else ""))


class ReLU6(Hardtanh):
    def __init__(self, inplace: bool = False):
        super().__init__(0.0, 6.0, inplace)

    def extra_repr(self) -> str:
        return "inplace=True" if self.inplace else ""


class Softplus(Module):
    def __init__(self, beta: float = 1.0, threshold: float = 20.0):
        super().__init__()
        self.beta, self.threshold = beta, threshold

    def forward(self, input):  # noqa: A002
        return F.softplus(input, self.beta, self.threshold)

    def extra_repr(self) -> str:
        return f"beta={self.beta}, threshold={self.threshold}"


class Softshrink(Module):
    def __init__(self, lambd: float = 0.5):
        super().__init__()
        self.lambd = lambd

    def forward(self, input):  # noqa: A002
        return F.softshrink(input, self.lambd)

    def extra_repr(self) -> str:
        return str(self.lambd)


class Hardshrink(Softshrink):
    def forward(self, input):  # noqa: A002
        return F.hardshrink(input, self.lambd)


class Threshold(Module):
    def __init__(self, threshold: float, value: float, inplace: bool = False):
        super().__init__()
        self.threshold, self.value, self.inplace = threshold, value, inplace

    def forward(self, input):  # noqa: A002
        return F.threshold(input, self.threshold, self.value, self.inplace)

    def extra_repr(self) -> str:
        return (f"threshold={self.threshold}, value={self.value}"
                + (", inplace=True" if self.inplace else ""))


class GLU(Module):
    """Gated linear unit over ``dim`` (halved); a split ``dim`` is gathered first."""

    def __init__(self, dim: int = -1):
        super().__init__()
        self.dim = dim

    def forward(self, input):  # noqa: A002
        return F.glu(input, self.dim)

    def extra_repr(self) -> str:
        return f"dim={self.dim}"


class PReLU(Module):
    """``torch.nn.PReLU``: parameter ``weight`` (num_parameters,) filled with ``init``; one
    slope per channel (dim 1 of the input) or one shared slope."""

    def __init__(self, num_parameters: int = 1, init: float = 0.25, device=None, dtype=None):
        super().__init__()
        self.num_parameters, self.init = num_parameters, init
        self.weight = empty_param(num_parameters, device=device, dtype=dtype)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        init.constant_(self.weight, self.init)  # the module: init is a method arg only

    def forward(self, input):  # noqa: A002
        return F.prelu(input, self.weight)

    def extra_repr(self) -> str:
        return f"num_parameters={self.num_parameters}"


# ------------------------------------------------------------------ issue 21
__all__ += ["RReLU"]


class RReLU(Module):
    """Randomized leaky ReLU (``torch.nn.RReLU``): in training each negative element's
    slope is drawn uniformly from ``[lower, upper]`` (layout invariant: torch's values for
    the same seed, see ``F.rrelu``); in eval the slope is ``(lower + upper) / 2``."""

    def __init__(self, lower: float = 1.0 / 8, upper: float = 1.0 / 3, inplace: bool = False):
        super().__init__()
        self.lower, self.upper, self.inplace = lower, upper, inplace

    def forward(self, input):  # noqa: A002
        return F.rrelu(input, self.lower, self.upper, self.training, self.inplace)

    def extra_repr(self) -> str:
        return f"lower={self.lower}, upper={self.upper}" + (", inplace=True" if self.inplace
                                                            else "")


class MultiheadAttention(Module):
    """``torch.nn.MultiheadAttention`` (same parameters: ``in_proj_weight`` (3E, E), or
    ``q_proj_weight`` (E, E), ``k_proj_weight`` (E, kdim), ``v_proj_weight`` (E, vdim)
    when kdim/vdim differ from E; ``in_proj_bias`` (3E); ``out_proj`` Linear(E, E);
    ``bias_k``/``bias_v`` (1, 1, E) with ``add_bias_kv``; same initialisation order).

    Shapes: query (L, N, E), key (S, N, kdim), value (S, N, vdim), or (N, L, E) ... with
    ``batch_first``, or unbatched (L, E) ... Returns ``(attn_output, attn_weights)``;
    weights (N, L, S) averaged over heads (or (N, heads, L, S)) when ``need_weights``, else
    None. Runs :func:`sbpflow.nn.functional.multi_head_attention_forward` (torch's
    algorithm; SBP there). ``is_causal`` without ``attn_mask`` builds the causal mask
    (torch requires the mask).
    """

    def __init__(self, embed_dim: int, num_heads: int, dropout: float = 0.0, bias: bool = True,
                 add_bias_kv: bool = False, add_zero_attn: bool = False, kdim=None, vdim=None,
                 batch_first: bool = False, device=None, dtype=None):
        super().__init__()
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim ({embed_dim}) must be divisible by num_heads "
                             f"({num_heads})")
        self.embed_dim, self.num_heads, self.dropout = embed_dim, num_heads, dropout
        self.kdim = kdim if kdim is not None else embed_dim
        self.vdim = vdim if vdim is not None else embed_dim
        self._qkv_same_embed_dim = self.kdim == embed_dim and self.vdim == embed_dim
        self.head_dim, self.batch_first = embed_dim // num_heads, batch_first
        kw = dict(device=device, dtype=dtype)
        if self._qkv_same_embed_dim:
            self.in_proj_weight = empty_param(3 * embed_dim, embed_dim, **kw)
            for name in ("q_proj_weight", "k_proj_weight", "v_proj_weight"):
                self.register_parameter(name, None)
        else:
            self.q_proj_weight = empty_param(embed_dim, embed_dim, **kw)
            self.k_proj_weight = empty_param(embed_dim, self.kdim, **kw)
            self.v_proj_weight = empty_param(embed_dim, self.vdim, **kw)
            self.register_parameter("in_proj_weight", None)
        optional_param(self, "in_proj_bias", bias, 3 * embed_dim, **kw)
        # torch builds out_proj (drawing its Linear init) before _reset_parameters.
        self.out_proj = Linear(embed_dim, embed_dim, bias=bias, **kw)
        if add_bias_kv:
            self.bias_k = empty_param(1, 1, embed_dim, **kw)
            self.bias_v = empty_param(1, 1, embed_dim, **kw)
        else:
            self.bias_k = self.bias_v = None
        self.add_zero_attn = add_zero_attn
        self._reset_parameters()

    def _reset_parameters(self) -> None:
        if self._qkv_same_embed_dim:
            init.xavier_uniform_(self.in_proj_weight)
        else:
            init.xavier_uniform_(self.q_proj_weight)
            init.xavier_uniform_(self.k_proj_weight)
            init.xavier_uniform_(self.v_proj_weight)
        if self.in_proj_bias is not None:
            init.constant_(self.in_proj_bias, 0.0)
            init.constant_(self.out_proj.bias, 0.0)
        if self.bias_k is not None:
            init.xavier_normal_(self.bias_k)
        if self.bias_v is not None:
            init.xavier_normal_(self.bias_v)

    def forward(self, query, key, value, key_padding_mask=None, need_weights: bool = True,
                attn_mask=None, average_attn_weights: bool = True, is_causal: bool = False):
        batched = query.ndim == 3
        if self.batch_first and batched:
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))
        if is_causal and attn_mask is None:  # B on the query's placement: no communication
            L, S = query.shape[0], key.shape[0]
            pl = query.placement if query.is_global else None
            attn_mask = full((L, S), True, dtype=torch.bool, placement=pl,
                             sbp=None if pl is None else (broadcast,) * pl.ndim).triu(1)
        out, weights = F.multi_head_attention_forward(
            query, key, value, self.embed_dim, self.num_heads, self.in_proj_weight,
            self.in_proj_bias, self.bias_k, self.bias_v, self.add_zero_attn, self.dropout,
            self.out_proj.weight, self.out_proj.bias, training=self.training,
            key_padding_mask=key_padding_mask, need_weights=need_weights, attn_mask=attn_mask,
            use_separate_proj_weight=not self._qkv_same_embed_dim,
            q_proj_weight=self.q_proj_weight, k_proj_weight=self.k_proj_weight,
            v_proj_weight=self.v_proj_weight, average_attn_weights=average_attn_weights,
            is_causal=is_causal)
        if self.batch_first and batched:
            out = out.transpose(0, 1)
        return out, weights
