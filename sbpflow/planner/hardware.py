"""Hardware profiles: what the cost model needs to know about a device and its links.

A profile is a JSON file in ``sbpflow/planner/hardware/`` (one per device kind: ``a100-80g``,
``h100``, ``h200``, ``v100``), for planning machines this one is not. Fields (SI units:
FLOP/s, bytes, bytes/s, seconds; every value a JSON number, not a string or true/false,
and finite; ``memory_bytes`` and ``devices_per_node`` whole numbers):

* ``peak_flops``: dense peak per device, by dtype name (``"bfloat16"``, ``"float32"``...);
* ``memory_bytes``, ``memory_bandwidth``: device memory and its bandwidth;
* ``devices_per_node``; ``intra_node`` / ``inter_node``: a link's ``bandwidth`` per device
  and direction (NVLink through NVSwitch inside a node; the device's share of the node's
  network adapters between nodes) and a collective step's ``latency``;
* ``matmul_efficiency``, ``memory_efficiency``, ``link_efficiency``: the fractions of the
  peaks that large matrix multiplies, streaming kernels and collectives reach in practice
  (assumed for a named profile; ``sbpflow calibrate`` measures them for this machine);
* ``sources``: where the numbers come from.

Optional fields, written by ``sbpflow calibrate`` (a profile of the machine it runs on):

* ``collectives``: ``{kind: {"bandwidth", "latency"}}``, a link fitted per collective kind
  (``all_reduce``, ``all_gather``, ``reduce_scatter``, ``all_to_all``, ``broadcast``)
  inside a node; it replaces ``intra_node`` for that kind (a library's kinds differ:
  gloo's all-gather of 16 MiB takes five times its all-reduce's time);
* ``call_seconds``: host seconds per call of a compiled program (its Python and the
  kernel's launch), for a device that runs asynchronously (a GPU): the host's calls and the
  device's work overlap, and a step whose calls take longer than its kernels waits for the
  host (:func:`sbpflow.planner.predict.predict_step`'s ``host`` term). Default 0 (not
  priced); on a profile of this machine's CPU the timed ops already include it;
* ``collective_wait``: ``[[gap, wait], ...]`` (seconds): what a collective costs beyond
  its back-to-back time when the ranks computed ``gap`` seconds since the last one: they
  drift apart while they compute (the OS, the other ranks' processes, the collective
  library's threads), and each collective waits for the last rank. Measured by
  ``sbpflow calibrate`` (a small all-reduce between blocks of compute of a few lengths);
  read as a piecewise-linear curve through ``(0, 0)``, flat past the last point
  (:meth:`Hardware.wait`). Default none (no wait priced: the named profiles);
* ``step_seconds``: seconds a compiled step takes here beyond everything else the model
  prices (its check that every rank runs it, its Python, its first wait), once a step:
  ``sbpflow calibrate`` times a small model's steps (:func:`sbpflow.planner.calibrate.
  _step_terms`) and fits what :func:`sbpflow.planner.predict.predict_step` leaves
  unexplained, with the all-reduce's and the all-gather/reduce-scatter's latencies in
  ``collectives`` (part of its ``host`` term). Default 0 (the named profiles: their
  ``call_seconds`` stand for the host);
* ``op_timing``: ``"roofline"`` (default: each op priced by the roofline) or
  ``"measured"`` (each op of a logical graph, forward and backward, and the optimizer's
  update timed on this machine on its shard's shapes: :class:`sbpflow.planner.predict.
  OpTimer`; for a profile of the machine that plans). A ``"measured"`` profile is a
  calibration: it must have ``step_seconds`` and, of 2 or more ranks, a non-empty
  ``collective_wait`` and a ``collectives`` entry for each kind of :data:`CALIBRATED`
  (one lacking them would price no step, no wait, or a kind on another's link).

Add a device by adding a file with these fields.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field

__all__ = ["CALIBRATED", "COLLECTIVES", "Hardware", "Link", "ProfileError", "load", "names",
           "unwritable"]

#: The collective kinds the cost model prices (:mod:`sbpflow.planner.cost`).
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast",
               "send_recv")

#: The kinds ``sbpflow calibrate`` measures: a profile it wrote (``op_timing``
#: ``"measured"``) of 2 or more ranks has a ``collectives`` entry for each.
CALIBRATED = COLLECTIVES[:5]

_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hardware")


@dataclass(frozen=True)
class Link:
    """One kind of link: ``bandwidth`` in bytes/s per device and direction (> 0),
    ``latency`` in seconds per collective step (>= 0).

    Raises:
        ValueError: a bandwidth <= 0 or a negative latency.
    """

    bandwidth: float
    latency: float

    def __post_init__(self):
        if not self.bandwidth > 0 or not self.latency >= 0:
            raise ValueError(f"a link needs bandwidth > 0 bytes/s and latency >= 0 s; got "
                             f"bandwidth={self.bandwidth}, latency={self.latency}")


@dataclass(frozen=True)
class Hardware:
    """A device kind and the links between devices (see the module doc for the fields)."""

    name: str
    peak_flops: dict
    memory_bytes: int
    memory_bandwidth: float
    devices_per_node: int
    intra_node: Link
    inter_node: Link
    matmul_efficiency: float
    memory_efficiency: float
    link_efficiency: float
    description: str = ""
    sources: str = ""
    collectives: dict = field(default_factory=dict)  # kind -> Link, inside a node
    op_timing: str = "roofline"
    extra: dict = field(default_factory=dict)
    call_seconds: float = 0.0
    collective_wait: tuple = ()
    step_seconds: float = 0.0  # ((gap s, wait s), ...), gaps increasing

    def wait(self, gap: float) -> float:
        """Seconds a collective waits for the other ranks after ``gap`` seconds of compute
        since the last one: ``collective_wait`` interpolated linearly through ``(0, 0)``,
        flat past its last point, never less than after a shorter gap; 0 without a
        curve."""
        pts, top = [(0.0, 0.0)], 0.0
        for g, w in self.collective_wait:  # never less after a longer gap (a dip: noise)
            top = max(top, w)
            pts.append((g, top))
        if len(pts) == 1 or gap <= 0:
            return 0.0
        for (g0, w0), (g1, w1) in zip(pts, pts[1:]):
            if gap <= g1:
                return w0 + (w1 - w0) * (gap - g0) / (g1 - g0) if g1 > g0 else w1
        return pts[-1][1]

    @property
    def default_dtype(self) -> str:
        """The dtype a plan assumes when none is given: ``bfloat16``, else ``float16``,
        else the first the profile lists."""
        for d in ("bfloat16", "float16"):
            if d in self.peak_flops:
                return d
        return next(iter(self.peak_flops))

    def flops(self, dtype: str = "bfloat16") -> float:
        """Achieved matrix-multiply FLOP/s in ``dtype``: the peak times
        ``matmul_efficiency``.

        Raises:
            KeyError: a dtype the profile does not list (names the ones it does).
        """
        if dtype not in self.peak_flops:
            raise KeyError(f"hardware {self.name!r} lists no peak for {dtype!r}; it has "
                           f"{sorted(self.peak_flops)}")
        return self.peak_flops[dtype] * self.matmul_efficiency

    def bandwidth(self) -> float:
        """Achieved device-memory bandwidth, bytes/s."""
        return self.memory_bandwidth * self.memory_efficiency

    def link(self, inter_node: bool, kind: str | None = None) -> Link:
        """The link between two devices of one node (``inter_node=False``) or of two
        nodes, at its achieved bandwidth; inside a node, collective ``kind``'s own fit
        where the profile has one (``collectives``)."""
        raw = self.inter_node if inter_node else self.collectives.get(kind, self.intra_node)
        return Link(raw.bandwidth * self.link_efficiency, raw.latency)


class ProfileError(ValueError):
    """A hardware profile that cannot be used (:func:`load`): unknown, unreadable, or a
    field missing or out of range; the message names the file and the field."""


def names() -> list[str]:
    """The named profiles shipped with sbpflow."""
    return sorted(f[:-5] for f in os.listdir(_DIR) if f.endswith(".json"))


def read_json_object(path: str, what: str) -> dict:
    """The JSON object in file ``path`` (a profile, a plan).

    Raises:
        ValueError: ``"{what}: ..."``: not a readable JSON file, or not an object.
    """
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{what}: not a readable JSON file ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{what}: expected a JSON object, got {type(data).__name__}")
    return data


def write_json_object(path: str, data: dict, replace: bool) -> bool:
    """Write ``data`` to ``path`` as indented JSON, atomically (a file beside it, then a
    rename); an existing file is kept unless ``replace``. Returns whether it wrote.

    Raises:
        OSError: the file beside it or the rename failed (the file beside it removed).
        TypeError: ``data`` holds a value JSON cannot write (likewise).
    """
    if os.path.exists(path) and not replace:
        return False
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w") as f:
            json.dump(data, f, indent=1)
        os.replace(tmp, path)
    except BaseException:  # (an interrupt too) no half-written file left beside it
        try:
            os.remove(tmp)
        except OSError:
            pass  # never made
        raise
    return True


def unwritable(path: str, make: bool = True) -> str:
    """Why a file cannot be written at ``path``, or ``""`` when it can: ``path`` a
    folder, or ending in a slash; something there that is not a regular file (a link, a
    device, a pipe: a writer would replace it); a part of its folder's path a file; its
    folder not there and ``make`` false (else it is made, as a writer would, or cannot
    be); or no file can be made in it (one is tried and removed). For commands that
    write a result after minutes of work: asked first."""
    import tempfile

    if os.path.isdir(path):
        return "it is a folder"
    if path.endswith(("/", os.sep)):
        return "it names a folder (it ends in a slash); give a file name"
    if os.path.lexists(path) and (os.path.islink(path) or not os.path.isfile(path)):
        return "it is not a regular file (a link, a device or a pipe): nothing replaces it"
    folder = os.path.dirname(os.path.abspath(path))
    part = folder
    while part and not os.path.exists(part):
        part = os.path.dirname(part)
    if part and not os.path.isdir(part):
        return f"{part} is a file, not a folder"
    if not make and part != folder:
        return f"no folder {folder}; create it first"
    try:
        os.makedirs(folder, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".sbpflow-", suffix=".tmp", dir=folder)
        os.close(fd)
        os.remove(probe)
    except OSError as e:
        return f"no file can be written in {folder}: {e.strerror or e}"
    return ""


def load(name_or_path: str, require: tuple[str, ...] = ()) -> Hardware:
    """The profile ``name_or_path``: a name of :func:`names` (any case) or a JSON file's
    path; ``require``: optional fields it must have all the same (a calibration of this
    machine's: :func:`sbpflow.planner.calibrate.load_cached`).

    Raises:
        ProfileError: (a ValueError) an unknown name (lists the known ones), or a file
            that is not JSON, or misses a field (of ``require`` too), or has a value out
            of range (names it).
    """
    if os.path.isdir(name_or_path):
        raise ProfileError(f"hardware profile {name_or_path}: a folder, not a JSON file")
    named = os.path.join(_DIR, f"{name_or_path.lower()}.json")
    path = name_or_path if os.path.isfile(name_or_path) else named
    if not os.path.isfile(path):
        raise ProfileError(f"no hardware profile {name_or_path!r}; known: {names()} (or give "
                           f"the path of a JSON file with the fields of "
                           f"sbpflow.planner.hardware)")
    try:
        data = read_json_object(path, f"hardware profile {path}")
    except ValueError as e:
        raise ProfileError(str(e)) from None
    try:
        hw = _from_dict(data)
    except KeyError as e:
        raise ProfileError(f"hardware profile {path}: field {e.args[0]!r} missing") from e
    except (TypeError, ValueError, AttributeError) as e:
        raise ProfileError(f"hardware profile {path}: {e}") from e
    missing = [k for k in require if k not in data]
    if missing:
        raise ProfileError(f"hardware profile {path}: field {missing[0]!r} missing")
    return hw


def _number(x, field: str, unit: str = "", *, gt: float | None = None,
            ge: float | None = None, le: float | None = None, integer: bool = False,
            example: str = ""):
    """``x``, the value of profile field ``field`` (in ``unit``), checked: a JSON number
    (an int or a float; not true/false, not a string), finite, ``> gt``, ``>= ge`` and
    ``<= le`` where given, and whole if ``integer`` (8.0 is 8, 8.5 is refused).
    Returns it as an int if ``integer``, else as a float.

    Raises:
        ValueError: ``"{field} must be {the rule}, got {x as JSON}"``.
    """
    try:
        ok = isinstance(x, (int, float)) and not isinstance(x, bool) and \
            math.isfinite(x) and (gt is None or x > gt) and (ge is None or x >= ge) and \
            (le is None or x <= le) and (not integer or float(x).is_integer())
    except OverflowError:  # an integer too large for a float
        ok = False
    if ok:
        return int(x) if integer else float(x)
    if gt is not None and le is not None:
        bounds = f"in ({gt:g}, {le:g}]"
    else:
        bounds = " and ".join(f"{op} {b:g}" for op, b in ((">", gt), (">=", ge), ("<=", le))
                              if b is not None)
    rule = f"{'a whole' if integer else 'a finite'} number{' of ' + unit if unit else ''}"
    eg = f" (e.g. {example})" if example else ""
    raise ValueError(f"{field} must be {rule} {bounds}{eg}, got "
                     f"{json.dumps(x, default=repr)[:120]}")


def _link(data, field: str) -> Link:
    """The link in profile field ``field``: an object with ``bandwidth`` (bytes/s > 0) and
    ``latency`` (seconds >= 0).

    Raises:
        KeyError: ``"{field}.bandwidth"`` or ``"{field}.latency"`` missing.
        ValueError: not an object, or a value out of range (names it).
    """
    if not isinstance(data, dict):
        raise ValueError(f"{field} must be an object with bandwidth and latency, got "
                         f"{json.dumps(data, default=repr)[:120]}")
    for k in ("bandwidth", "latency"):
        if k not in data:
            raise KeyError(f"{field}.{k}")
    return Link(_number(data["bandwidth"], f"{field}.bandwidth", "bytes/s", gt=0,
                        example="3e11"),
                _number(data["latency"], f"{field}.latency", "seconds", ge=0,
                        example="5e-6"))


def _from_dict(data: dict) -> Hardware:
    """The :class:`Hardware` of a profile's JSON object (see the module doc for the
    fields): every number checked by :func:`_number`.

    Raises:
        KeyError: a required field missing (its name, dotted for a link's).
        ValueError: a field of the wrong type or out of range (names it, its value as
            JSON, and the range).
    """
    peaks = data["peak_flops"]
    if not isinstance(peaks, dict) or not peaks:
        raise ValueError(f"peak_flops must map dtype names to FLOP/s (e.g. "
                         f'{{"float32": 6.7e13}}), got {json.dumps(peaks, default=repr)[:120]}')
    peak_flops = {k: _number(v, f"peak_flops.{k}", "FLOP/s", gt=0, example="3.1e14")
                  for k, v in peaks.items()}
    efficiencies = {k: _number(data[k], k, gt=0, le=1, example="0.7")
                    for k in ("matmul_efficiency", "memory_efficiency", "link_efficiency")}
    kinds = data.get("collectives", {})
    if not isinstance(kinds, dict) or not all(k in COLLECTIVES for k in kinds):
        raise ValueError(f"collectives must map kinds of {COLLECTIVES} to objects with "
                         f"bandwidth and latency, got {json.dumps(kinds, default=repr)[:120]}")
    seconds = {key: _number(data.get(key, 0.0), key, "seconds", ge=0, example=example)
               for key, example in (("call_seconds", "18e-6"), ("step_seconds", "0.0008"))}
    wait = data.get("collective_wait", [])
    if not isinstance(wait, list) or not all(isinstance(p, list) and len(p) == 2
                                             for p in wait):
        raise ValueError(f"collective_wait must be a list of [gap seconds > 0, wait seconds "
                         f">= 0] pairs (e.g. [[0.003, 0.0008]]), got "
                         f"{json.dumps(wait, default=repr)[:120]}")
    curve = tuple(sorted((_number(g, f"collective_wait[{i}][0]", "seconds", gt=0,
                                  example="0.003"),
                          _number(w, f"collective_wait[{i}][1]", "seconds", ge=0,
                                  example="0.0008"))
                         for i, (g, w) in enumerate(wait)))
    timing = data.get("op_timing", "roofline")
    if timing not in ("roofline", "measured"):
        raise ValueError(f"op_timing must be 'roofline' or 'measured', got {timing!r}")
    if timing == "measured":  # a machine's calibration: what sbpflow calibrate measures
        several = data["devices_per_node"] != 1
        for key in ("step_seconds",) + (("collective_wait",) + tuple(
                f"collectives.{k}" for k in CALIBRATED) if several else ()):
            head, _, kind = key.partition(".")
            if head not in data or (kind and kind not in data[head]):
                raise KeyError(key)
        if several and not wait:
            raise ValueError("collective_wait is empty: a calibration of 2 or more ranks "
                             "measures the wait after three gaps of compute (sbpflow "
                             "calibrate)")
    if not isinstance(data["name"], str):
        raise ValueError(f"name must be a string, got {json.dumps(data['name'], default=repr)}")
    known = {"name", "description", "peak_flops", "memory_bytes", "memory_bandwidth",
             "devices_per_node", "intra_node", "inter_node", "matmul_efficiency",
             "memory_efficiency", "link_efficiency", "sources", "collectives", "op_timing",
             "call_seconds", "collective_wait", "step_seconds"}
    return Hardware(
        name=data["name"], peak_flops=peak_flops,
        memory_bytes=_number(data["memory_bytes"], "memory_bytes", "bytes", gt=0,
                             integer=True, example="85899345920"),
        memory_bandwidth=_number(data["memory_bandwidth"], "memory_bandwidth", "bytes/s",
                                 gt=0, example="2e12"),
        devices_per_node=_number(data["devices_per_node"], "devices_per_node", "devices",
                                 ge=1, integer=True, example="8"),
        intra_node=_link(data["intra_node"], "intra_node"),
        inter_node=_link(data["inter_node"], "inter_node"),
        **efficiencies,
        description=data.get("description", ""), sources=data.get("sources", ""),
        collectives={k: _link(v, f"collectives.{k}") for k, v in kinds.items()},
        op_timing=timing, extra={k: v for k, v in data.items() if k not in known},
        call_seconds=seconds["call_seconds"], collective_wait=curve,
        step_seconds=seconds["step_seconds"])
