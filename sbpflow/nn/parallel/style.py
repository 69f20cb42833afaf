"""Tensor-parallel styles and ``parallelize_module``.

A plan maps module-name patterns (``fnmatch``: ``"blocks.*.attn.c_attn"``, ``"*.mlp.fc"``)
to a :class:`ParallelStyle`. :func:`parallelize_module` lays every parameter and buffer
out on the placement: broadcast on every mesh axis (so the data-parallel axes replicate
the model, and batch-split inputs make it data parallel), except on the tensor-parallel
axis where the matched module's style sets the SBP:

=====================  ======================================  ===========================
style                  Linear (weight (out, in))               Embedding (weight (V, E))
=====================  ======================================  ===========================
ColwiseParallel        weight S(0), bias S(0): output S(-1)    weight S(1): output S(-1)
RowwiseParallel        weight S(1), bias B: input S(-1) -> P   weight S(0) (vocabulary-
                       output, boxed to B (one all-reduce)     parallel): output P -> B
VocabParallel          same as ColwiseParallel (an LM head:    same as RowwiseParallel
                       logits split on the vocabulary, for
                       vocabulary-parallel cross entropy)
SequenceParallel       parameters B; input boxed to split on   -
                       ``seq_dim`` of the TP axis (norms,
                       dropout run on a sequence shard)
Replicate              parameters B                            parameters B
=====================  ======================================  ===========================

Styles set *parameter* layouts; activation layouts follow from sbpflow's SBP inference.
``output_layout`` (any style) boxes the module's output on the TP axis (e.g. RowwiseParallel
defaults to B: Megatron's all-reduce at the end of a block), ``input_layout`` its first
input.
"""

from __future__ import annotations

import fnmatch

from ...placement import placement as Placement
from ...sbp import SBP, Split, broadcast, partial_sum, split
from ...tensor import Tensor
from ..module import Module

__all__ = ["ParallelStyle", "ColwiseParallel", "RowwiseParallel", "VocabParallel",
           "SequenceParallel", "Replicate", "parallelize_module"]


class ParallelStyle:
    """Base of the styles: parameter SBPs on the TP axis, optional input/output layouts."""

    def __init__(self, *, input_layout: SBP | None = None, output_layout: SBP | None = None):
        self.input_layout, self.output_layout = input_layout, output_layout

    def param_sbp(self, module: Module, name: str, t: Tensor) -> SBP:
        """The SBP on the TP axis of ``module``'s parameter or buffer ``name``."""
        return broadcast

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def _kind(module: Module) -> str:
    return type(module).__name__


class ColwiseParallel(ParallelStyle):
    """Split the output features: Linear weight/bias S(0), Embedding weight S(1)."""

    def param_sbp(self, module, name, t):
        if _kind(module) == "Embedding":
            return split(1)
        return split(0) if name in ("weight", "bias") else broadcast


class RowwiseParallel(ParallelStyle):
    """Split the input features: Linear weight S(1) (bias B), Embedding weight S(0)
    (vocabulary-parallel); the P output is boxed to B unless ``output_layout`` says
    otherwise (``partial_sum`` keeps it P)."""

    def __init__(self, *, input_layout=None, output_layout=broadcast):
        super().__init__(input_layout=input_layout, output_layout=output_layout)

    def param_sbp(self, module, name, t):
        if _kind(module) == "Embedding":
            return split(0)
        return split(1) if name == "weight" else broadcast


class VocabParallel(ParallelStyle):
    """Split the vocabulary: an Embedding like RowwiseParallel (output boxed to B), an LM
    head Linear like ColwiseParallel (logits split on the vocabulary: cross entropy runs
    the vocabulary-parallel algorithm)."""

    def param_sbp(self, module, name, t):
        if _kind(module) == "Embedding":
            return split(0)
        return split(0) if name in ("weight", "bias") else broadcast

    def output(self, module):
        return broadcast if _kind(module) == "Embedding" else None


class SequenceParallel(ParallelStyle):
    """Parameters replicated; the input is split on ``seq_dim`` over the TP axis (Megatron
    sequence parallelism for norms and dropout)."""

    def __init__(self, seq_dim: int = 1, *, output_layout=None):
        super().__init__(input_layout=split(seq_dim), output_layout=output_layout)


class Replicate(ParallelStyle):
    """Every parameter B on the TP axis (the module runs replicated)."""


def _box_on_axis(x, axis: int, sbp: SBP):
    if not isinstance(x, Tensor) or not x.is_global:
        return x
    want = list(x.sbp)
    if sbp.is_split() and sbp.dim < 0:
        sbp = Split(sbp.dim % x.ndim)
    want[axis] = sbp
    return x.to_global(sbp=tuple(want))


def parallelize_module(module: Module, placement: Placement, plan, tp_axis: int = -1) -> Module:
    """Lay ``module`` out on ``placement`` following ``plan`` (in place; returns it).

    Args:
        plan: a :class:`ParallelStyle` for the whole module, or ``{pattern: style}`` over
            dotted submodule names (``fnmatch`` patterns; the first matching pattern wins;
            unmatched modules replicate). ``{}``: pure data parallel.
        tp_axis: the mesh axis that is tensor parallel (others replicate parameters, i.e.
            are data parallel). On a 1-D mesh the only axis.

    Raises:
        ValueError: a pattern that matches no submodule (a typo would silently replicate),
            or a style whose split does not fit a parameter (names both).
    """
    if isinstance(plan, ParallelStyle):
        plan = {"": plan}
    axis = tp_axis % placement.ndim
    styles: dict[str, ParallelStyle] = {}
    names = [n for n, _ in module.named_modules()]
    for pattern, style in plan.items():
        hits = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        if not hits:
            raise ValueError(f"parallelize_module: pattern {pattern!r} matches no submodule; "
                             f"submodules are {names[:20]}{'...' if len(names) > 20 else ''}")
        for n in hits:
            styles.setdefault(n, style)
    layout: dict[str, tuple[SBP, ...]] = {}
    for mod_name, mod in module.named_modules():
        style = styles.get(mod_name)
        for kind in ("_parameters", "_buffers"):
            for pname, t in getattr(mod, kind).items():
                if t is None:
                    continue
                full = f"{mod_name}.{pname}" if mod_name else pname
                s = style.param_sbp(mod, pname, t) if style is not None else broadcast
                if s.is_split() and not -t.ndim <= s.dim < t.ndim:
                    raise ValueError(f"{style!r} splits dim {s.dim} of {full} with shape "
                                     f"{tuple(t.shape)}")
                if s.is_split() and s.dim < 0:
                    s = split(s.dim % t.ndim)
                nd = [broadcast] * placement.ndim
                nd[axis] = s
                layout[full] = tuple(nd)
        if style is not None:
            _install_hooks(mod, style, axis)
    module.to_global(placement, lambda name, t: layout.get(name))
    return module


def _install_hooks(mod: Module, style: ParallelStyle, axis: int) -> None:
    out_layout = style.output_layout
    if isinstance(style, VocabParallel):
        out_layout = style.output(mod)
    if style.input_layout is not None:
        layout = style.input_layout

        def pre(m, args):
            return (_box_on_axis(args[0], axis, layout), *args[1:])

        mod.register_forward_pre_hook(pre)
    if out_layout is not None and out_layout != partial_sum:
        def post(m, args, out):
            return _box_on_axis(out, axis, out_layout)

        mod.register_forward_hook(post)
