"""``sbpflow.env``: OneFlow's ``oneflow.env`` (the process's place in the job).

OneFlow-only API (PyTorch has none of these names; ``sbpflow.distributed`` has the
torch-style ones): :func:`get_rank`, :func:`get_world_size`, :func:`get_local_rank`,
:func:`get_node_size`, :func:`all_device_placement`. Like every query of
:mod:`sbpflow.distributed`, the first call initialises the process group lazily from
torchrun's environment variables (a plain process is a world of 1, rank 0).

Layer: beside :mod:`sbpflow.placement` (it reads :mod:`sbpflow.distributed` and makes a
placement).
"""

from __future__ import annotations

import os

from .distributed import get_local_rank, get_rank, get_world_size
from .placement import placement as Placement

__all__ = ["all_device_placement", "get_local_rank", "get_node_size", "get_rank",
           "get_world_size"]


def get_node_size() -> int:
    """Number of nodes (machines) in the job.

    ``WORLD_SIZE / LOCAL_WORLD_SIZE`` (rounded up) from torchrun's variables; 1 in a plain
    process or when ``LOCAL_WORLD_SIZE`` is not set (ranks started by hand with only
    ``RANK``/``WORLD_SIZE`` are taken to share one node).

    Raises:
        ValueError: ``LOCAL_WORLD_SIZE`` is set but not a positive int (names the value).
    """
    world = get_world_size()
    raw = os.environ.get("LOCAL_WORLD_SIZE", "").strip()
    if not raw or world == 1:
        return 1
    try:
        local = int(raw)
    except ValueError:
        local = 0
    if local < 1:
        raise ValueError(f"LOCAL_WORLD_SIZE={raw!r} is not a positive int; launch with "
                         f"`sbpflow launch` (torchrun sets it) or unset it")
    return -(-world // local)


def all_device_placement(device_type: str) -> Placement:
    """A 1-D placement over every rank of the world on ``device_type`` (``"cpu"`` or
    ``"cuda"``; OneFlow's ``oneflow.env.all_device_placement``). The same as
    ``sbpflow.placement.all(device_type)``.

    Raises:
        ValueError: an unknown device type (from :class:`sbpflow.placement`).
    """
    return Placement.all(device_type)
