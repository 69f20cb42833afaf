"""Parallel recipes: ``parallelize_module`` with tensor-parallel styles (in the spirit of
``torch.distributed.tensor.parallel.parallelize_module`` and OneFlow's ``to_global``), and
``DistributedDataParallel`` for programs written with local tensors; ``DataParallel``,
torch's interface (a thin wrapper: in sbpflow the batch layout is the data parallelism)."""

from .data_parallel import DataParallel
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

__all__ = ["ColwiseParallel", "DataParallel", "DistributedDataParallel", "ParallelStyle",
           "Replicate", "RowwiseParallel", "SequenceParallel", "VocabParallel",
           "parallelize_module"]
