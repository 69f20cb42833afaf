"""Checkpoints: ``sbpflow.save`` / ``sbpflow.load`` for state dicts holding global tensors.

Format 2 (a directory; no pickle anywhere)::

    ckpt/
      LATEST                      name of the last committed version, e.g. "v000003"
      .lock                       held (fcntl.flock) by rank 0 while a save runs
      v000003/
        meta.json                 the tree, a record per tensor, size and sha256 per file
        meta.json.sha256          "<sha256>  meta.json" (``sha256sum -c`` reads it)
        rank-00000.safetensors    the shards rank 0 wrote
        rank-00001.safetensors    ...

* **Matched by name.** Every tensor is stored and found by its path in the tree: dict
  keys and list/tuple indices joined by ``/`` (``model/h.0.attn.weight``,
  ``optim/state/3/exp_avg``). A string key is kept as it is except that ``%`` and ``/``
  become ``%25`` and ``%2F``, and a string that looks like an integer, starts with ``#``
  or is ``__metadata__`` (reserved in safetensors) has its first character escaped
  (``"0"`` -> ``%30``); integer keys and indices are their decimal digits; any other key
  (``None``, ``True``, a float, a tuple, ``""``) is ``#`` plus its escaped ``repr``.
  So two different positions in a tree never share a path, and the path does not
  depend on the order of a dict: ranks that built the same dict in different orders
  save and load the same thing.
* **The ranks agree before anything is written.** Every rank describes its tree (each
  path: container kind, or tensor global shape, dtype, placement and nd-SBP) and the
  ranks compare a sha256 of that description (one small all-gather). A difference raises
  :class:`CheckpointMismatchError` on every rank, naming the differing paths and what
  each rank has, and nothing is written. Values of non-tensor leaves (numbers, strings)
  and of local tensors are not compared: rank 0's are written.
* **Each rank writes only its own shards.** A split axis: every coordinate writes its
  part. A broadcast axis: one coordinate writes, chosen by a stable hash of the path (so
  replicas share the work, identically on every rank). A partial-sum axis is
  reduce-scattered to a split first, so a P tensor costs its shard bytes too. Tensors
  are processed in sorted path order, so these reduce-scatters run in the same order on
  every rank. Local tensors (and torch tensors) are taken as equal on every rank and
  written by rank 0. ``meta.json`` records for every tensor its global shape, dtype, and
  for each stored piece the rank file, key and global index ranges.
* **Checksums.** Each rank hashes the bytes of its file as it writes it (sha256); rank 0
  gathers the sizes and digests into ``meta.json`` and writes ``meta.json``'s own digest
  beside it. :func:`load` checks them all before returning.
* **Atomic, one writer.** Rank 0 holds an exclusive ``fcntl.flock`` on ``ckpt/.lock``
  for the whole save; a second job saving into the same directory meanwhile gets
  :class:`CheckpointLockedError`. Files go to ``ckpt/.tmp-vNNNNNN/``; once every rank
  reported its file, rank 0 renames it to ``ckpt/vNNNNNN`` and replaces ``LATEST``
  (``os.replace``), then deletes older versions beyond ``keep``. A crash at any point
  (a rank killed mid-write) leaves ``LATEST`` naming the previous complete version.
* **Loading verifies, then falls back.** :func:`load` verifies the version ``LATEST``
  names (``meta.json`` matches its digest and parses, every file it lists exists with
  its size and sha256). If that version is damaged or missing, it warns
  (:class:`CheckpointFallbackWarning`, naming the file and the version used instead) and
  loads the newest intact older version (if ``LATEST`` itself is missing or damaged:
  the newest intact version); ``fallback=False`` raises instead. Every rank
  verifies on its own (load is not collective) and, reading the same files, reaches the
  same decision. Cost: each rank reads every file of the version once: 1.1 GiB/s
  measured (sha256 on one core of this 2-core CPU machine, files in the page cache,
  128 MiB version), so about 1 s per GiB of checkpoint per rank, more from a cold
  disk or a shared file system read by every rank.
* **Loading reshards.** :func:`load` returns the tree with :class:`StoredTensor` leaves
  that read lazily: ``module.load_state_dict`` / ``optimizer.load_state_dict`` ask each
  one for exactly this rank's shard of the target layout (any placement, SBP or world
  size), and only the bytes of that shard are read (safetensors slices).
* **Not covered.** Bytes that change after :func:`load` verified them are read as they
  are (lazy reads check only that the file parses); :func:`load` takes no lock, so a
  save into the same directory with a small ``keep`` may delete the version being read;
  the values of non-tensor leaves and local tensors are rank 0's, not compared.
* Format 1 (sbpflow before checksums: tensors named ``t0, t1, ...`` by position, no
  ``files`` in ``meta.json``) still loads, with a warning that it cannot be verified.

Single files for interchange with PyTorch: ``save(sd, "model.safetensors")`` or
``save(sd, "model.pt")`` gathers whole tensors and rank 0 writes one file
(``safetensors.torch.save_file`` / ``torch.save``); :func:`load` of such a file
(``torch.load(weights_only=True)``) gives local sbpflow tensors. These carry no
checksums.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import itertools
import json
import os
import re
import shutil
import socket
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save as _safetensors_bytes
from safetensors.torch import save_file

from .distributed import _comm, all_gather_bytes, ensure_groups, get_rank, get_world_size
from .placement import placement as Placement
from .placement import shard_slices
from .sbp import SBP, Split, broadcast, format_nd_sbp, normalize_nd_sbp
from .tensor import Tensor

__all__ = ["save", "load", "StoredTensor", "CheckpointError", "CheckpointMismatchError",
           "CheckpointLockedError", "CheckpointFallbackWarning", "FORMAT_VERSION"]

FORMAT_VERSION = 2  # 1: tensors named by position, no checksums (still loads)
_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool)}
_VERSION_RE = re.compile(r"v\d{6,}\Z")
_INT_RE = re.compile(r"-?\d+\Z")
_ROOT = "#root"  # the path of the tree itself (a tensor saved alone)
_CHUNK = 1 << 20


class CheckpointError(ValueError):
    """A checkpoint cannot be saved or read as asked; the message names the file or
    directory and what to do."""


class CheckpointMismatchError(CheckpointError):
    """The ranks called :func:`save` with different trees (paths, global shapes, dtypes,
    placements or nd-SBPs); raised on every rank, before anything is written."""


class CheckpointLockedError(CheckpointError):
    """Another process holds the save lock (``.lock``) of the checkpoint directory."""


class CheckpointFallbackWarning(UserWarning):
    """:func:`load` found the newest version damaged or missing and loaded an older one."""


# ---------------------------------------------------------------------- tree encoding
def _escape(s: str) -> str:
    return s.replace("%", "%25").replace("/", "%2F")


def _component(k) -> str:
    """One path component for dict key or list index ``k`` (see the module docstring)."""
    if isinstance(k, (int, np.integer)) and not isinstance(k, (bool, np.bool_)):
        return str(int(k))
    if isinstance(k, str) and k:
        s = _escape(k)
        if _INT_RE.match(s) or s.startswith("#") or s == "__metadata__":  # safetensors
            s = f"%{ord(s[0]):02X}" + s[1:]
        return s
    if k is None or isinstance(k, (str, bool, float, tuple, np.bool_, np.floating)):
        return "#" + _escape(repr(k.item() if isinstance(k, np.generic) else k))
    raise TypeError(f"sbpflow.save cannot store a dict key of type {type(k).__name__} "
                    f"({k!r}); keys may be strings, numbers, None or tuples of these")


def _key(path: tuple[str, ...]) -> str:
    return "/".join(path) if path else _ROOT


def _encode(obj, path: tuple[str, ...], leaves: dict, desc: dict) -> Any:
    """JSON-able form of ``obj`` with each tensor replaced by ``{"__tensor__": path}``.

    Fills ``leaves`` (path -> tensor) and ``desc`` (path -> what the ranks must agree on).
    """
    key = _key(path)
    if isinstance(obj, (Tensor, torch.Tensor)):
        t = obj if isinstance(obj, Tensor) else Tensor(obj.detach())
        leaves[key] = t
        desc[key] = _describe(t)
        return {"__tensor__": key}
    if isinstance(obj, dict):
        desc[key] = "dict"
        return {"__dict__": [[_encode(k, (), {}, {}), _encode(v, (*path, _component(k)),
                                                               leaves, desc)]
                             for k, v in obj.items()]}
    if isinstance(obj, (tuple, list)):
        desc[key] = type(obj).__name__
        items = [_encode(v, (*path, str(i)), leaves, desc) for i, v in enumerate(obj)]
        return {"__tuple__": items} if isinstance(obj, tuple) else items
    desc[key] = "value"
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, (np.integer, np.floating)):
        return obj.item()
    if isinstance(obj, torch.dtype):
        return {"__dtype__": str(obj).removeprefix("torch.")}
    raise TypeError(f"sbpflow.save cannot store a {type(obj).__name__} ({obj!r}) at "
                    f"{key!r}; state dicts may hold tensors, dicts, lists, tuples, numbers, "
                    f"strings and None")


def _describe(t: Tensor) -> dict:
    d = {"shape": list(t.shape), "dtype": _dtype_name(t.dtype)}
    if t.is_global:
        pl = t.placement
        d.update(placement=f"{pl.type}:{pl.ranks.tolist()}", sbp=format_nd_sbp(t.sbp))
    else:
        d["placement"] = "local"
    return d


def _decode(obj, leaves) -> Any:
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


def _stable_hash(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")


def _writers(pl: Placement, nd: Sequence[SBP], key: str) -> list[tuple[int, ...]]:
    """Mesh coordinates that write the tensor at path ``key``: every coordinate on split
    axes, one per broadcast axis (a stable hash of the key and axis, the same on every
    rank and in every run, so replicas share the writing)."""
    axes = [range(n) if s.is_split() else [_stable_hash(f"{axis}:{key}") % n]
            for axis, (s, n) in enumerate(zip(nd, pl.shape))]
    return [tuple(c) for c in itertools.product(*axes)]


def _ranges(slices) -> list[list[int]]:
    return [[s.start, s.stop] for s in slices]


def _shards(leaves: dict[str, Tensor], rank: int) -> tuple[dict, dict[str, torch.Tensor]]:
    """(records for meta.json, this rank's pieces by key), in sorted key order: the P ->
    split reduce-scatters run in that order on every rank."""
    records: dict[str, dict] = {}
    mine: dict[str, torch.Tensor] = {}
    for key in sorted(leaves):
        t = leaves[key]
        rec = {"shape": list(t.shape), "dtype": _dtype_name(t.dtype)}
        if t.is_local:
            if rank == 0:
                mine[key] = t._local.detach().cpu().contiguous()
            rec["pieces"] = [{"rank": 0, "key": key, "ranges": [[0, n] for n in t.shape]}]
            records[key] = rec
            continue
        pl = t.placement
        nd = _stored_layout(t)
        with torch.no_grad():
            src = t.detach() if nd == t.sbp else t.detach().to_global(pl, nd)
        pieces = []
        for coord in _writers(pl, nd, key):
            r = pl.rank_at(coord)
            sl = shard_slices(tuple(t.shape), pl.shape, nd, coord)
            pieces.append({"rank": r, "key": key, "ranges": _ranges(sl)})
            if r == rank:
                mine[key] = src._local.detach().cpu().contiguous()
        rec["pieces"] = pieces
        rec["saved_from"] = {"ranks": pl.rank_list, "mesh": list(pl.shape),
                             "sbp": format_nd_sbp(t.sbp)}
        records[key] = rec
    seen: set[int] = set()
    for key, v in mine.items():  # tied weights (one tensor under two names): own copies,
        if v.untyped_storage().data_ptr() in seen:  # as safetensors refuses shared memory
            mine[key] = v.clone()
        seen.add(v.untyped_storage().data_ptr())
    return records, mine


# ---------------------------------------------------------------------- agreement
def _gather_json(obj, ranks: tuple[int, ...]) -> list:
    """Every rank's ``obj`` (JSON-able), in rank order (one all_gather_bytes)."""
    data = json.dumps(obj, sort_keys=True).encode()
    return [json.loads(b) for b in all_gather_bytes(data, ranks)]


def _failure_text(e: BaseException | None) -> str | None:
    return None if e is None else f"{type(e).__name__}: {e}"


def _raise_failures(got: list[dict], own: BaseException | None, what: str) -> None:
    """Raise on every rank if any rank reported a failure: a rank re-raises its own,
    the others a CheckpointError naming the failed ranks."""
    if own is not None:
        raise own
    failed = [(r, g["error"]) for r, g in enumerate(got) if g.get("error")]
    if failed:
        lines = "\n".join(f"  rank {r}: {err}" for r, err in failed)
        cls = (CheckpointLockedError if any(err.startswith("CheckpointLockedError")
                                            for _, err in failed) else CheckpointError)
        raise cls(f"sbpflow.save: {what}, because of a failure on another rank:\n{lines}")


def _mismatch_message(path: str, descs: list[dict], limit: int = 12) -> str:
    world = len(descs)
    keys = sorted(set().union(*descs))
    lines = []
    for key in keys:
        groups: dict[str, list[int]] = {}
        for r, d in enumerate(descs):
            groups.setdefault(json.dumps(d.get(key), sort_keys=True), []).append(r)
        if len(groups) == 1:
            continue
        present = [r for r in range(world) if key in descs[r]]
        if len(present) < world:
            missing = [r for r in range(world) if key not in descs[r]]
            lines.append(f"  {key!r}: only on ranks {present} (missing on ranks {missing})")
            continue
        vals = [descs[r][key] for r in range(world)]
        fields = sorted({f for v in vals if isinstance(v, dict) for f in v
                         if len({json.dumps(w.get(f) if isinstance(w, dict) else w)
                                 for w in vals}) > 1}) or ["kind"]
        per = "; ".join(f"ranks {rs}: {_format_desc(json.loads(d))}"
                        for d, rs in groups.items())
        lines.append(f"  {key!r} differs in {', '.join(fields)}: {per}")
    more = f"\n  ... and {len(lines) - limit} more" if len(lines) > limit else ""
    return (f"sbpflow.save({path!r}): the ranks disagree on what to save, so nothing was "
            f"written ({len(lines)} differing paths):\n" + "\n".join(lines[:limit]) + more +
            "\nEvery rank must pass the same keys with the same global shapes, dtypes, "
            "placements and SBPs (key order may differ); check rank-dependent code that "
            "builds the state.")


def _format_desc(d) -> str:
    if not isinstance(d, dict):
        return str(d)
    s = f"shape {tuple(d['shape'])} {d['dtype']} {d['placement']}"
    return s + (f" sbp {d['sbp']}" if "sbp" in d else "")


# ---------------------------------------------------------------------- save
def save(obj, path: str | os.PathLike, *, keep: int = 1) -> None:
    """Save a state dict (or any tree of dicts/lists/tuples/numbers/strings/tensors).

    ``path`` a directory: the sharded, verified, atomic format of this module (see its
    docstring); collective: every rank of the world calls ``save`` with the same tree
    (the same paths, global shapes, dtypes, placements and nd-SBPs; dict order may
    differ between ranks). Any nd-SBP is accepted: S and B tensors are written as they
    are, P axes are reduce-scattered to a split first. Local and torch tensors, and
    non-tensor leaves, are written from rank 0.

    ``path`` ending in ``.safetensors`` or ``.pt``/``.pth``/``.bin``: one whole-tensor
    file for PyTorch (written by rank 0; global tensors are gathered first, so every rank
    calls it too). No checksum, no lock.

    Args:
        obj: the tree. Dict keys: strings, numbers, None, tuples. Tensor dtypes: float16/
            32/64, bfloat16, int8/16/32/64, uint8, bool.
        path: directory (created if missing) or file name.
        keep: complete versions to keep in the directory (>= 1).

    Raises:
        TypeError: a leaf or key that cannot be stored (names its path).
        CheckpointMismatchError: the ranks' trees differ (every rank raises, naming the
            paths and what each rank has; nothing written).
        CheckpointLockedError: another process is saving into ``path`` (names the
            directory and the lock holder).
        CheckpointError: a rank could not write its file, or rank 0 could not commit
            (every rank raises; ``LATEST`` still names the previous version).
        CollectiveError: a rank died or hung during the save (the previous checkpoint
            stays the one ``LATEST`` names).

    Cost: three :func:`sbpflow.distributed.all_gather_bytes` of under a kilobyte per
    rank (digest, file report, commit outcome; one more with the full descriptions if
    the trees differ); each P tensor one reduce-scatter; each rank writes, hashes
    (sha256, about 1 GiB/s) and fsyncs about its shard bytes, rank 0 fsyncs the index,
    ``LATEST`` and the directories (on this machine's disk, about 40 ms per save).
    """
    path = os.fspath(path)
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    if path.endswith((".safetensors", ".pt", ".pth", ".bin")):
        _save_whole(obj, path)
        return
    rank, world = get_rank(), get_world_size()
    ranks = tuple(range(world))
    if world > 1:
        ensure_groups([ranks])
    with contextlib.ExitStack() as stack:
        # 1. describe the tree; rank 0 locks the directory and picks the version number
        failure: BaseException | None = None
        tree, leaves, desc, version = None, {}, {}, 0
        try:
            tree = _encode(obj, (), leaves, desc)
            if rank == 0:
                stack.enter_context(_save_lock(path))
                version = _next_version(path)
        except Exception as e:  # reported to every rank below, so none waits for it
            failure = e
        digest = hashlib.sha256(json.dumps(sorted(desc.items())).encode()).hexdigest()
        got = _gather_json({"digest": digest, "error": _failure_text(failure),
                            "version": version}, ranks)
        _raise_failures(got, failure, f"nothing was written to {path!r}")
        if len({g["digest"] for g in got}) > 1:
            raise CheckpointMismatchError(_mismatch_message(path, _gather_json(desc, ranks)))
        name = f"v{got[0]['version']:06d}"
        tmp = os.path.join(path, f".tmp-{name}")

        # 2. every rank writes and hashes its file
        records, mine = _shards(leaves, rank)  # P tensors: collectives, sorted key order
        fname = f"rank-{rank:05d}.safetensors"
        info: dict[str, Any] = {"file": fname}
        failure = None
        try:
            os.makedirs(tmp, exist_ok=True)
            data = _safetensors_bytes(mine)
            _write_bytes(os.path.join(tmp, fname), data)
            info.update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
            del data
        except Exception as e:
            failure = e
        info["error"] = _failure_text(failure)
        files = _gather_json(info, ranks)
        _raise_failures(files, failure, f"nothing was committed to {path!r} (LATEST unchanged)")

        # 3. rank 0 writes the index and commits; everyone learns the outcome
        if rank == 0:
            try:
                meta = {"format": "sbpflow-checkpoint", "version": FORMAT_VERSION,
                        "world_size": world, "tree": tree, "tensors": records,
                        "files": {f["file"]: {"bytes": f["bytes"], "sha256": f["sha256"]}
                                  for f in files}}
                _commit(path, tmp, name, json.dumps(meta).encode(), keep)
            except Exception as e:
                failure = e
        done = _gather_json({"error": _failure_text(failure)}, ranks)
        _raise_failures(done, failure, f"rank 0 could not commit {name} in {path!r}")


def _dtype_name(dt: torch.dtype) -> str:
    name = str(dt).removeprefix("torch.")
    if name not in _DTYPES:
        raise TypeError(f"sbpflow.save: dtype {dt} is not supported; cast first")
    return name


@contextlib.contextmanager
def _save_lock(path: str):
    """Hold an exclusive, non-blocking ``flock`` on ``path/.lock`` (released on exit,
    also by the kernel when the process dies)."""
    os.makedirs(path, exist_ok=True)
    lock = os.path.join(path, ".lock")
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 256, 0).decode(errors="replace").strip() or "unknown"
            raise CheckpointLockedError(
                f"another save into {path!r} is in progress (its lock {lock} is held by "
                f"{holder}); two jobs must not save into one checkpoint directory: wait for "
                f"the other job, or give this one its own directory") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)


def _next_version(path: str) -> int:
    """Next version number; removes leftovers of crashed saves (we hold the lock)."""
    names = os.listdir(path)
    for d in names:
        if d.startswith(".tmp-"):
            shutil.rmtree(os.path.join(path, d), ignore_errors=True)
    return max((int(d[1:]) for d in names if _VERSION_RE.match(d)), default=0) + 1


def _commit(path: str, tmp: str, name: str, meta: bytes, keep: int) -> None:
    _write_bytes(os.path.join(tmp, "meta.json"), meta)
    _write_bytes(os.path.join(tmp, "meta.json.sha256"),
                 f"{hashlib.sha256(meta).hexdigest()}  meta.json\n".encode())
    _fsync_dir(tmp)
    os.replace(tmp, os.path.join(path, name))
    _fsync_dir(path)
    _write_bytes(os.path.join(path, ".LATEST.tmp"), (name + "\n").encode())
    os.replace(os.path.join(path, ".LATEST.tmp"), os.path.join(path, "LATEST"))
    _fsync_dir(path)
    versions = sorted(d for d in os.listdir(path) if _VERSION_RE.match(d))
    for old in versions[:-keep]:
        shutil.rmtree(os.path.join(path, old), ignore_errors=True)


def _write_bytes(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _save_whole(obj, path: str) -> None:
    tensors: dict = {}
    tree = _encode(obj, (), tensors, {})
    whole = {}
    for k in sorted(tensors):  # sorted: the gathers run in the same order on every rank
        t = tensors[k]
        t = torch.as_tensor(t.numpy()) if t.is_global else t._local.detach().cpu()
        whole[k] = t.detach().cpu().contiguous()
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
    Raises :class:`CheckpointError` naming the file if a file cannot be read (changed
    after :func:`load` verified it).
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
            try:
                with safe_open(fname, framework="pt") as f:
                    part = f.get_slice(piece["key"])[tuple(slice(lo - pa, hi - pa) for (lo, hi), (
                        pa, _) in zip(inter, rng))] if inter else f.get_tensor(piece["key"])
            except (SafetensorError, OSError) as e:
                raise CheckpointError(
                    f"{fname}: cannot read {piece['key']!r} ({type(e).__name__}: {e}); the "
                    f"file changed or was damaged after sbpflow.load verified it: load the "
                    f"checkpoint again") from e
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


def load(path: str | os.PathLike, *, fallback: bool = True):
    """Load what :func:`save` wrote, or a PyTorch/safetensors file.

    A checkpoint directory: the tree with :class:`StoredTensor` leaves (lazy; pass it to
    ``load_state_dict``, or call ``.to_global(placement, sbp)`` / ``.full()``). Not
    collective: each rank reads what it needs. Before returning, the version ``LATEST``
    names is verified (``meta.json`` against ``meta.json.sha256``, then the size and
    sha256 of every rank file it lists). If it is damaged or missing and ``fallback`` is
    true, a :class:`CheckpointFallbackWarning` names the damaged file and the version
    loaded instead: the newest intact version older than the one ``LATEST`` names (any
    intact version if ``LATEST`` itself is missing or damaged). Every rank verifies the
    same files and so picks the same version. Cost: each rank reads every file of the
    version it picks once (sha256: 1.1 GiB/s measured on one core, page cache warm). Versions
    in format 1 (no checksums) load with a warning that they cannot be verified.

    A ``.safetensors`` file: a dict of local sbpflow tensors. Any other file:
    ``torch.load(weights_only=True)`` (no arbitrary pickle), torch tensors wrapped as
    local sbpflow tensors.

    Raises:
        FileNotFoundError: no such path, or a directory with no version and no LATEST.
        CheckpointError: with ``fallback=False``, the newest version is damaged or
            missing (names the file); with fallback, no version is intact (names each
            version and what is wrong with it); a file that cannot be parsed (names it).
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        return _load_dir(path, fallback)
    if not os.path.exists(path):
        raise FileNotFoundError(f"no checkpoint at {path!r}")
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        try:
            return {k: Tensor(v) for k, v in load_file(path).items()}
        except SafetensorError as e:
            raise CheckpointError(f"{path}: not a readable safetensors file ({e}); it is "
                                  f"damaged or truncated: restore it from a copy") from e
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises RuntimeError, UnpicklingError, EOFError...
        raise CheckpointError(f"{path}: torch.load(weights_only=True) cannot read it "
                              f"({type(e).__name__}: {e}); the file is damaged, truncated "
                              f"or holds objects other than tensors and containers") from e
    return _wrap_torch(obj)


def _wrap_torch(obj):
    if isinstance(obj, torch.Tensor):
        return Tensor(obj)
    if isinstance(obj, dict):
        return type(obj)((k, _wrap_torch(v)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return type(obj)(_wrap_torch(v) for v in obj)
    return obj


class _Damaged(Exception):
    """A version fails verification: ``file`` and what is wrong with it."""

    def __init__(self, file: str, what: str):
        super().__init__(f"{file} {what}")


def _sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _verify(folder: str) -> dict:
    """The parsed ``meta.json`` of version ``folder`` once every check passed; raises
    :class:`_Damaged` naming the first file that fails."""
    if not os.path.isdir(folder):
        raise _Damaged(folder, "is missing")
    meta_path = os.path.join(folder, "meta.json")
    side = meta_path + ".sha256"
    try:
        with open(meta_path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise _Damaged(meta_path, "is missing") from None
    want = None
    if os.path.exists(side):
        with open(side, "rb") as f:
            want = (f.read().split() or [b""])[0].decode(errors="replace")
        got = hashlib.sha256(raw).hexdigest()
        if got != want:
            raise _Damaged(meta_path, f"does not match the sha256 in {side} (has {got[:16]}..., "
                                      f"expected {want[:16]}...)")
    try:
        meta = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _Damaged(meta_path, f"is not valid JSON ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != "sbpflow-checkpoint":
        raise _Damaged(meta_path, "is not an sbpflow checkpoint index")
    fmt = meta.get("version")
    if not isinstance(fmt, int) or fmt > FORMAT_VERSION:
        raise _Damaged(meta_path, f"has checkpoint format {fmt!r}, which this sbpflow "
                                  f"(format {FORMAT_VERSION}) cannot read: upgrade sbpflow")
    try:
        tensors = meta["tensors"]
        records = tensors.values() if isinstance(tensors, dict) else tensors
        needed = {f"rank-{p['rank']:05d}.safetensors" for r in records for p in r["pieces"]}
        listed = meta["files"] if fmt >= 2 else {}
    except (KeyError, TypeError, ValueError) as e:
        raise _Damaged(meta_path, f"has an unexpected structure ({type(e).__name__}: {e})"
                       ) from None
    if fmt >= 2:
        if want is None:
            raise _Damaged(side, "is missing (it holds meta.json's sha256)")
        unlisted = sorted(needed - set(listed))
        if unlisted:
            raise _Damaged(meta_path, f"does not list {unlisted[0]}, which its tensors need")
        for name, rec in sorted(listed.items()):
            fpath = os.path.join(folder, name)
            try:
                size = os.path.getsize(fpath)
            except OSError:
                raise _Damaged(fpath, "is missing") from None
            if size != rec["bytes"]:
                raise _Damaged(fpath, f"has {size} bytes, {rec['bytes']} were written "
                                      f"(truncated or overwritten)")
            if _sha256_file(fpath) != rec["sha256"]:
                raise _Damaged(fpath, "does not match its sha256 in meta.json (the data "
                                      "changed after it was written)")
    else:
        for name in sorted(needed):
            if not os.path.isfile(os.path.join(folder, name)):
                raise _Damaged(os.path.join(folder, name), "is missing")
    return meta


def _read_latest(path: str) -> tuple[str | None, str | None]:
    """(version LATEST names, or None; what is wrong with LATEST, or None)."""
    latest = os.path.join(path, "LATEST")
    try:
        with open(latest, "rb") as f:
            text = f.read().decode(errors="replace").strip()
    except FileNotFoundError:
        return None, f"{latest} is missing"
    if not _VERSION_RE.match(text):
        return None, f"{latest} is damaged (holds {text[:40]!r}, not a version name)"
    return text, None


def _load_dir(path: str, fallback: bool):
    named, problem = _read_latest(path)
    versions = sorted((d for d in os.listdir(path) if _VERSION_RE.match(d)),
                      key=lambda d: int(d[1:]), reverse=True)
    if named is None and not versions:
        raise FileNotFoundError(f"{path!r} holds no complete sbpflow checkpoint (no LATEST "
                                f"file; a save that crashed leaves only .tmp-* folders)")
    if named is not None:  # LATEST's version, then older ones (newer: never committed)
        candidates = [named] + [v for v in versions if int(v[1:]) < int(named[1:])]
    else:
        candidates = versions
    problems: list[tuple[str, str]] = []
    if problem is not None:
        problems.append(("LATEST", problem))
    for name in candidates:
        if problems and not fallback:
            raise CheckpointError(f"{problems[0][1]}; load({path!r}) with fallback=True "
                                  f"would try {name}")
        folder = os.path.join(path, name)
        try:
            meta = _verify(folder)
        except _Damaged as e:
            problems.append((name, str(e)))
            continue
        if problems:
            which = "older version" if named is not None else "version"
            warnings.warn(f"sbpflow.load({path!r}): {'; '.join(p for _, p in problems)}; "
                          f"loading the newest intact {which} {folder} instead "
                          f"(load(..., fallback=False) raises instead)",
                          CheckpointFallbackWarning, stacklevel=3)
        if meta["version"] < 2:
            warnings.warn(f"{folder} is in checkpoint format {meta['version']} (written by an "
                          f"older sbpflow): it has no checksums, so damage cannot be detected; "
                          f"save it again to get a verified checkpoint", stacklevel=3)
        tensors = meta["tensors"]
        if isinstance(tensors, dict):
            leaves: Any = {k: StoredTensor(folder, r) for k, r in tensors.items()}
        else:
            leaves = [StoredTensor(folder, r) for r in tensors]
        return _decode(meta["tree"], leaves)
    if not fallback:
        raise CheckpointError(f"{problems[0][1]}; no older version exists")
    lines = "\n".join(f"  {name}: {p}" for name, p in problems)
    raise CheckpointError(f"no intact checkpoint version in {path!r}:\n{lines}\nrestore the "
                          f"damaged files from a copy, or start without this checkpoint")
