"""Pipeline stages as placements: ``GraphModule.set_stage(k, placement)`` (eager mode and
graphs alike).

A staged module's parameters and buffers move to the stage's placement when it is set;
when the module runs, its global tensor arguments on another placement are boxed to the
stage's (the cross-placement boxing), and so are its own parameters that live on another
stage (a tied weight): their gradients come back by the boxing's dual. Inside a graph's
pipeline step such a parameter is sent once per step instead
(:class:`sbpflow.graph.passes.ForeignParams`, found through the compile context).
"""

from __future__ import annotations

import weakref

import torch

from ..distributed._state import _state as _dstate
from ..tensor import Tensor

__all__ = ["place_stage", "stage_placement_sbp"]

# Which stage holds a tensor shared by modules of several stages (a tied weight): the
# lowest. Process-wide, as the tensors are: id(tensor) -> (stage id, weakref(tensor)).
_CLAIMS: dict[int, tuple] = {}


def stage_placement_sbp(x, placement):
    """The nd-SBP ``x`` takes on ``placement`` when it enters a stage: its own where the
    mesh shapes agree (shard to shard), else broadcast."""
    from ..sbp import broadcast

    if tuple(x.placement.shape) == tuple(placement.shape):
        return x.sbp
    return (broadcast,) * placement.ndim


def _to_placement(x, pl):
    if isinstance(x, Tensor) and x.is_global and x.placement != pl:
        return x.to_global(pl, stage_placement_sbp(x, pl))
    return x


def place_stage(module, settings) -> None:
    """Put ``module`` in pipeline stage ``settings.stage_id`` on
    ``settings.stage_placement`` (``settings``: its :class:`sbpflow.nn.graph.GraphModule`):

    * its parameters and buffers move to the placement now (in place, objects kept),
      with their nd-SBP where the mesh shapes agree (shard to shard), else broadcast; a
      tensor shared with a module of another stage (a tied weight) stays with the lowest
      stage;
    * when it runs, its global tensor arguments on another placement are boxed to the
      placement, and so are its own parameters that live on another stage: their
      gradients come back by the boxing's dual and are summed into the one parameter, as
      Megatron sums the tied embedding's gradient over the first and last stage.

    Eagerly the stages then run one after another; in an ``nn.Graph`` as a pipeline."""
    from ..nn.module import _rebind

    stage_id, placement = settings.stage_id, settings.stage_placement
    for sub in module.modules():
        for store in (sub._parameters, sub._buffers):
            for t in store.values():
                if t is None or not t.is_global:
                    continue
                claim = _CLAIMS.get(id(t))
                if claim is not None and claim[1]() is t and claim[0] <= stage_id:
                    continue  # a lower (or this) stage holds it
                _CLAIMS[id(t)] = (stage_id, weakref.ref(t))
                if t.placement != placement:
                    with torch.no_grad():
                        _rebind(t, t.detach().to_global(
                            placement, stage_placement_sbp(t, placement)))
    if settings.stage_hooks is None:
        pre, post = _stage_hooks(settings)
        settings.stage_hooks = (module.register_forward_pre_hook(pre, with_kwargs=True),
                                module.register_forward_hook(post))


def _stage_hooks(settings):
    """The staged module's forward pre- and post-hook: box its inputs and foreign
    parameters to its placement, and (while a pipeline traces) label the ops it runs with
    its stage; the post-hook puts the parameters back. Calls nest (a stack per module)."""
    from torch.fx import traceback as fx_traceback
    from torch.utils import _pytree as pytree

    swaps: list = []  # per call in flight: [(submodule, name, parameter)]
    labels: list = []  # per call in flight under a pipeline trace: the stage label before

    def pre(mod, args, kwargs):
        pl = settings.stage_placement
        ctx = getattr(_dstate.tracer, "context", None)  # a graph's step being traced
        foreign = ctx.foreign if ctx is not None else None
        swapped = []
        for sub in mod.modules():
            for name, p in sub._parameters.items():
                if p is not None and p.is_global and p.placement != pl:
                    swapped.append((sub, name, p))
                    sub._parameters[name] = foreign.get(p, pl) if foreign is not None \
                        else _to_placement(p, pl)
        swaps.append(swapped)
        if fx_traceback.has_preserved_node_meta():  # a pipeline's trace: ops carry the stage
            custom = fx_traceback.current_meta.setdefault("custom", {})
            labels.append(custom.get("stage"))
            custom["stage"] = settings.stage_id
        else:
            labels.append(_UNSET)
        return pytree.tree_map(lambda x: _to_placement(x, pl), (args, kwargs))

    def post(mod, args, out):
        for sub, name, p in swaps.pop():
            sub._parameters[name] = p
        before = labels.pop()
        if before is not _UNSET:
            custom = fx_traceback.current_meta.get("custom", {})
            if before is None:
                custom.pop("stage", None)
            else:
                custom["stage"] = before

    return pre, post


_UNSET = object()
