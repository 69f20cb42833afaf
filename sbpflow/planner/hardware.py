"""Hardware profiles: what the cost model needs to know about a device and its links.

A profile is a JSON file in ``sbpflow/planner/hardware/`` (one per device kind: ``a100-80g``,
``h100``, ``h200``, ``v100``), for planning machines this one is not. Fields (SI units:
FLOP/s, bytes, bytes/s, seconds):

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
  ``sbpflow calibrate`` times a small model's step (:func:`sbpflow.planner.calibrate.
  _step_residual`) and keeps what :func:`sbpflow.planner.predict.predict_step` leaves
  unexplained (part of its ``host`` term). Default 0 (the named profiles: their
  ``call_seconds`` stand for the host);
* ``op_timing``: ``"roofline"`` (default: each op priced by the roofline) or
  ``"measured"`` (each op of a logical graph, forward and backward, and the optimizer's
  update timed on this machine on its shard's shapes: :class:`sbpflow.planner.predict.
  OpTimer`; for a profile of the machine that plans).

Add a device by adding a file with these fields.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field

__all__ = ["COLLECTIVES", "Hardware", "Link", "ProfileError", "load", "names"]

#: The collective kinds the cost model prices (:mod:`sbpflow.planner.cost`).
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast",
               "send_recv")

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
    rename); an existing file is kept unless ``replace``. Returns whether it wrote."""
    if os.path.exists(path) and not replace:
        return False
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)
    return True


def load(name_or_path: str) -> Hardware:
    """The profile ``name_or_path``: a name of :func:`names` (any case) or a JSON file's
    path.

    Raises:
        ProfileError: (a ValueError) an unknown name (lists the known ones), or a file
            that is not JSON, or misses a field, or has a value out of range (names it).
    """
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
    return hw


def _from_dict(data: dict) -> Hardware:
    if not isinstance(data["peak_flops"], dict) or not data["peak_flops"]:
        raise ValueError("peak_flops must map dtype names to FLOP/s")
    for k in ("intra_node", "inter_node"):
        if not isinstance(data[k], dict):
            raise ValueError(f"{k} must be an object with bandwidth and latency, got "
                             f"{data[k]!r}")
    checks = {"memory_bytes": data["memory_bytes"] > 0,
              "memory_bandwidth": data["memory_bandwidth"] > 0,
              "devices_per_node": int(data["devices_per_node"]) >= 1,
              **{k: 0 < float(data[k]) <= 1 for k in ("matmul_efficiency",
                                                      "memory_efficiency",
                                                      "link_efficiency")},
              **{f"peak_flops[{k}]": float(v) > 0 for k, v in data["peak_flops"].items()}}
    bad = [k for k, ok in checks.items() if not ok]
    if bad:
        raise ValueError(f"out of range: {', '.join(bad)} (sizes and rates > 0, "
                         f"devices_per_node >= 1, efficiencies in (0, 1])")
    links = {k: Link(float(data[k]["bandwidth"]), float(data[k]["latency"]))
             for k in ("intra_node", "inter_node")}
    kinds = data.get("collectives", {})
    if not isinstance(kinds, dict) or not all(
            k in COLLECTIVES and isinstance(v, dict) for k, v in kinds.items()):
        raise ValueError(f"collectives must map kinds of {COLLECTIVES} to objects with "
                         f"bandwidth and latency, got {kinds!r:.120}")
    seconds = {}
    for key, example in (("call_seconds", "18e-6"), ("step_seconds", "0.0008")):
        x = data.get(key, 0.0)
        seconds[key] = float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) \
            else math.nan
        if not 0 <= seconds[key] < math.inf:
            raise ValueError(f"{key} must be a finite number of seconds >= 0 (e.g. "
                             f"{example}), got {json.dumps(x)}")
    wait = data.get("collective_wait", [])

    def number(x) -> bool:  # a JSON number (not a string, not true/false)
        return isinstance(x, (int, float)) and not isinstance(x, bool)
    pairs = isinstance(wait, list) and all(
        isinstance(p, list) and len(p) == 2 and all(number(x) for x in p) for p in wait)
    curve = tuple(sorted((float(g), float(w)) for g, w in wait)) if pairs else \
        ((math.nan, math.nan),)
    if not all(0 < g < math.inf and 0 <= w < math.inf for g, w in curve):
        raise ValueError(f"collective_wait must be a list of [gap seconds > 0, wait seconds "
                         f">= 0] pairs (e.g. [[0.003, 0.0008]]), got {wait!r:.120}")
    timing = data.get("op_timing", "roofline")
    if timing not in ("roofline", "measured"):
        raise ValueError(f"op_timing must be 'roofline' or 'measured', got {timing!r}")
    known = {"name", "description", "peak_flops", "memory_bytes", "memory_bandwidth",
             "devices_per_node", "intra_node", "inter_node", "matmul_efficiency",
             "memory_efficiency", "link_efficiency", "sources", "collectives", "op_timing",
             "call_seconds", "collective_wait", "step_seconds"}
    return Hardware(
        name=data["name"], peak_flops={k: float(v) for k, v in data["peak_flops"].items()},
        memory_bytes=int(data["memory_bytes"]),
        memory_bandwidth=float(data["memory_bandwidth"]),
        devices_per_node=int(data["devices_per_node"]), **links,
        matmul_efficiency=float(data["matmul_efficiency"]),
        memory_efficiency=float(data["memory_efficiency"]),
        link_efficiency=float(data["link_efficiency"]),
        description=data.get("description", ""), sources=data.get("sources", ""),
        collectives={k: Link(float(v["bandwidth"]), float(v["latency"]))
                     for k, v in kinds.items()}, op_timing=timing,
        extra={k: v for k, v in data.items() if k not in known},
        call_seconds=seconds["call_seconds"], collective_wait=curve,
        step_seconds=seconds["step_seconds"])
