"""``sbpflow._C``: OneFlow's functional namespace (``oneflow._C``) as LiBai calls it.

With ``import sbpflow as oneflow``, ``oneflow._C.matmul(x, w, transpose_b=True)`` runs.
Each function has the signature, defaults and return values of OneFlow's
(``oneflow/core/functional/functional_api.yaml`` and the functors of
``oneflow/core/functional/impl/``) and is written with sbpflow's own ops: on local tensors
it is torch's computation; on global tensors every step follows that op's SBP rules
(splits pass where the op allows, class-split logits stay split, a P input stays P where
the op is linear), so no new kernel or layout rule lives here. Random steps use sbpflow's
layout-invariant dropout (:func:`sbpflow.nn.functional.dropout`): with the same seed the
result is the same under every placement and SBP, and equals torch's dropout on one
process.

=================================  ==============================================
function                           OneFlow source of the semantics
=================================  ==============================================
matmul                             ``MatMulFunctor`` (nn_functor.cpp), matmul ops
sparse_softmax_cross_entropy       ``SparseSoftmaxCrossEntropyFunctor``, its kernels
cross_entropy                      ``CrossEntropyFunctor``
gather                             ``GatherFunctor``, ``user/ops/gather_op.cpp``
layer_norm, layer_norm_affine      ``LayerNorm(Affine)Functor``, ``layer_norm_op.cpp``
rms_norm                           ``RMSNormFunctor``, ``rms_norm_gpu_kernel.cu``
gelu, quick_gelu, relu             activation functors (erf GELU; x * sigmoid(1.702 x))
transpose                          ``Transpose``/``Transpose2dim`` (a perm, or two dims)
fused_bias_add_gelu                ``FusedBiasAddGeluFunctor``, test_fused_bias_add_gelu.py
fused_bias_add_dropout             ``FusedBiasAddDropoutFunctor``, its test
fused_scale_tril_softmax_...       ``FusedScaleTrilSoftmaxMaskScaleFunctor``, its kernel
fused_scale_mask_softmax_dropout   ``FusedScaleMaskSoftmaxDropoutFunctor``, its test
fused_self_attention               test_fused_self_attention.py, its op's shape rule
amp_white/black_identity           ``Amp*IdentityFunctor`` (identity)
global_arange                      ``GlobalArangeFunctor``
=================================  ==============================================

Where sbpflow differs from OneFlow it says so in the function's docstring (errors are
``ValueError``/``TypeError`` raised before any work, where OneFlow raises its
``RuntimeError`` from a check; a ``generator=`` raises ``NotImplementedError``: sbpflow's
randomness is seeded by :func:`sbpflow.manual_seed`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .nn import functional as F
from .ops import creation as _creation
from .ops.args import norm_dim
from .ops.pointwise import where as _where
from .sbp import broadcast
from .tensor import Tensor

__all__ = [
    "amp_black_identity", "amp_white_identity", "cross_entropy", "fused_bias_add_dropout",
    "fused_bias_add_gelu", "fused_scale_mask_softmax_dropout",
    "fused_scale_tril_softmax_mask_scale", "fused_self_attention", "gather", "gelu",
    "global_arange", "layer_norm", "layer_norm_affine", "matmul", "quick_gelu", "relu",
    "rms_norm", "sparse_softmax_cross_entropy", "transpose",
]


# ------------------------------------------------------------------ helpers
def _tensor(fn: str, what: str, x) -> Tensor:
    if not isinstance(x, Tensor):
        raise TypeError(f"_C.{fn}: {what} is a {type(x).__name__}, expected an sbpflow.Tensor "
                        f"(wrap torch tensors with sbpflow.from_torch)")
    return x


def _no_generator(fn: str, generator) -> None:
    if generator is not None:
        raise NotImplementedError(
            f"_C.{fn}: generator= is not supported; sbpflow's dropout draws from the global "
            f"seed (sbpflow.manual_seed) so that the mask is the same under every layout")


def _bias_view(fn: str, a: Tensor, b: Tensor, axis: int) -> tuple[Tensor, int]:
    """``b`` (C,) shaped to broadcast along ``a``'s dim ``axis`` (trailing 1s: a split of
    ``b`` stays its dim 0, which lines up with ``a``'s ``axis``), and the axis normalised."""
    _tensor(fn, "a", a)
    _tensor(fn, "b", b)
    axis = norm_dim(axis, a.ndim, f"_C.{fn}: axis")
    if b.ndim != 1 or b.shape[0] != a.shape[axis]:
        raise ValueError(f"_C.{fn}: b must be 1-D of a's size on axis {axis} "
                         f"({a.shape[axis]}), got shape {tuple(b.shape)} for a of shape "
                         f"{tuple(a.shape)}")
    return b.reshape((b.shape[0],) + (1,) * (a.ndim - 1 - axis)), axis


def _check_p(fn: str, p: float) -> float:
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"_C.{fn}: dropout probability p must be in [0, 1], got {p}")
    return float(p)


def _norm_axes(fn: str, x: Tensor, begin_norm_axis: int, begin_params_axis: int) -> int:
    """OneFlow's layer_norm check: both axes (negative counts from the end) must agree."""
    n = norm_dim(begin_norm_axis, x.ndim, f"_C.{fn}: begin_norm_axis")
    p = norm_dim(begin_params_axis, x.ndim, f"_C.{fn}: begin_params_axis")
    if n != p:
        raise ValueError(f"_C.{fn}: begin_norm_axis must equal begin_params_axis (OneFlow's "
                         f"layer_norm requires it), got {n} vs {p} for x of shape "
                         f"{tuple(x.shape)}")
    return n


# ------------------------------------------------------------------ matmul
def matmul(input, other, transpose_a=False, transpose_b=False, alpha=1.0):  # noqa: A002
    """``alpha * op(input) @ op(other)``, ``op`` transposing the last two dims when its flag
    is set (OneFlow's ``_C.matmul``: ``MatMulFunctor``, ``broadcast_matmul`` shape rule).

    Shapes as ``torch.matmul`` after the transposes: (m, k) @ (k, n), batched
    (..., m, k) @ (..., k, n) with broadcast batch dims, or (b, s, k) @ (k, n) as a linear
    layer (LiBai's ``_C.matmul(x, w, transpose_b=True)`` with ``w`` (n, k)). SBP: the
    transposes are views (a split moves with its dim) and the product follows matmul's
    einsum rules: ``w`` column-split (S(0) of (n, k), i.e. S(1) after the transpose) gives
    an output split on its last dim; a contracted split gives P; batch splits pass;
    ``alpha`` scales each shard (P stays P).

    Differs from OneFlow only with a 1-D operand, where OneFlow's vector kernels drop the
    flags and ``alpha``: sbpflow applies ``alpha`` and refuses a transpose flag.

    Raises:
        ValueError: a 0-dim operand, a transpose flag on a 1-D operand, or shapes that do
        not contract (torch's message).
    """
    _tensor("matmul", "input", input)
    _tensor("matmul", "other", other)
    for name, t, flag in (("input", input, transpose_a), ("other", other, transpose_b)):
        if t.ndim == 0:
            raise ValueError(f"_C.matmul: {name} must have at least 1 dim, got a 0-dim tensor")
        if flag and t.ndim == 1:
            raise ValueError(f"_C.matmul: transpose of the 1-D {name} (shape {tuple(t.shape)}) "
                             f"is not defined; OneFlow ignores the flag there")
    a = input.transpose(-2, -1) if transpose_a else input
    b = other.transpose(-2, -1) if transpose_b else other
    out = a @ b
    return out if alpha == 1.0 else out * alpha


# ------------------------------------------------------------------ losses
def sparse_softmax_cross_entropy(logits, label):
    """Per-sample ``-log softmax(logits)[label]`` (OneFlow's
    ``_C.sparse_softmax_cross_entropy``; ``SparseSoftmaxCrossEntropyFunctor`` returns the
    op's ``out``, not its ``prob``).

    Shapes: ``logits`` (..., C) with the classes last, ``label`` (...) integer class ids in
    [0, C); the loss has ``label``'s shape and ``logits``' dtype, unreduced. SBP: batch
    splits pass; class-split logits (LiBai's vocabulary-parallel [S(0), S(2)] logits viewed
    as (N, C)) are never gathered: ``log_softmax`` all-reduces a max and a sum per row and
    the rank holding each label's class picks it, so the loss is P on that mesh axis
    (OneFlow's ``sparse_softmax_cross_entropy_ms`` split, the same values). Computed as
    :func:`sbpflow.nn.functional.cross_entropy` with ``reduction='none'``.

    Labels out of [0, C) are an error in OneFlow's kernels; here they raise on local
    tensors (torch's check), except -100 which gives 0 (torch's ``ignore_index``), and
    give an unspecified value on global ones (checking would cost a collective).

    Raises:
        ValueError: ``label``'s shape is not ``logits.shape[:-1]``. TypeError: non-integer
        labels.
    """
    _tensor("sparse_softmax_cross_entropy", "logits", logits)
    _tensor("sparse_softmax_cross_entropy", "label", label)
    if logits.ndim == 0 or tuple(label.shape) != tuple(logits.shape[:-1]):
        raise ValueError(f"_C.sparse_softmax_cross_entropy: label must have logits' shape "
                         f"without the last (class) dim: logits {tuple(logits.shape)}, label "
                         f"{tuple(label.shape)}")
    if label.dtype.is_floating_point or label.dtype.is_complex or label.dtype == torch.bool:
        raise TypeError(f"_C.sparse_softmax_cross_entropy: label must hold integer class ids, "
                        f"got {label.dtype}")
    # torch's cross_entropy takes the classes on dim 1 (a view: splits move with the dim).
    x = logits.movedim(-1, 1) if logits.ndim > 2 else logits
    return F.cross_entropy(x, label, reduction="none")


def cross_entropy(input, target, weight=None, ignore_index=-100, reduction="mean",  # noqa: A002
                  label_smoothing=0.0):
    """OneFlow's ``_C.cross_entropy(input, target, weight=None, ignore_index=-100,
    reduction='mean', label_smoothing=0.0)`` (``CrossEntropyFunctor``): torch's
    ``cross_entropy`` without the deprecated ``size_average``/``reduce`` (so the
    positional order differs from torch's). ``input`` (N, C, d...), (N, C) or (C,);
    ``target`` class ids (shape without C) or probabilities (``input``'s shape). SBP and
    errors as :func:`sbpflow.nn.functional.cross_entropy` (class-split logits are not
    gathered; ``'mean'``/``'sum'`` give a 0-dim, usually P, loss)."""
    return F.cross_entropy(input, target, weight=weight, ignore_index=ignore_index,
                           reduction=reduction, label_smoothing=label_smoothing)


# ------------------------------------------------------------------ indexing, views
def gather(x, indices, axis):
    """OneFlow's ``_C.gather(x, indices, axis)`` (``GatherFunctor``, ``gather_op.cpp``):
    TensorFlow's gather, not ``torch.gather``: slices of ``x`` along ``axis`` at
    ``indices`` (any shape, integer), output shape ``x.shape[:axis] + indices.shape +
    x.shape[axis + 1:]``.

    SBP: a 2-D ``x`` gathered on axis 0 is an embedding lookup
    (:func:`sbpflow.nn.functional.embedding`, LiBai's ``_C.gather(weight, input_ids,
    axis=0)``): ids in any layout; ``x`` split on the rows (vocabulary-parallel) looks up
    each id on the rank holding its row, output P (no gather of ``x``, OneFlow's
    ``(S(axis), B) -> P`` signature); ``x`` split on its columns gives an output split on
    its last dim. Otherwise it is ``index_select`` on the flattened ids, reshaped: ``x``
    whole on ``axis`` (other splits kept) or ids split.

    Raises:
        TypeError: non-integer indices. IndexError: ``axis`` out of range.
    """
    _tensor("gather", "x", x)
    _tensor("gather", "indices", indices)
    if indices.dtype.is_floating_point or indices.dtype.is_complex or \
            indices.dtype == torch.bool:
        raise TypeError(f"_C.gather: indices must be integers, got {indices.dtype}")
    if x.ndim == 0:
        raise ValueError("_C.gather: x must have at least 1 dim, got a 0-dim tensor")
    axis = norm_dim(axis, x.ndim, "_C.gather: axis")
    if x.ndim == 2 and axis == 0:
        return F.embedding(indices, x)
    ids = indices.reshape(-1).long()
    out = x.index_select(axis, ids)
    return out.reshape(tuple(x.shape[:axis]) + tuple(indices.shape) +
                       tuple(x.shape[axis + 1:]))


def transpose(input, *dims, perm=None, dim0=None, dim1=None):  # noqa: A002
    """OneFlow's ``_C.transpose``: ``transpose(x, perm)`` permutes the dims (``perm`` a
    permutation of ``range(x.ndim)``, negatives allowed), ``transpose(x, dim0, dim1)``
    swaps two (its two overloads, ``Transpose`` and ``Transpose2dim``). A view: splits move
    with their dims, no data moves.

    Raises:
        TypeError: neither or both forms given. ValueError: ``perm`` not a permutation.
    """
    _tensor("transpose", "input", input)
    if len(dims) == 1 and isinstance(dims[0], Sequence) and perm is None:
        perm, dims = dims[0], ()
    if len(dims) == 2 and dim0 is None and dim1 is None:
        dim0, dim1 = dims
    elif dims:
        raise TypeError(f"_C.transpose: give a perm (a sequence) or two dims, got {dims!r}")
    if perm is not None:
        if dim0 is not None or dim1 is not None:
            raise TypeError("_C.transpose: give perm or dim0/dim1, not both")
        nd = input.ndim
        try:
            full = [norm_dim(int(d), nd, "_C.transpose: perm") for d in perm]
        except (IndexError, TypeError) as e:
            raise ValueError(f"_C.transpose: perm {list(perm)!r} is not a permutation of the "
                             f"{nd} dims of x") from e
        if sorted(full) != list(range(nd)):
            raise ValueError(f"_C.transpose: perm {list(perm)!r} is not a permutation of the "
                             f"{nd} dims of x (shape {tuple(input.shape)})")
        return input.permute(*full)
    if dim0 is None or dim1 is None:
        raise TypeError("_C.transpose: give perm, or both dim0 and dim1")
    return input.transpose(dim0, dim1)


# ------------------------------------------------------------------ normalisation
def layer_norm(x, begin_norm_axis, begin_params_axis, epsilon):
    """Layer normalisation of ``x`` over dims ``begin_norm_axis:`` without affine
    parameters (OneFlow's ``_C.layer_norm``, ``LayerNormFunctor`` with center and scale
    off): ``(x - mean) / sqrt(var + epsilon)``, biased variance. The two axes must be
    equal (OneFlow's ``layer_norm`` op checks it); negative ones count from the end. SBP
    as :func:`sbpflow.nn.functional.layer_norm`: leading dims may stay split, normalised
    dims are gathered if split, P is summed first.

    Raises:
        ValueError: the axes differ. IndexError: an axis out of range.
    """
    _tensor("layer_norm", "x", x)
    begin = _norm_axes("layer_norm", x, begin_norm_axis, begin_params_axis)
    return F.layer_norm(x, tuple(x.shape[begin:]), eps=epsilon)


def layer_norm_affine(x, gamma, beta, begin_norm_axis, begin_params_axis, epsilon):
    """:func:`layer_norm` then ``* gamma + beta``, both of shape ``x.shape[begin_params_axis:]``
    (OneFlow's ``_C.layer_norm_affine``, LiBai's ``LayerNorm``). SBP: as
    :func:`layer_norm`; ``gamma``/``beta`` are used whole (B).

    Raises:
        ValueError: the axes differ, or ``gamma``/``beta`` of another shape.
    """
    _tensor("layer_norm_affine", "x", x)
    _tensor("layer_norm_affine", "gamma", gamma)
    _tensor("layer_norm_affine", "beta", beta)
    begin = _norm_axes("layer_norm_affine", x, begin_norm_axis, begin_params_axis)
    shape = tuple(x.shape[begin:])
    for name, t in (("gamma", gamma), ("beta", beta)):
        if tuple(t.shape) != shape:
            raise ValueError(f"_C.layer_norm_affine: {name} must have shape {shape} "
                             f"(x.shape[{begin}:]), got {tuple(t.shape)}")
    return F.layer_norm(x, shape, gamma, beta, eps=epsilon)


def rms_norm(x, weight=None, normalized_shape=None, epsilon=1e-6):
    """``x * rsqrt(mean(x**2 over the normalised dims) + epsilon) * weight`` (OneFlow's
    ``_C.rms_norm(x, weight=None, normalized_shape, epsilon=1e-6)``, ``RMSNormFunctor``;
    LiBai's ``RMSLayerNorm`` passes ``weight.shape``). ``normalized_shape`` are the last
    dims of ``x``; ``weight`` (optional) has exactly that shape and is cast to ``x``'s
    dtype as OneFlow does. SBP as :func:`sbpflow.nn.functional.rms_norm` (leading dims may
    stay split).

    Raises:
        TypeError: no ``normalized_shape``. ValueError: it is not the trailing shape of
        ``x``, or ``weight`` has another shape.
    """
    _tensor("rms_norm", "x", x)
    if normalized_shape is None:
        raise TypeError("_C.rms_norm: normalized_shape is required (OneFlow's signature has "
                        "no default for it), e.g. rms_norm(x, w, w.shape, 1e-6)")
    ns = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    if weight is not None:
        _tensor("rms_norm", "weight", weight)
        if tuple(weight.shape) != ns:
            raise ValueError(f"_C.rms_norm: weight must have normalized_shape {ns}, got "
                             f"{tuple(weight.shape)}")
        if weight.dtype != x.dtype:
            weight = weight.to(x.dtype)
    return F.rms_norm(x, ns, weight, eps=epsilon)


# ------------------------------------------------------------------ activations
def gelu(x):
    """Exact (erf) GELU, ``x * Phi(x)`` (OneFlow's ``_C.gelu``); elementwise, splits pass."""
    _tensor("gelu", "x", x)
    return F.gelu(x)


def quick_gelu(x):
    """``x * sigmoid(1.702 * x)`` (OneFlow's ``_C.quick_gelu``, LiBai's ``QuickGELU``, from
    the GELU paper's sigmoid approximation). Elementwise: splits pass."""
    _tensor("quick_gelu", "x", x)
    return x * F.sigmoid(x * 1.702)


def relu(x, inplace=False):
    """``max(x, 0)`` (OneFlow's ``_C.relu(x, inplace=False)``); elementwise, splits pass,
    P is summed first. ``inplace`` rebinds ``x`` to the result, as
    :func:`sbpflow.nn.functional.relu`."""
    _tensor("relu", "x", x)
    return F.relu(x, inplace=inplace)


# ------------------------------------------------------------------ fused ops
def fused_bias_add_gelu(a, b, *, axis):
    """``gelu(a + b)`` with the 1-D ``b`` added along ``a``'s dim ``axis`` (OneFlow's
    ``_C.fused_bias_add_gelu(a, b, *, axis)``; its test checks it against
    ``gelu(_C.bias_add(a, b, axis))``, erf GELU). LiBai: the column-parallel MLP's output
    with its bias, ``axis=a.ndim - 1``.

    SBP: ``a`` split on another dim with ``b`` whole passes; ``a`` split on ``axis`` with
    ``b`` S(0) (tensor parallel: a column-split linear's output and bias) gives ``a``'s
    split, OneFlow's two signatures. ``axis`` may be negative (OneFlow's op wants >= 0).

    Raises:
        ValueError: ``b`` not 1-D of ``a.shape[axis]``. IndexError: ``axis`` out of range.
    """
    bias, _ = _bias_view("fused_bias_add_gelu", a, b, axis)
    return F.gelu(a + bias)


def fused_bias_add_dropout(a, b, *, p=0.5, axis, generator=None):
    """``dropout(a + b, p)`` with the 1-D ``b`` added along ``a``'s dim ``axis`` (OneFlow's
    ``_C.fused_bias_add_dropout(a, b, *, p=0.5, axis, generator=None)``,
    ``FusedBiasAddDropoutFunctor``). As OneFlow's it has no ``training`` flag: dropout runs
    whenever ``p > 0`` (LiBai passes ``p=0`` in eval); ``p == 0`` is the bias add alone.

    The dropout is sbpflow's layout-invariant one (same mask under every layout, equal to
    torch's dropout for the same seed). SBP: as :func:`fused_bias_add_gelu`; dropout keeps
    the layout (P stays P).

    Raises:
        ValueError: ``p`` outside [0, 1], or ``b`` of the wrong shape.
        NotImplementedError: a ``generator``.
    """
    bias, _ = _bias_view("fused_bias_add_dropout", a, b, axis)
    p = _check_p("fused_bias_add_dropout", p)
    _no_generator("fused_bias_add_dropout", generator)
    out = a + bias
    return F.dropout(out, p, training=True) if p > 0.0 else out


def _causal_keep(x: Tensor, diagonal: int) -> Tensor:
    """Bool (rows, cols) of ``x``'s last two dims, True where ``col <= row + diagonal``:
    built whole on every rank (B), no communication."""
    rows, cols = x.shape[-2], x.shape[-1]
    if x.is_local:
        return _creation.ones(rows, cols, dtype=torch.bool).tril(diagonal)
    pl = x.placement
    return _creation.ones(rows, cols, dtype=torch.bool, placement=pl,
                          sbp=(broadcast,) * pl.ndim).tril(diagonal)


def fused_scale_tril_softmax_mask_scale(a, *, p=0.5, diagonal, tril_scale_value,
                                        tril_fill_value=0.0, generator=None):
    """Causal softmax with dropout (OneFlow's ``_C.fused_scale_tril_softmax_mask_scale``,
    ``FusedScaleTrilSoftmaxMaskScaleFunctor`` and its CUDA kernel)::

        z         = where(col <= row + diagonal, a * tril_scale_value, tril_fill_value)
        softmax_y = softmax(z, dim=-1)
        y         = dropout(softmax_y, p)   # kept values scaled by 1 / (1 - p)

    over the last two dims of ``a`` (..., rows, cols) (the fill value is not scaled).
    Returns ``(y, softmax_y)``, as OneFlow (LiBai takes ``[0]``). Dropout always runs (no
    ``training`` flag, as OneFlow's), with sbpflow's layout-invariant mask.

    SBP: the mask is built whole on every rank (B) and sliced locally; batch and head
    splits pass; a split ``cols`` dim runs softmax's global algorithm (all-reduce of max
    and sum), a split ``rows`` dim passes.

    Raises:
        ValueError: ``a`` with fewer than 2 dims, ``p`` outside [0, 1].
        NotImplementedError: a ``generator``.
    """
    _tensor("fused_scale_tril_softmax_mask_scale", "a", a)
    if a.ndim < 2:
        raise ValueError(f"_C.fused_scale_tril_softmax_mask_scale: a must have at least 2 "
                         f"dims (..., rows, cols), got shape {tuple(a.shape)}")
    p = _check_p("fused_scale_tril_softmax_mask_scale", p)
    _no_generator("fused_scale_tril_softmax_mask_scale", generator)
    z = _where(_causal_keep(a, diagonal), a * tril_scale_value, float(tril_fill_value))
    softmax_y = F.softmax(z, dim=-1)
    return F.dropout(softmax_y, p, training=True), softmax_y


def fused_scale_mask_softmax_dropout(x, mask, *, fill_value=0.0, scale=1.0, p=0.5,
                                     training=True, generator=None):
    """Masked softmax with dropout (OneFlow's ``_C.fused_scale_mask_softmax_dropout``,
    ``FusedScaleMaskSoftmaxDropoutFunctor``; its test's reference is
    ``softmax(x * mask * scale + fill_value * (1 - mask))`` then dropout)::

        softmax_y = softmax(where(mask, x * scale, fill_value), dim=-1)
        y         = dropout(softmax_y, p if training else 0)

    ``x`` (..., cols); ``mask`` bool, broadcastable to ``x`` (LiBai: the padding mask
    (batch, 1, tgt, src) against scores (batch, heads, tgt, src)). Returns
    ``(y, softmax_y)``, as OneFlow (LiBai takes ``[0]``).

    SBP: ``x`` and ``mask`` split on the same batch/head dim pass (a size-1 mask dim is
    used whole, OneFlow's broadcast rule); a split last dim runs softmax's global
    algorithm; dropout is layout invariant.

    Raises:
        TypeError: ``mask`` not bool (OneFlow's check). ValueError: ``p`` outside [0, 1].
        NotImplementedError: a ``generator``.
    """
    _tensor("fused_scale_mask_softmax_dropout", "x", x)
    _tensor("fused_scale_mask_softmax_dropout", "mask", mask)
    if mask.dtype != torch.bool:
        raise TypeError(f"_C.fused_scale_mask_softmax_dropout: mask must be bool (True = "
                        f"keep), got {mask.dtype}")
    if x.ndim == 0 or mask.ndim == 0 or mask.shape[-1] != x.shape[-1]:
        raise ValueError(f"_C.fused_scale_mask_softmax_dropout: the last dims of x "
                         f"{tuple(x.shape)} and mask {tuple(mask.shape)} must be equal")
    p = _check_p("fused_scale_mask_softmax_dropout", p)
    _no_generator("fused_scale_mask_softmax_dropout", generator)
    softmax_y = F.softmax(_where(mask, x * scale, float(fill_value)), dim=-1)
    return F.dropout(softmax_y, p, training=training), softmax_y


def fused_self_attention(hidden_states, head_size=8, alpha=1.0):
    """Attention scores and values from a fused QKV projection (OneFlow's
    ``_C.fused_self_attention``, op ``fused_self_attention_query_mul_key_and_value``; the
    layout is its test's, python/oneflow/test/modules/test_fused_self_attention.py).

    ``hidden_states`` (seq, batch, heads * 3 * head_size) is viewed as (seq, batch, heads,
    3 * head_size); q, k, v are its three ``head_size`` slices of the last dim, each
    permuted to (batch, heads, seq, head_size). Returns ``(alpha * q @ k^T, v)``: shapes
    (batch, heads, seq, seq) and (batch, heads, seq, head_size).

    SBP (views, then a batched matmul): ``hidden_states`` S(1) (batch) gives both outputs
    S(0); S(2) (heads, tensor parallel, with heads divisible by the ranks) gives S(1):
    OneFlow's two signatures. A split seq dim is contracted or gathered by matmul's rules.

    Raises:
        ValueError: ``hidden_states`` not 3-D, or its last dim not a multiple of
        ``3 * head_size``.
    """
    _tensor("fused_self_attention", "hidden_states", hidden_states)
    if hidden_states.ndim != 3:
        raise ValueError(f"_C.fused_self_attention: hidden_states must be (seq, batch, "
                         f"hidden), got shape {tuple(hidden_states.shape)}")
    seq, batch, hidden = hidden_states.shape
    if head_size <= 0 or hidden % (3 * head_size):
        raise ValueError(f"_C.fused_self_attention: hidden size {hidden} must be a multiple "
                         f"of 3 * head_size ({3 * head_size})")
    qkv = hidden_states.reshape(seq, batch, hidden // (3 * head_size), 3 * head_size)
    q, k, v = (qkv[..., i * head_size:(i + 1) * head_size].permute(1, 2, 0, 3)
               for i in range(3))  # (batch, heads, seq, head_size)
    return matmul(q, k, transpose_b=True, alpha=alpha), v


# ------------------------------------------------------------------ amp marks, creation
def amp_white_identity(x):
    """Identity (OneFlow's ``_C.amp_white_identity``): in OneFlow's graph AMP it marks its
    consumer for low precision; eagerly, and here, it returns ``x``'s values (a view that
    passes gradients; OneFlow's eager kernel copies). Layout kept (P stays P)."""
    _tensor("amp_white_identity", "x", x)
    return x.view_as(x)


def amp_black_identity(x):
    """Identity (OneFlow's ``_C.amp_black_identity``): the full-precision mark of
    OneFlow's graph AMP; as :func:`amp_white_identity` otherwise."""
    _tensor("amp_black_identity", "x", x)
    return x.view_as(x)


def global_arange(start=None, end=None, step=1, *, dtype=None, placement, sbp):
    """A global ``arange`` laid out with ``placement`` and ``sbp`` (OneFlow's
    ``_C.global_arange(start, end, step=1, *, dtype=None, placement, sbp)`` and its
    ``(end, *, dtype, placement, sbp)`` overload; ``GlobalArangeFunctor``): ``[start,
    end)`` with spacing ``step``, 1-D; one bound alone (positional, or ``end=``) is the end.
    dtype: int64 when start, end and step are all integers, else float32, unless given.
    ``sbp``: one SBP or one per mesh axis. Each rank computes its own slice
    (:func:`sbpflow.arange`), no communication.

    Raises:
        TypeError: no bound, or no placement/sbp. ValueError: ``step == 0`` or pointing
        away from ``end``.
    """
    if start is None and end is None:
        raise TypeError("_C.global_arange: give end (and optionally start, step)")
    if placement is None or sbp is None:
        raise TypeError("_C.global_arange: placement and sbp are required (use "
                        "sbpflow.arange for a local tensor)")
    if end is None:
        start, end = 0, start
    elif start is None:
        start = 0
    return _creation.arange(start, end, step, dtype=dtype, placement=placement, sbp=sbp)
