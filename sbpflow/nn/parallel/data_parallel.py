"""``DataParallel``: torch.nn.DataParallel's interface over sbpflow's layouts."""

from __future__ import annotations

from ..module import Module

__all__ = ["DataParallel"]


class DataParallel(Module):
    """``torch.nn.DataParallel(module, device_ids=None, output_device=None, dim=0)``: a
    thin wrapper that calls ``module`` (kept as ``.module``; the state dict's keys get the
    ``module.`` prefix, as torch's).

    In sbpflow the data parallelism is the layout, not a wrapper: replicate the parameters
    and split the batch, and every layer runs on its part of the batch with the gradients
    of the B parameters summed over the ranks (ARCHITECTURE "Autograd: the dual rule")::

        pl = sbpflow.placement.all("cpu")           # or "cuda": one rank per device
        model.to_global(pl, sbpflow.sbp.broadcast)  # parameters B
        x = batch.to_global(pl, sbpflow.sbp.split(0))  # the batch S(0)
        loss = model(x)...                          # forward: no collective

    So this wrapper adds nothing: it runs the module on the inputs as they are laid out
    (global inputs split on ``dim`` give data parallel; local inputs run on one process,
    which is what torch's ``DataParallel`` does on a machine without GPUs). There is no
    scatter, replicate or gather, and ``device_ids``/``output_device`` are recorded only
    (torch's arguments, so existing code runs); for programs written with local tensors
    on several processes see :class:`sbpflow.nn.parallel.DistributedDataParallel`.
    """

    def __init__(self, module: Module, device_ids=None, output_device=None, dim: int = 0):
        super().__init__()
        self.module = module
        self.device_ids = [] if device_ids is None else list(device_ids)
        self.output_device = output_device
        self.dim = dim

    def forward(self, *inputs, **kwargs):
        return self.module(*inputs, **kwargs)
