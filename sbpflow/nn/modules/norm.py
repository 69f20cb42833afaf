"""BatchNorm1d/2d/3d, SyncBatchNorm, InstanceNorm1d/2d/3d and their Lazy forms,
LayerNorm, RMSNorm, GroupNorm, LocalResponseNorm, CrossMapLRN2d (torch.nn's arguments,
names, buffers and initialisation)."""

from __future__ import annotations

import numbers

import torch
import torch.nn.functional as TF

from ... import distributed as _dist
from ...ops.dispatch import dispatch
from ...tensor import Tensor
from .. import _buffer_sync, init
from .. import functional as F
from ..module import Module, UninitializedBuffer, UninitializedParameter
from ._common import optional_param
from .lazy import LazyModuleMixin

__all__ = ["BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "SyncBatchNorm", "InstanceNorm1d",
           "InstanceNorm2d", "InstanceNorm3d", "LazyBatchNorm1d", "LazyBatchNorm2d",
           "LazyBatchNorm3d", "LazyInstanceNorm1d", "LazyInstanceNorm2d", "LazyInstanceNorm3d",
           "LayerNorm", "RMSNorm", "GroupNorm", "LocalResponseNorm", "CrossMapLRN2d"]


def _affine(module, enabled: bool, bias: bool, shape, device, dtype) -> None:
    """``weight`` (and ``bias``) of ``shape``, or None when not ``enabled``."""
    optional_param(module, "weight", enabled, *shape, device=device, dtype=dtype)
    optional_param(module, "bias", enabled and bias, *shape, device=device, dtype=dtype)


def _reset_affine(module) -> None:
    if module.weight is not None:
        init.ones_(module.weight)
    if module.bias is not None:
        init.zeros_(module.bias)


class _BatchNorm(Module):
    _dims: tuple[int, ...] = ()

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True, device=None,
                 dtype=None, *, bias: bool = True, sync_stats: bool = True):
        super().__init__()
        self.num_features, self.eps, self.momentum = num_features, eps, momentum
        self.affine, self.track_running_stats = affine, track_running_stats
        self.sync_stats = sync_stats
        _affine(self, affine, bias, (num_features,), device, dtype)
        if track_running_stats:
            kw = dict(device=device, dtype=dtype)
            self.register_buffer("running_mean", Tensor(torch.zeros(num_features, **kw)))
            self.register_buffer("running_var", Tensor(torch.ones(num_features, **kw)))
            self.register_buffer("num_batches_tracked",
                                 Tensor(torch.tensor(0, dtype=torch.long, device=device)))
        else:
            self.register_buffer("running_mean", None)
            self.register_buffer("running_var", None)
            self.register_buffer("num_batches_tracked", None)
        self.reset_parameters()

    def reset_running_stats(self) -> None:
        if self.track_running_stats:
            for t, v in ((self.running_mean, 0), (self.running_var, 1),
                         (self.num_batches_tracked, 0)):
                t._local.fill_(v)

    def reset_parameters(self) -> None:
        self.reset_running_stats()
        _reset_affine(self)

    def _check_input_dim(self, input) -> None:  # noqa: A002
        if input.ndim not in self._dims:
            raise ValueError(f"{type(self).__name__}: expected {' or '.join(map(str, self._dims))}"
                             f"D input (got {input.ndim}D input of shape {tuple(input.shape)})")

    def forward(self, input):  # noqa: A002
        self._check_input_dim(input)
        if self.running_mean is not None and _buffer_sync.is_pending(self.running_mean._local):
            _buffer_sync.flush()  # called again before the outermost call's end: sync first
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats:
            self.num_batches_tracked._local.add_(1)
            factor = (1.0 / float(self.num_batches_tracked._local.item())
                      if self.momentum is None else self.momentum)
        bn_training = self.training or (self.running_mean is None and self.running_var is None)
        use_stats = not self.training or self.track_running_stats
        rm = self.running_mean if use_stats else None
        rv = self.running_var if use_stats else None
        if bn_training and input.is_global:
            whole = _whole_batch(input, self.weight, self.bias, rm, rv)
            if whole or not self.sync_stats:
                return self._per_rank(input, rm, rv, factor, whole)
        return F.batch_norm(input, rm, rv, self.weight, self.bias, bn_training, factor, self.eps)

    def _per_rank(self, x, rm, rv, factor, whole: bool):
        """Statistics of each rank's part of a batch-split input (faster: no all-reduce of
        statistics; as torch DDP without SyncBatchNorm). The running statistics are then
        taken from the first data-parallel rank (DDP's ``broadcast_buffers``), so the
        replicas keep one value: each rank updates its own, and the outermost module call
        broadcasts every such layer's at its end, coalesced (:mod:`sbpflow.nn._buffer_sync`:
        one broadcast per step for a whole ResNet instead of one per layer).

        A broadcast input (every rank holds the whole batch: one rank, or a layout that
        keeps the batch whole) takes the same fused kernel whatever ``sync_stats`` says:
        its statistics are the global ones, and every rank updates its running statistics
        alike (the written-out global form ran 2.1x slower on an H200: resnet50's step
        118 against 55 ms); ``whole``: :func:`_whole_batch` of the call."""
        axes = tuple(a for a, s in enumerate(x.sbp) if s.is_split() and s.dim != 1)
        if not whole and (not axes or any(s.is_partial() or (s.is_split() and s.dim == 1)
                                          for s in x.sbp)):
            # Channels split or summands: the global statistics are the only sound choice.
            return F.batch_norm(x, rm, rv, self.weight, self.bias, True, factor, self.eps)
        weight = None if self.weight is None else _whole(self.weight)
        bias = None if self.bias is None else _whole(self.bias)
        # The kernel updates copies of the running statistics: autograd saves the tensors
        # passed here for backward, so the buffers themselves must not be written after.
        new = [None if t is None else _whole(t).clone() for t in (rm, rv)]
        out = TF.batch_norm(x._local, new[0], new[1], weight, bias, True, factor, self.eps)
        pairs = [(stat, value) for stat, value in zip((rm, rv), new)
                 if stat is not None and stat.is_global]
        if pairs:
            with torch.no_grad():
                for stat, value in pairs:
                    stat._local.copy_(value)
            if not whole:  # (a whole batch: every rank's statistics are the same)
                _buffer_sync.defer(x.placement, axes, [stat._local for stat, _ in pairs])
        return Tensor(out, x.placement, x.sbp, x.shape)


def _whole_batch(x: Tensor, *tensors) -> bool:
    """``x`` is broadcast on every mesh axis and so are the global ones of ``tensors``
    (the layer's parameters and running statistics; None skipped): every rank holds the
    whole batch and everything the fused kernel reads. False on a rank outside ``x``'s
    placement (it holds nothing: the global form runs there, as every op does)."""
    return _dist.get_rank() in x.placement and all(s.is_broadcast() for s in x.sbp) and all(
        t is None or not t.is_global or all(s.is_broadcast() for s in t.sbp)
        for t in tensors)


def _whole(t: Tensor) -> torch.Tensor:
    """A B (replicated) local view of a parameter; its gradient arrives as this rank's
    summand (P), the dual of B, so the usual gradient sync sums it."""
    if t.is_global and any(not s.is_broadcast() for s in t.sbp):
        raise ValueError(f"BatchNorm(sync_stats=False) needs replicated (B) parameters and "
                         f"buffers, got {t.sbp}; lay them out B or use sync_stats=True")
    return t._local


class BatchNorm1d(_BatchNorm):
    """Batch normalisation over (N, C) or (N, C, L) per channel (``torch.nn.BatchNorm1d``).

    ``sync_stats`` (sbpflow): True (default) takes the statistics of the whole global batch
    when the batch is split, so the result matches one device (two all-reduces of C
    values per layer); False takes each rank's part (no communication for statistics, as
    torch DDP without SyncBatchNorm; results then depend on the number of ranks). With
    False the running statistics become the first data-parallel rank's (DDP's
    ``broadcast_buffers``), broadcast for all such layers together in one coalesced
    broadcast per mesh axis when the outermost module call returns
    (:mod:`sbpflow.nn._buffer_sync`).
    """

    _dims = (2, 3)


class BatchNorm2d(_BatchNorm):
    """Batch normalisation over (N, C, H, W) per channel (``torch.nn.BatchNorm2d``); see
    :class:`BatchNorm1d` for ``sync_stats``."""

    _dims = (4,)


class BatchNorm3d(_BatchNorm):
    """Batch normalisation over (N, C, D, H, W) per channel (``torch.nn.BatchNorm3d``); see
    :class:`BatchNorm1d` for ``sync_stats``."""

    _dims = (5,)


class SyncBatchNorm(_BatchNorm):
    """Batch normalisation over (N, C, *) with the statistics of the whole batch across
    processes (``torch.nn.SyncBatchNorm``).

    In sbpflow every BatchNorm already does this: on a batch-split global input (data
    parallel, ``S(0)``) the mean and variance are those of the global tensor (two
    all-reduces of C values per layer, :func:`sbpflow.nn.functional.batch_norm`), so
    ``SyncBatchNorm`` is a BatchNorm that takes any input of at least 2 dims and always
    synchronises (``sync_stats`` is fixed True). The group is the input's placement (every
    mesh axis that splits the batch): ``process_group`` must be None.
    :meth:`convert_sync_batchnorm` swaps the BatchNorm layers of a model for it, as
    torch's.

    Raises:
        ValueError: a ``process_group`` other than None; an input of fewer than 2 dims.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True, process_group=None,
                 device=None, dtype=None):
        if process_group is not None:
            raise ValueError("SyncBatchNorm: process_group must be None: sbpflow takes the "
                             "statistics over every mesh axis that splits the input's batch "
                             "(lay the input out on the ranks to synchronise)")
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device,
                         dtype)
        self.process_group = None

    def _check_input_dim(self, input) -> None:  # noqa: A002
        if input.ndim < 2:
            raise ValueError(f"expected at least 2D input (got {input.ndim}D input)")

    @classmethod
    def convert_sync_batchnorm(cls, module: Module, process_group=None) -> Module:
        """``module`` with every BatchNorm layer (1d/2d/3d, not InstanceNorm) replaced by a
        :class:`SyncBatchNorm` holding the same parameter and buffer objects and training
        flag (torch's ``convert_sync_batchnorm``; a BatchNorm ``module`` itself is returned
        converted). ``process_group`` must be None (see the class doc)."""
        out = module
        if isinstance(module, _BatchNorm) and not isinstance(module, _InstanceNorm):
            out = cls(module.num_features, module.eps, module.momentum, module.affine,
                      module.track_running_stats, process_group)
            if module.affine:
                out.weight, out.bias = module.weight, module.bias
            out.running_mean, out.running_var = module.running_mean, module.running_var
            out.num_batches_tracked = module.num_batches_tracked
            out.training = module.training
        for name, child in module.named_children():
            out.add_module(name, cls.convert_sync_batchnorm(child, process_group))
        return out


class _InstanceNorm(_BatchNorm):
    _nobatch = 2  # dims of an unbatched input

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = False, track_running_stats: bool = False, device=None,
                 dtype=None, *, bias: bool = True):
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device,
                         dtype, bias=bias)

    def forward(self, input):  # noqa: A002
        n = self._nobatch
        if input.ndim not in (n, n + 1):
            raise ValueError(f"{type(self).__name__}: expected {n}D (unbatched) or {n + 1}D "
                             f"input (got {input.ndim}D input of shape {tuple(input.shape)})")
        c = input.shape[input.ndim - n]
        if c != self.num_features and self.affine:
            raise ValueError(f"expected input's size at dim={input.ndim - n} to match "
                             f"num_features ({self.num_features}), but got: {c}.")
        x = input.unsqueeze(0) if input.ndim == n else input
        out = F.instance_norm(x, self.running_mean, self.running_var, self.weight, self.bias,
                              self.training or not self.track_running_stats,
                              self.momentum if self.momentum is not None else 0.0, self.eps)
        return out.squeeze(0) if input.ndim == n else out

    def extra_repr(self) -> str:
        return (f"{self.num_features}, eps={self.eps}, momentum={self.momentum}, "
                f"affine={self.affine}, track_running_stats={self.track_running_stats}")


class InstanceNorm1d(_InstanceNorm):
    """Instance normalisation of (N, C, L) or (C, L) per (n, c) (``torch.nn.
    InstanceNorm1d``: ``affine`` and ``track_running_stats`` default False; buffers as
    torch's). SBP: N and C splits pass with no communication."""


class InstanceNorm2d(_InstanceNorm):
    """Instance normalisation of (N, C, H, W) or (C, H, W) (``torch.nn.InstanceNorm2d``);
    see :class:`InstanceNorm1d`."""

    _nobatch = 3


class InstanceNorm3d(_InstanceNorm):
    """Instance normalisation of (N, C, D, H, W) or (C, D, H, W) (``torch.nn.
    InstanceNorm3d``); see :class:`InstanceNorm1d`."""

    _nobatch = 4


# ------------------------------------------------------------------ lazy forms
class _LazyNormBase(LazyModuleMixin, _BatchNorm):
    """torch's ``_LazyNormBase``: ``num_features`` is the first input's channel dim;
    weight, bias and running statistics then materialise and initialise as the concrete
    layer's (see :mod:`sbpflow.nn.modules.lazy`). torch's defaults: ``affine`` and
    ``track_running_stats`` True (the lazy instance norms too)."""

    def __init__(self, eps: float = 1e-5, momentum: float | None = 0.1, affine: bool = True,
                 track_running_stats: bool = True, device=None, dtype=None, *,
                 bias: bool = True):
        super().__init__(0, eps, momentum, False, False, device, dtype, bias=False)
        self.affine, self.track_running_stats = affine, track_running_stats
        kw = dict(device=device, dtype=dtype)
        if affine:
            self.weight = UninitializedParameter(**kw)
            if bias:
                self.bias = UninitializedParameter(**kw)
        if track_running_stats:
            self.running_mean = UninitializedBuffer(**kw)
            self.running_var = UninitializedBuffer(**kw)
            self.num_batches_tracked = Tensor(torch.tensor(0, dtype=torch.long, device=device))

    def reset_parameters(self) -> None:
        if not self.has_uninitialized_params() and self.num_features != 0:
            super().reset_parameters()

    def _features(self, input) -> int:  # noqa: A002
        return input.shape[1]

    def initialize_parameters(self, input) -> None:  # noqa: A002
        if not self.has_uninitialized_params():
            if self.num_features == 0:  # materialised by load_state_dict (torch keeps 0)
                self.num_features = self._features(input)
            return
        self.num_features = self._features(input)
        with torch.no_grad():
            for t in (self.weight, self.bias, self.running_mean, self.running_var):
                if t is not None:
                    t.materialize((self.num_features,))
            self.reset_parameters()


class LazyBatchNorm1d(_LazyNormBase, BatchNorm1d):
    """A :class:`BatchNorm1d` whose ``num_features`` is ``input.shape[1]`` of the first
    input (``torch.nn.LazyBatchNorm1d``); then it becomes a ``BatchNorm1d``."""

    cls_to_become = BatchNorm1d


class LazyBatchNorm2d(_LazyNormBase, BatchNorm2d):
    """A :class:`BatchNorm2d` whose ``num_features`` is inferred from the first input
    (``torch.nn.LazyBatchNorm2d``)."""

    cls_to_become = BatchNorm2d


class LazyBatchNorm3d(_LazyNormBase, BatchNorm3d):
    """A :class:`BatchNorm3d` whose ``num_features`` is inferred from the first input
    (``torch.nn.LazyBatchNorm3d``)."""

    cls_to_become = BatchNorm3d


class _LazyInstanceNorm(_LazyNormBase):
    def _features(self, input) -> int:  # noqa: A002
        # the channel dim of a batched or unbatched input (torch reads dim 1 either way)
        return input.shape[input.ndim - self._nobatch]


class LazyInstanceNorm1d(_LazyInstanceNorm, InstanceNorm1d):
    """An :class:`InstanceNorm1d` whose ``num_features`` is inferred from the first input
    (``torch.nn.LazyInstanceNorm1d``; note torch's lazy defaults ``affine=True``,
    ``track_running_stats=True``)."""

    cls_to_become = InstanceNorm1d


class LazyInstanceNorm2d(_LazyInstanceNorm, InstanceNorm2d):
    """An :class:`InstanceNorm2d` whose ``num_features`` is inferred from the first input
    (``torch.nn.LazyInstanceNorm2d``)."""

    cls_to_become = InstanceNorm2d


class LazyInstanceNorm3d(_LazyInstanceNorm, InstanceNorm3d):
    """An :class:`InstanceNorm3d` whose ``num_features`` is inferred from the first input
    (``torch.nn.LazyInstanceNorm3d``)."""

    cls_to_become = InstanceNorm3d


class LayerNorm(Module):
    """Normalise over the last ``len(normalized_shape)`` dims (``torch.nn.LayerNorm``);
    those dims must be whole on each rank (leading dims may stay split)."""

    def __init__(self, normalized_shape, eps: float = 1e-5, elementwise_affine: bool = True,
                 bias: bool = True, device=None, dtype=None):
        super().__init__()
        if isinstance(normalized_shape, numbers.Integral):
            normalized_shape = (normalized_shape,)
        self.normalized_shape = tuple(normalized_shape)
        self.eps, self.elementwise_affine = eps, elementwise_affine
        _affine(self, elementwise_affine, bias, self.normalized_shape, device, dtype)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        _reset_affine(self)

    def forward(self, input):  # noqa: A002
        return F.layer_norm(input, self.normalized_shape, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return (f"{self.normalized_shape}, eps={self.eps}, "
                f"elementwise_affine={self.elementwise_affine}")


class RMSNorm(Module):
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last dims (``torch.nn.RMSNorm``;
    ``eps=None`` means ``torch.finfo(dtype).eps``)."""

    def __init__(self, normalized_shape, eps: float | None = None,
                 elementwise_affine: bool = True, device=None, dtype=None):
        super().__init__()
        if isinstance(normalized_shape, numbers.Integral):
            normalized_shape = (normalized_shape,)
        self.normalized_shape = tuple(normalized_shape)
        self.eps, self.elementwise_affine = eps, elementwise_affine
        optional_param(self, "weight", elementwise_affine, *self.normalized_shape,
                       device=device, dtype=dtype)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.elementwise_affine:
            init.ones_(self.weight)

    def forward(self, x):
        return F.rms_norm(x, self.normalized_shape, self.weight, self.eps)

    def extra_repr(self) -> str:
        return (f"{self.normalized_shape}, eps={self.eps}, "
                f"elementwise_affine={self.elementwise_affine}")


class GroupNorm(Module):
    """Group normalisation of (N, C, *) in ``num_groups`` groups (``torch.nn.GroupNorm``)."""

    def __init__(self, num_groups: int, num_channels: int, eps: float = 1e-5,
                 affine: bool = True, device=None, dtype=None, *, bias: bool = True):
        super().__init__()
        if num_channels % num_groups:
            raise ValueError(f"num_channels ({num_channels}) must be divisible by num_groups "
                             f"({num_groups})")
        self.num_groups, self.num_channels, self.eps, self.affine = (num_groups, num_channels,
                                                                     eps, affine)
        _affine(self, affine, bias, (num_channels,), device, dtype)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        _reset_affine(self)

    def forward(self, input):  # noqa: A002
        return F.group_norm(input, self.num_groups, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.num_groups}, {self.num_channels}, eps={self.eps}, affine={self.affine}"


class LocalResponseNorm(Module):
    """Local response normalisation across channels (``torch.nn.LocalResponseNorm``):
    :func:`sbpflow.nn.functional.local_response_norm` of (N, C, *) with ``size``,
    ``alpha``, ``beta``, ``k`` (every split but the channels' passes)."""

    def __init__(self, size: int, alpha: float = 1e-4, beta: float = 0.75, k: float = 1.0):
        super().__init__()
        self.size, self.alpha, self.beta, self.k = size, alpha, beta, k

    def forward(self, input):  # noqa: A002
        return F.local_response_norm(input, self.size, self.alpha, self.beta, self.k)

    def extra_repr(self) -> str:
        return f"{self.size}, alpha={self.alpha}, beta={self.beta}, k={self.k}"


class CrossMapLRN2d(Module):
    """torch's legacy cross-channel LRN of (N, C, H, W) (``torch.nn.CrossMapLRN2d``): its
    own autograd function (a running window sum over channels, ``x * (k + alpha / size *
    sum x^2) ^ -beta``), run on each rank's shard, so values and gradients are torch's.
    SBP: every split but the channels' passes; a split C is gathered.

    Raises:
        ValueError: an input that is not 4-D.
    """

    def __init__(self, size: int, alpha: float = 1e-4, beta: float = 0.75, k: float = 1):
        super().__init__()
        self.size, self.alpha, self.beta, self.k = size, alpha, beta, k

    def forward(self, input):  # noqa: A002
        if input.ndim != 4:
            raise ValueError(f"CrossMapLRN2d: Expected input to be 4D, got {input.ndim}D "
                             f"instead.")
        return dispatch("nn.cross_map_lrn2d", input, size=self.size, alpha=self.alpha,
                        beta=self.beta, k=self.k)

    def extra_repr(self) -> str:
        return f"{self.size}, alpha={self.alpha}, beta={self.beta}, k={self.k}"
