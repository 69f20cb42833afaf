"""Parallel recipes: ``parallelize_module`` with tensor-parallel styles (in the spirit of
``torch.distributed.tensor.parallel.parallelize_module`` and OneFlow's ``to_global``), and
``DistributedDataParallel`` for programs written with local tensors."""

from .ddp import DistributedDataParallel
from .style import (
    ColwiseParallel,
    ParallelStyle,
    Replicate,
    RowwiseParallel,
    SequenceParallel,
    VocabParallel,
    parallelize_module,
)

__all__ = ["ColwiseParallel", "DistributedDataParallel", "ParallelStyle", "Replicate",
           "RowwiseParallel", "SequenceParallel", "VocabParallel", "parallelize_module"]
