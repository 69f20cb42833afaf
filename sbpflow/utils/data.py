"""``sbpflow.utils.data``: torch's data pipeline, yielding sbpflow tensors, with global
batches that equal what one process would have loaded.

torch's ``Dataset``, ``IterableDataset``, ``TensorDataset``, samplers, ``random_split``,
``default_collate`` ... are re-exported unchanged. :class:`DataLoader` is torch's
``DataLoader`` whose batches come out as sbpflow tensors (so a PyTorch training loop runs
under ``import sbpflow as torch``), and which, given ``placement=``, loads on each rank
only its part of each global batch and yields global tensors:

* the global batch (``batch_size`` samples, drawn by the sampler exactly as one process
  would draw them: same seed, same order) is cut along dim 0 by
  :func:`sbpflow.shard_slices` for ``sbp`` (default ``split(0)``; on a 2-D mesh e.g.
  ``(split(0), broadcast)``: data parallel on axis 0, the tensor-parallel ranks of axis 1
  load the same part);
* each rank loads its part (uneven sizes allowed: first parts one longer) and the parts
  become one global tensor laid out ``sbp`` with no data movement.

Every rank must build the loader with the same dataset, sampler seed and batch size.
"""

from __future__ import annotations

import torch
from torch.utils.data import (  # noqa: F401 - re-exports
    BatchSampler,
    ConcatDataset,
    Dataset,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
    Subset,
    SubsetRandomSampler,
    TensorDataset,
    WeightedRandomSampler,
    default_collate,
    get_worker_info,
    random_split,
)
from torch.utils.data import DataLoader as _TorchDataLoader

from ..placement import placement as Placement
from ..placement import shard_slices
from ..sbp import normalize_nd_sbp, split
from ..tensor import Tensor

_S0 = split(0)

__all__ = ["BatchSampler", "ConcatDataset", "DataLoader", "Dataset", "GlobalBatchSampler",
           "IterableDataset", "RandomSampler", "Sampler", "SequentialSampler", "Subset",
           "SubsetRandomSampler", "TensorDataset", "WeightedRandomSampler", "default_collate",
           "get_worker_info", "random_split", "to_global_batch"]


class GlobalBatchSampler(Sampler):
    """Yields, for this rank, its part of each global batch of ``batch_size`` indices.

    Args:
        sampler: the order of samples (e.g. ``RandomSampler(ds, generator=g)``), the same
            on every rank.
        batch_size: the global batch size (samples per step over all ranks).
        drop_last: drop a last global batch smaller than ``batch_size``.
        placement, sbp: the layout of the batch's dim 0 (1-D SBP per mesh axis; only
            ``split(0)`` and ``broadcast`` entries).

    Raises:
        ValueError: this rank is outside ``placement``, or an SBP other than S(0)/B.
    """

    def __init__(self, sampler, batch_size: int, drop_last: bool, placement: Placement,
                 sbp=_S0):
        self.batches = BatchSampler(sampler, batch_size, drop_last)
        self.placement = placement
        self.sbp = normalize_nd_sbp(sbp, placement.ndim, 1)
        for s in self.sbp:
            if s.is_partial():
                raise ValueError(f"a batch cannot be laid out partial-sum; use split(0) or "
                                 f"broadcast, got {self.sbp}")
        if placement.coord() is None:
            raise ValueError(f"this rank is not in {placement!r}; every rank that loads data "
                             f"must be in the batch's placement")

    def __iter__(self):
        for batch in self.batches:
            sl = shard_slices((len(batch),), self.placement.shape, self.sbp,
                              self.placement.coord())[0]
            yield batch[sl]

    def __len__(self) -> int:
        return len(self.batches)


def to_global_batch(batch, placement: Placement | None = None, sbp=_S0,
                    global_size: int | None = None):
    """Wrap a collated batch (tensors in dicts, lists, tuples) as sbpflow tensors.

    Without ``placement``: local tensors. With it: each torch tensor is this rank's part
    of dim 0 of a global tensor laid out ``sbp`` (other dims whole); ``global_size`` (the
    global batch size) skips the exchange of part sizes when given.
    """
    if isinstance(batch, torch.Tensor):
        if placement is None:
            return Tensor(batch)
        nd = normalize_nd_sbp(sbp, placement.ndim, max(batch.dim(), 1))
        size = None if global_size is None else (global_size, *batch.shape[1:])
        return Tensor(batch).to_global(placement, nd, check_meta=size is None, size=size)
    if isinstance(batch, dict):
        return type(batch)((k, to_global_batch(v, placement, sbp, global_size))
                           for k, v in batch.items())
    if isinstance(batch, (list, tuple)) and not isinstance(batch, str):
        items = [to_global_batch(v, placement, sbp, global_size) for v in batch]
        return type(batch)(*items) if hasattr(batch, "_fields") else type(batch)(items)
    return batch


class DataLoader(_TorchDataLoader):
    """``torch.utils.data.DataLoader`` (every argument as in torch) yielding sbpflow tensors.

    Extra keyword arguments:
        placement: lay each batch out globally on this placement (``batch_size`` is then
            the global batch size; each rank loads only its part, see the module doc).
        sbp: the batch's layout over the mesh axes (default ``split(0)``).

    Raises:
        ValueError: ``placement`` with ``batch_sampler`` (give ``sampler`` instead) or with
            an IterableDataset (its order cannot be cut into global batches here).
    """

    def __init__(self, dataset, batch_size: int | None = 1, shuffle: bool | None = None,
                 sampler=None, batch_sampler=None, *args, placement: Placement | None = None,
                 sbp=_S0, drop_last: bool = False, generator=None, **kwargs):
        self._placement, self._sbp = placement, sbp
        self._global_batch = None
        if placement is not None:
            if batch_sampler is not None:
                raise ValueError("DataLoader(placement=...) builds its own batch sampler; "
                                 "pass sampler= (the sample order) instead of batch_sampler=")
            if isinstance(dataset, torch.utils.data.IterableDataset):
                raise ValueError("DataLoader(placement=...) needs a map-style dataset; for an "
                                 "IterableDataset load per rank and call to_global_batch")
            if sampler is None:
                sampler = RandomSampler(dataset, generator=generator) if shuffle else \
                    SequentialSampler(dataset)
            batch_sampler = GlobalBatchSampler(sampler, batch_size, drop_last, placement, sbp)
            self._global_batch = batch_size
            super().__init__(dataset, *args, batch_sampler=batch_sampler, **kwargs)
        else:
            super().__init__(dataset, batch_size, shuffle, sampler, batch_sampler, *args,
                             drop_last=drop_last, generator=generator, **kwargs)

    def __iter__(self):
        sampler = self.batch_sampler
        for batch in super().__iter__():
            size = None
            if self._placement is not None and sampler.batches.drop_last:
                size = self._global_batch  # every global batch is full: no size exchange
            yield to_global_batch(batch, self._placement, self._sbp, size)
