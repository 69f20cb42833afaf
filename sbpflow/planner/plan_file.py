"""Plan files' form (``sbpflow plan --save``, ``AutoPlan.save``, ``--plan FILE``,
``config.set_auto_parallel_plan``): read and checked before any graph or rank sees them.
Whether a plan fits a graph is :func:`sbpflow.planner.auto.given`'s check."""

from __future__ import annotations

import math

__all__ = ["PIPELINE_SCHEDULES", "PLAN_KEYS", "pipeline_plan", "plan_argument_error",
           "pipeline_plan_file", "plan_mesh", "read_plan", "save_plan"]

#: The schedules a pipeline plan may name (``sbpflow train --schedule``'s); the
#: interleaved one with ``virtual_stages`` (model chunks per rank, >= 2).
PIPELINE_SCHEDULES = ("1f1b", "gpipe", "zero_bubble", "interleaved")


def _layout_entries(text: str) -> list[str]:
    """A plan's layout text split into its entries, one per mesh axis (``"[S(0), B]"``
    -> ``["S(0)", "B"]``; brackets optional)."""
    body = str(text).strip()
    if body[:1] in "[(" and body[-1:] in "])":
        body = body[1:-1]
    return [x.strip() for x in body.split(",") if x.strip()]


#: The keys of a plan file (:meth:`sbpflow.planner.auto.AutoPlan.to_dict`); ``mesh``,
#: ``zero_stage``, ``activation_checkpointing``, ``parameters`` and ``inputs`` are read,
#: the others describe the search that made it. A pipeline plan (``sbpflow plan``'s pp
#: rows) has ``pipeline`` (``{"stages", "micro_batches", "schedule"}``, and
#: ``"virtual_stages"`` with the interleaved schedule) and ``mesh`` (the
#: data-parallel ranks of each stage) instead of layouts. ``global_batch``: the samples a
#: step it was priced for (``sbpflow plan --save`` writes it; a run at another batch is
#: told, not refused).
PLAN_KEYS = {"graph", "mesh", "zero_stage", "activation_checkpointing", "hardware",
             "pipeline", "global_batch",
             "decisions", "parameters", "inputs",
             "predicted_step_s", "data_parallel_step_s", "predicted_memory_bytes",
             "search_s", "evaluated", "exact", "note"}


def plan_argument_error(value: str) -> str | None:
    """What is wrong with a command line's ``--plan VALUE`` before any rank starts (None:
    ``auto``, or a file of a plan's form; whether it fits the model is checked at the
    first step)."""
    import os

    if value == "auto":
        return None
    if not os.path.isfile(value):
        what = "a folder, not a plan file" if os.path.isdir(value) else \
            "not a regular file" if os.path.exists(value) else "no such file"
        return f"--plan {value!r}: {what}; give 'auto' or a plan.json (written by " \
               f"`sbpflow plan --save` or a `sbpflow train --plan auto` run)"
    try:
        read_plan(value)
    except ValueError as e:
        return f"--plan: {e}"
    return None


def read_plan(plan) -> dict:
    """A plan (a JSON file's path, or its dict) read and checked for form: a JSON object
    of :data:`PLAN_KEYS`, ``mesh`` a list of positive integers, ``zero_stage`` 0-3,
    ``parameters`` ``{name:
    layout}`` and ``inputs`` ``{index: layout}`` objects of strings, at least one entry
    between them. (Whether it fits a graph is :func:`sbpflow.planner.auto.given`'s check.)

    Raises:
        ValueError: naming the file, the entry and the fix.
    """
    from .hardware import read_json_object

    where = plan if isinstance(plan, str) else "a plan given as data"
    if isinstance(plan, str):
        plan = read_json_object(plan, f"auto-parallel plan {where}")
    if not isinstance(plan, dict):
        raise ValueError(f"auto-parallel plan {where}: expected a JSON object of "
                         f"{sorted(PLAN_KEYS)}, got {type(plan).__name__}")
    unknown = sorted(set(plan) - PLAN_KEYS)
    if unknown:
        raise ValueError(f"auto-parallel plan {where}: unknown key(s) {unknown}; a plan has "
                         f"{sorted(PLAN_KEYS)} (mesh, zero_stage, activation_checkpointing, "
                         f"parameters and inputs are read)")
    mesh = plan.get("mesh")
    if mesh is not None and not (isinstance(mesh, list) and mesh and all(
            isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in mesh)):
        raise ValueError(f"auto-parallel plan {where}: mesh must be a list of positive "
                         f"integers (e.g. [2] or [2, 2]), got {mesh!r}")
    zero = plan.get("zero_stage", 0)
    if not (isinstance(zero, int) and not isinstance(zero, bool) and 0 <= zero <= 3):
        raise ValueError(f"auto-parallel plan {where}: zero_stage must be 0 (off), 1, 2 or "
                         f"3, got {zero!r}")
    ckpt = plan.get("activation_checkpointing", [])
    if not (isinstance(ckpt, list) and all(isinstance(n, str) for n in ckpt)):
        raise ValueError(f"auto-parallel plan {where}: activation_checkpointing must be a "
                         f"list of module names (e.g. [\"model.transformer.h.0\"]), got "
                         f"{ckpt!r:.80}")
    for key in ("parameters", "inputs"):
        table = plan.get(key, {})
        if not isinstance(table, dict) or not all(isinstance(v, str) for v in table.values()):
            raise ValueError(f"auto-parallel plan {where}: {key} must be an object of "
                             f"{'name' if key == 'parameters' else 'input index'} -> layout "
                             f"strings (\"B\", \"S(0)\", \"[S(0), B]\"), got {table!r:.80}")
    if mesh is not None:  # one entry per mesh axis (each layout's form: given()'s check)
        for key in ("parameters", "inputs"):
            for name, text in plan.get(key, {}).items():
                n = len(_layout_entries(text))
                if n != len(mesh):
                    raise ValueError(f"auto-parallel plan {where}: {key} {name!r}: layout "
                                     f"{text!r} has {n} entr{'y' if n == 1 else 'ies'} but "
                                     f"the mesh {mesh} has {len(mesh)} axes; give one per "
                                     f"axis (or, if the mesh is what is wrong, the mesh "
                                     f"the plan was made for)")
    if "pipeline" in plan:
        _check_pipeline(plan, where)
        return plan
    if not plan.get("parameters") and not plan.get("inputs"):
        raise ValueError(f"auto-parallel plan {where}: it names no parameter and no input "
                         f"(its 'parameters' and 'inputs' are what runs; 'decisions' only "
                         f"describes them)")
    return plan


def _check_pipeline(plan: dict, where: str) -> None:
    """A pipeline plan's own checks (see :data:`PLAN_KEYS`)."""
    pipe = plan["pipeline"]
    form = ('"pipeline": {"stages": P >= 2, "micro_batches": M >= 1, "schedule": one of '
            f'{list(PIPELINE_SCHEDULES)}}} (interleaved: and "virtual_stages": V >= 2)')
    keys = {"stages", "micro_batches", "schedule"}
    if isinstance(pipe, dict) and pipe.get("schedule") == "interleaved":
        keys = keys | {"virtual_stages"}
    elif isinstance(pipe, dict) and "virtual_stages" in pipe:
        raise ValueError(f"auto-parallel plan {where}: pipeline virtual_stages (model chunks "
                         f"a rank) is for the interleaved schedule only, not "
                         f"{pipe.get('schedule')!r}: drop it, or set \"schedule\": "
                         f"\"interleaved\"")
    if not isinstance(pipe, dict) or set(pipe) != keys:
        odd = "" if not isinstance(pipe, dict) else \
            "".join(f"; {w} {sorted(k)}" for w, k in (("unknown", set(pipe) - keys),
                                                       ("missing", keys - set(pipe))) if k)
        raise ValueError(f"auto-parallel plan {where}: pipeline must be {form}{odd}, got "
                         f"{pipe!r:.80}")
    for key, least in (("stages", 2), ("micro_batches", 1), ("virtual_stages", 2)):
        if key not in pipe:
            continue
        v = pipe[key]
        if not (isinstance(v, int) and not isinstance(v, bool) and v >= least):
            raise ValueError(f"auto-parallel plan {where}: pipeline {key} must be an integer "
                             f">= {least}, got {v!r}")
    if pipe["schedule"] not in PIPELINE_SCHEDULES:
        raise ValueError(f"auto-parallel plan {where}: pipeline schedule "
                         f"{pipe['schedule']!r} is not one of {list(PIPELINE_SCHEDULES)}")
    if pipe["schedule"] == "interleaved" and pipe["micro_batches"] % pipe["stages"]:
        raise ValueError(f"auto-parallel plan {where}: the interleaved schedule takes "
                         f"micro-batches in groups of the stages: micro_batches "
                         f"{pipe['micro_batches']} is not a multiple of stages "
                         f"{pipe['stages']}")
    mesh = plan.get("mesh") or [1]
    if len(mesh) != 1:
        raise ValueError(f"auto-parallel plan {where}: a pipeline plan's mesh is the "
                         f"data-parallel ranks of each stage, one axis (e.g. [2]), got {mesh}")
    extra = [k for k in ("parameters", "inputs", "activation_checkpointing") if plan.get(k)]
    if extra or plan.get("zero_stage"):
        raise ValueError(f"auto-parallel plan {where}: a pipeline plan runs each stage data "
                         f"parallel with the model's split; it takes no "
                         f"{', '.join(extra) or 'zero_stage'} (drop them, or the pipeline)")


def pipeline_plan(plan, world: int) -> dict | None:
    """A pipeline plan's run (a file's path or its dict): ``{"stages", "dp",
    "micro_batches", "schedule", "virtual_stages"}`` for ``world`` ranks (``stages x dp``
    = ``world``; ``virtual_stages`` 1 but with the interleaved schedule); None for a
    plan of layouts.

    Raises:
        ValueError: not a plan (:func:`read_plan`), or ranks that do not make ``world``
            (names both and the fix).
    """
    where = plan if isinstance(plan, str) else "a plan given as data"
    plan = read_plan(plan)
    if "pipeline" not in plan:
        return None
    pipe, dp = plan["pipeline"], (plan.get("mesh") or [1])[0]
    if pipe["stages"] * dp != world:
        raise ValueError(f"auto-parallel plan {where}: its pipeline of {pipe['stages']} "
                         f"stages x {dp} data-parallel ranks (its stages and mesh) holds "
                         f"{pipe['stages'] * dp} ranks; this run has {world}: run it on "
                         f"{pipe['stages'] * dp} ranks (--nproc-per-node "
                         f"{pipe['stages'] * dp}), or plan again for {world} (sbpflow plan "
                         f"MODEL --nproc-per-node {world} --save FILE)")
    return {"stages": pipe["stages"], "dp": dp, "micro_batches": pipe["micro_batches"],
            "schedule": pipe["schedule"], "virtual_stages": pipe.get("virtual_stages", 1)}


def plan_mesh(plan, world: int) -> tuple[int, int]:
    """The ``(rows, columns)`` mesh a plan (a file's path or its dict) runs on, for
    ``world`` ranks: ``[n]`` is one row, ``[a, b]`` is ``a`` rows of ``b``.

    Raises:
        ValueError: not a plan (:func:`read_plan`), a mesh of more than two axes, or one
            whose ranks are not ``world`` (names both and the fix).
    """
    where = plan if isinstance(plan, str) else "a plan given as data"
    mesh = read_plan(plan).get("mesh") or [world]
    if len(mesh) > 2 or math.prod(mesh) != world:
        what = "has more than two axes" if len(mesh) > 2 else f"holds {math.prod(mesh)} ranks"
        raise ValueError(f"auto-parallel plan {where}: its mesh {mesh} {what}; this run has "
                         f"{world}: plan again for {world} ranks (sbpflow plan MODEL "
                         f"--nproc-per-node {world} --save FILE)")
    return (mesh[0], 1) if len(mesh) == 1 else (mesh[0], mesh[1])


def save_plan(path: str, data: dict, overwrite: bool = False) -> str:
    """Write a plan's dict as JSON to ``path`` (atomically). Returns ``path``.

    Raises:
        FileExistsError: ``path`` exists and not ``overwrite`` (a plan is never replaced
            silently).
    """
    from .hardware import write_json_object

    if not write_json_object(path, data, overwrite):
        raise FileExistsError(f"{path} exists; give overwrite=True to replace it, or "
                              f"another path")
    return path


def pipeline_plan_file(value: str | None) -> dict | None:
    """A command line's ``--plan VALUE`` read as a pipeline plan (its dict), or None: no
    ``--plan``, ``auto``, a plan of layouts, or a file that is not a plan (the other
    ``--plan`` checks, :func:`plan_argument_error`, report that)."""
    import os

    if value in (None, "auto") or not os.path.isfile(value):
        return None
    try:
        plan = read_plan(value)
    except ValueError:
        return None
    return plan if "pipeline" in plan else None
