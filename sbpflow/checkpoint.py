"""Checkpoints: ``sbpflow.save`` / ``sbpflow.load`` for state dicts holding global tensors.

Format (a directory; no pickle anywhere)::

    ckpt/
      LATEST                      name of the last complete version, e.g. "v000003"
      v000003/
        meta.json                 the tree: dicts, lists, numbers, strings, tensor records
        rank-00000.safetensors    the shards this rank wrote
        rank-00001.safetensors    ...

* **Each rank writes only its own shards.** A split axis: every coordinate writes its
  part. A broadcast axis: one coordinate writes (spread over the tensors, so replicas
  share the work). A partial-sum axis is reduce-scattered to a split first, so a P
  tensor costs its shard bytes too. A rank's file is therefore about its shard bytes.
  Local tensors (and torch tensors) are taken as equal on every rank and written by
  rank 0. ``meta.json`` records for every tensor its global shape, dtype, and for each
  stored piece the file, key and global index ranges.
* **Atomic.** Files go to ``ckpt/.tmp-vNNNNNN/``; after a barrier (bounded by the
  collective timeout) rank 0 renames it to ``ckpt/vNNNNNN`` and replaces ``LATEST``
  (``os.replace``), then deletes older versions beyond ``keep``. A crash at any point
  (a rank killed mid-write) leaves ``LATEST`` naming the previous complete version.
* **Loading reshards.** :func:`load` returns the tree with :class:`StoredTensor` leaves
  that read lazily: ``module.load_state_dict`` / ``optimizer.load_state_dict`` ask each
  one for exactly this rank's shard of the target layout (any placement, SBP or world
  size), and only the bytes of that shard are read (safetensors slices).

Single files for interchange with PyTorch: ``save(sd, "model.safetensors")`` or
``save(sd, "model.pt")`` gathers whole tensors and rank 0 writes one file
(``safetensors.torch.save_file`` / ``torch.save``); :func:`load` of such a file
(``torch.load(weights_only=True)``) gives local sbpflow tensors.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .distributed import _comm, ensure_groups, get_rank, get_world_size
from .placement import placement as Placement
from .placement import shard_slices
from .sbp import SBP, Split, broadcast, format_nd_sbp, normalize_nd_sbp
from .tensor import Tensor

__all__ = ["save", "load", "StoredTensor"]

FORMAT_VERSION = 1
_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool)}


# ---------------------------------------------------------------------- tree encoding
def _encode(obj, tensors: list) -> Any:
    """JSON-able form of ``obj`` with tensors replaced by ``{"__tensor__": i}``."""
    if isinstance(obj, (Tensor, torch.Tensor)):
        tensors.append(obj)
        return {"__tensor__": len(tensors) - 1}
    if isinstance(obj, dict):
        return {"__dict__": [[_encode(k, tensors), _encode(v, tensors)] for k, v in obj.items()]}
    if isinstance(obj, tuple):
        return {"__tuple__": [_encode(v, tensors) for v in obj]}
    if isinstance(obj, list):
        return [_encode(v, tensors) for v in obj]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, (np.integer, np.floating)):
        return obj.item()
    if isinstance(obj, torch.dtype):
        return {"__dtype__": str(obj).removeprefix("torch.")}
    raise TypeError(f"sbpflow.save cannot store a {type(obj).__name__} ({obj!r}); state "
                    f"dicts may hold tensors, dicts, lists, tuples, numbers, strings and None")


def _decode(obj, leaves: list) -> Any:
    if isinstance(obj, list):
        return [_decode(v, leaves) for v in obj]
    if isinstance(obj, dict):
        if "__tensor__" in obj:
            return leaves[obj["__tensor__"]]
        if "__dict__" in obj:
            return {_decode(k, leaves): _decode(v, leaves) for k, v in obj["__dict__"]}
        if "__tuple__" in obj:
            return tuple(_decode(v, leaves) for v in obj["__tuple__"])
        if "__dtype__" in obj:
            return _DTYPES[obj["__dtype__"]]
    return obj


# ---------------------------------------------------------------------- layout of a save
def _stored_layout(t: Tensor) -> tuple[SBP, ...]:
    """The layout written: P axes become a split of the largest dim (reduce-scatter)."""
    if not any(s.is_partial() for s in t.sbp):
        return t.sbp
    d = max(range(t.ndim), key=lambda i: t.shape[i]) if t.ndim else None
    return tuple((Split(d) if d is not None else broadcast) if s.is_partial() else s
                 for s in t.sbp)


def _writers(pl: Placement, nd: Sequence[SBP], index: int) -> list[tuple[int, ...]]:
    """Mesh coordinates that write this tensor: every coordinate on split axes, one per
    broadcast axis (rotating with ``index`` so replicas share the writing)."""
    axes = [range(n) if s.is_split() else [index % n] for s, n in zip(nd, pl.shape)]
    return [tuple(c) for c in itertools.product(*axes)]


def _ranges(slices) -> list[list[int]]:
    return [[s.start, s.stop] for s in slices]


# ---------------------------------------------------------------------- save
def save(obj, path: str | os.PathLike, *, keep: int = 1) -> None:
    """Save a state dict (or any tree of dicts/lists/tuples/numbers/strings/tensors).

    ``path`` a directory: the sharded, atomic format of this module; every rank of the
    world calls ``save`` with the same tree structure (collective). ``path`` ending in
    ``.safetensors`` or ``.pt``/``.pth``/``.bin``: one whole-tensor file for PyTorch
    (written by rank 0; global tensors are gathered first, so every rank calls it too).

    Args:
        keep: complete versions to keep in the directory (>= 1).

    Raises:
        TypeError: a leaf that cannot be stored (names it).
        CollectiveError: a rank failed or diverged during the save (the previous
            checkpoint stays the one ``LATEST`` names).
    """
    path = os.fspath(path)
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    if path.endswith((".safetensors", ".pt", ".pth", ".bin")):
        _save_whole(obj, path)
        return
    tensors: list = []
    tree = _encode(obj, tensors)
    rank, world = get_rank(), get_world_size()
    version = _agree_version(path)
    name = f"v{version:06d}"
    tmp = os.path.join(path, f".tmp-{name}")
    mine: dict[str, torch.Tensor] = {}
    records = []
    for i, t in enumerate(tensors):
        key = f"t{i}"
        if isinstance(t, torch.Tensor):
            t = Tensor(t.detach())
        if t.is_local:
            if rank == 0:
                mine[key] = t._local.detach().cpu().contiguous()
            records.append({"shape": list(t.shape), "dtype": _dtype_name(t.dtype),
                            "pieces": [{"rank": 0, "key": key,
                                        "ranges": [[0, n] for n in t.shape]}]})
            continue
        pl = t.placement
        nd = _stored_layout(t)
        with torch.no_grad():
            src = t.detach() if nd == t.sbp else t.detach().to_global(pl, nd)
        pieces = []
        for coord in _writers(pl, nd, i):
            r = pl.rank_at(coord)
            sl = shard_slices(tuple(t.shape), pl.shape, nd, coord)
            pieces.append({"rank": r, "key": key, "ranges": _ranges(sl)})
            if r == rank:
                mine[key] = src._local.detach().cpu().contiguous()
        records.append({"shape": list(t.shape), "dtype": _dtype_name(t.dtype),
                        "pieces": pieces, "saved_from": {
                            "ranks": pl.rank_list, "mesh": list(pl.shape),
                            "sbp": format_nd_sbp(t.sbp)}})
    seen: set[int] = set()
    for key, v in mine.items():  # tied weights (one tensor under two names): own copies,
        if v.untyped_storage().data_ptr() in seen:  # as safetensors refuses shared memory
            mine[key] = v.clone()
        seen.add(v.untyped_storage().data_ptr())
    save_file(mine, os.path.join(tmp, f"rank-{rank:05d}.safetensors"))
    if rank == 0:
        meta = {"format": "sbpflow-checkpoint", "version": FORMAT_VERSION,
                "world_size": world, "tree": tree, "tensors": records}
        _write_json(os.path.join(tmp, "meta.json"), meta)
    _comm.barrier()  # every file is written (or the save fails here, bounded)
    if rank == 0:
        final = os.path.join(path, name)
        os.replace(tmp, final)
        _fsync_dir(path)
        latest_tmp = os.path.join(path, ".LATEST.tmp")
        with open(latest_tmp, "w") as f:
            f.write(name + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(latest_tmp, os.path.join(path, "LATEST"))
        _fsync_dir(path)
        versions = sorted(d for d in os.listdir(path) if d.startswith("v") and d[1:].isdigit())
        for old in versions[:-keep]:
            shutil.rmtree(os.path.join(path, old), ignore_errors=True)
    _comm.barrier()  # nobody returns (and perhaps loads) before the commit


def _dtype_name(dt: torch.dtype) -> str:
    name = str(dt).removeprefix("torch.")
    if name not in _DTYPES:
        raise TypeError(f"sbpflow.save: dtype {dt} is not supported; cast first")
    return name


def _agree_version(path: str) -> int:
    """Rank 0 picks the next version number and creates its temporary directory; the
    others learn the number from it (the broadcast orders the mkdir before any write)."""
    v = torch.zeros(1, dtype=torch.int64)
    if get_rank() == 0:
        os.makedirs(path, exist_ok=True)
        existing = [int(d[1:]) for d in os.listdir(path) if d.startswith("v") and d[1:].isdigit()]
        for d in os.listdir(path):  # leftovers of saves that crashed
            if d.startswith(".tmp-"):
                shutil.rmtree(os.path.join(path, d), ignore_errors=True)
        v[0] = max(existing, default=0) + 1
        os.makedirs(os.path.join(path, f".tmp-v{int(v[0]):06d}"))
    world = tuple(range(get_world_size()))
    if len(world) > 1:
        ensure_groups([world])
        _comm.broadcast(v, world, 0)
    return int(v[0])


def _write_json(path: str, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _save_whole(obj, path: str) -> None:
    tensors: list = []
    tree = _encode(obj, tensors)
    whole = []
    for t in tensors:
        if isinstance(t, Tensor):
            t = torch.as_tensor(t.numpy()) if t.is_global else t._local.detach().cpu()
        whole.append(t.detach().cpu().contiguous())
    if get_rank() == 0:
        flat = _decode(tree, whole)
        tmp = path + ".tmp"
        if path.endswith(".safetensors"):
            if not isinstance(flat, dict) or not all(isinstance(v, torch.Tensor)
                                                     for v in flat.values()):
                raise TypeError("a .safetensors file holds a flat dict of tensors (e.g. "
                                "model.state_dict()); save other trees to a directory")
            save_file(flat, tmp)
        else:
            torch.save(flat, tmp)
        os.replace(tmp, path)
    if get_world_size() > 1:
        _comm.barrier()


# ---------------------------------------------------------------------- load
class StoredTensor:
    """A tensor in a checkpoint directory, read on demand.

    Attributes: ``shape`` (global), ``dtype``. Methods read only the requested region:
    :meth:`read` (a region as a torch tensor), :meth:`to_global` (this rank's shard of a
    layout: no communication), :meth:`full` / :meth:`numpy` (the whole value).
    """

    def __init__(self, folder: str, record: dict):
        self.folder = folder
        self.shape = torch.Size(record["shape"])
        self.dtype = _DTYPES[record["dtype"]]
        self.pieces = record["pieces"]
        self.saved_from = record.get("saved_from")

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __repr__(self) -> str:
        return (f"StoredTensor(shape={tuple(self.shape)}, dtype={self.dtype}, "
                f"folder={self.folder!r})")

    def read(self, slices: Sequence[slice]) -> torch.Tensor:
        """The region ``slices`` (steps of 1) of the global value."""
        want = [(s.start or 0, self.shape[d] if s.stop is None else s.stop)
                for d, s in enumerate(slices)]
        out = torch.empty([b - a for a, b in want], dtype=self.dtype)
        if out.numel() == 0:
            return out
        seen = set()
        for piece in self.pieces:
            rng = piece["ranges"]
            inter = [(max(a, pa), min(b, pb)) for (a, b), (pa, pb) in zip(want, rng)]
            if any(lo >= hi for lo, hi in inter):
                continue
            box = tuple(tuple(x) for x in inter)
            if box in seen:
                continue
            seen.add(box)
            fname = os.path.join(self.folder, f"rank-{piece['rank']:05d}.safetensors")
            with safe_open(fname, framework="pt") as f:
                part = f.get_slice(piece["key"])[tuple(slice(lo - pa, hi - pa) for (lo, hi), (
                    pa, _) in zip(inter, rng))] if inter else f.get_tensor(piece["key"])
            out[tuple(slice(lo - a, hi - a) for (lo, hi), (a, _) in zip(inter, want))] = part
        return out

    def full(self) -> torch.Tensor:
        """The whole value (reads every piece once)."""
        return self.read([slice(0, n) for n in self.shape])

    def numpy(self) -> np.ndarray:
        return self.full().numpy()

    def to_global(self, placement: Placement, sbp, requires_grad: bool = False) -> Tensor:
        """This rank's shard of the value laid out as ``sbp`` on ``placement`` (read from the
        files, no communication). P: mesh coordinate 0 of each P axis holds the value."""
        nd = normalize_nd_sbp(sbp, placement.ndim, self.ndim)
        coord = placement.coord()
        if coord is None:
            local = torch.empty((0,) * max(self.ndim, 1), dtype=self.dtype)
        else:
            local = self.read(shard_slices(tuple(self.shape), placement.shape, nd, coord))
            if any(s.is_partial() and c != 0 for s, c in zip(nd, coord)):
                local.zero_()
        out = Tensor(local.to(placement.device), placement, nd, self.shape)
        if requires_grad:
            out.requires_grad_(True)
        return out

    def to_local(self) -> Tensor:
        return Tensor(self.full())


def load(path: str | os.PathLike):
    """Load what :func:`save` wrote, or a PyTorch/safetensors file.

    A checkpoint directory: the tree with :class:`StoredTensor` leaves (lazy; pass it to
    ``load_state_dict``, or call ``.to_global(placement, sbp)`` / ``.full()``). Not
    collective: each rank reads what it needs. A ``.safetensors`` file: a dict of local
    sbpflow tensors. Any other file: ``torch.load(weights_only=True)`` (no arbitrary
    pickle), torch tensors wrapped as local sbpflow tensors.

    Raises:
        FileNotFoundError: no such path, or a directory without a complete checkpoint.
        ValueError: a directory that is not an sbpflow checkpoint.
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        return _load_dir(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"no checkpoint at {path!r}")
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        return {k: Tensor(v) for k, v in load_file(path).items()}
    obj = torch.load(path, map_location="cpu", weights_only=True)
    return _wrap_torch(obj)


def _wrap_torch(obj):
    if isinstance(obj, torch.Tensor):
        return Tensor(obj)
    if isinstance(obj, dict):
        return type(obj)((k, _wrap_torch(v)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return type(obj)(_wrap_torch(v) for v in obj)
    return obj


def _load_dir(path: str):
    latest = os.path.join(path, "LATEST")
    if not os.path.exists(latest):
        raise FileNotFoundError(f"{path!r} holds no complete sbpflow checkpoint (no LATEST "
                                f"file; a save that crashed leaves only .tmp-* folders)")
    with open(latest) as f:
        folder = os.path.join(path, f.read().strip())
    with open(os.path.join(folder, "meta.json")) as f:
        meta = json.load(f)
    if meta.get("format") != "sbpflow-checkpoint":
        raise ValueError(f"{folder!r} is not an sbpflow checkpoint")
    leaves = [StoredTensor(folder, r) for r in meta["tensors"]]
    return _decode(meta["tree"], leaves)
