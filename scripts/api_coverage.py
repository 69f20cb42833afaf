"""How much of PyTorch's public API sbpflow answers to (issue 21's measure).

Diffs the installed torch against sbpflow, per namespace:

* ``Tensor (local)`` / ``Tensor (global)``: the public attributes of ``torch.Tensor`` that
  resolve (:func:`resolves`) on a local and on a global ``sbpflow.Tensor``;
* ``torch``: the public functions of ``torch`` found on ``sbpflow``;
* ``nn.functional``: those of ``torch.nn.functional`` on ``sbpflow.nn.functional``;
* ``nn`` modules: the ``torch.nn.Module`` subclasses of ``torch.nn`` on ``sbpflow.nn``;
* ``optim``: torch's optimizers on ``sbpflow.optim``; and whether
  ``sbpflow.optim.lr_scheduler`` imports.

"Applicable" leaves out what cannot make sense for sbpflow's tensors: sparse and
quantized layouts, other device types, storage internals, nested tensors, TorchScript
and compiler internals, backend-specific kernels (cudnn, miopen, mkldnn, fbgemm) and
their ``*_copy`` / ``native_*`` twins. :data:`EXCLUDED` lists each rule with its reason;
``--excluded`` prints every name it removes.

Usage::

    python3 scripts/api_coverage.py              # the table (markdown)
    python3 scripts/api_coverage.py --missing    # and the missing names per namespace
    python3 scripts/api_coverage.py --excluded   # the names left out, with the rule
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import re
import sys
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout, installed or not

import torch  # noqa: E402

#: (namespace, regex on the name, reason): names torch has that sbpflow leaves out.
EXCLUDED: list[tuple[str, str, str]] = [
    ("*", r"(^|_)(sparse|coalesce|coalesced|indices|crow|ccol|col_indices|row_indices|"
          r"to_dense|dense_dim|smm|sspaddmm|hspmm|spmm|dsmm|hsmm|saddmm)(_|$)|"
          r"^(values|_nnz|is_sparse_csr|resize_as_sparse_)$", "sparse layouts"),
    ("*", r"^(q_|int_repr|dequantize|qscheme|is_quantized|quantize|quantized_|"
          r"fake_quantize|fused_moving_avg_obs|choose_qparams|empty_quantized)",
     "quantized tensors"),
    ("*", r"^(is_)?(ipu|xpu|mtia|maia|mps|vulkan|xla|hpu|mkldnn|is_mkldnn|to_mkldnn|"
          r"is_vulkan_available|cudnn|miopen|fbgemm)(_|$)|^(cudnn|miopen|mkldnn|fbgemm)_",
     "another device type or a backend's kernel"),
    ("*", r"^(storage|untyped_storage|storage_type|storage_offset|data_ptr|"
          r"const_data_ptr|share_memory_|is_shared|set_|is_set_to|pin_memory|is_pinned|"
          r"record_stream|resize|resize_|resize_as|resize_as_|is_storage|from_file|"
          r"frombuffer|element_size_of_storage)$", "storage internals"),
    ("*", r"_copy$|^native_", "functionalization twins of view ops / native kernels"),
    ("*", r"^(is_nested|to_padded_tensor|nested_)", "nested tensors"),
    ("*", r"^(sym_|import_ir_module|parse_ir|parse_schema|parse_type_comment|"
          r"merge_type_from_type_comment|unify_type_list|fork|wait|compile|"
          r"compiled_with_cxx11_abi|cond|while_loop|vmap|classproperty|typename|"
          r"get_file_path|prepare_multiprocessing_environment|profiler_|"
          r"thread_safe_generator|module_load|map_|map2_|apply_|reinforce|volatile|"
          r"output_nr|is_inference|is_inference_mode_enabled|hash_tensor|"
          r"slice_inverse|segment_reduce)",
     "TorchScript, compiler and autograd-engine internals"),
    ("*", r"(^|_)autocast_|^(get|set)_autocast|^is_autocast|^clear_autocast",
     "autocast internals (sbpflow.autocast covers autocast)"),
    ("torch", r"^(set|get|is|are|use|init)_.*(deterministic|anomaly|warn_always|"
              r"flush_denormal|interop|printoptions|default_tensor_type|float32_matmul|"
              r"default_device|device_module|num_threads)|^(init_num_threads|"
              r"set_printoptions|set_default_tensor_type)$",
     "process-wide torch settings (call torch's own)"),
    ("torch", r"^(save|load|from_numpy|from_dlpack|to_dlpack|can_cast|promote_types|"
              r"result_type|is_tensor|is_storage|get_default_dtype|set_default_dtype|"
              r"set_rng_state|get_rng_state|seed|initial_seed|manual_seed|"
              r"broadcast_shapes|is_grad_enabled)$",
     "checked separately: sbpflow has its own (save/load, random state) or torch's "
     "answer is the same"),
    ("torch", r"^(batch_norm_(backward|elemt|gather|stats|update)|"
              r"conv_tbc|constant_pad_nd|convolution|affine_grid_generator|"
              r"grid_sampler_[23]d|embedding_renorm_|rnn_(relu|tanh)(_cell)?|"
              r"(gru|lstm)(_cell)?|channel_shuffle)",
     "aten entry points behind nn.functional (covered there)"),
    ("*", r"^(eig|symeig|lstsq|solve|matrix_rank)$",
     "removed from torch (deprecated in 1.9; torch raises and names torch.linalg's)"),
    ("Tensor", r"^index$", "first-class dimensions (functorch.dim), not a tensor op"),
    ("nn.functional", r"^(Optional|boolean_dispatch|assert_int_or_pair|"
                      r"handle_torch_function|has_torch_function.*)$",
     "helpers of torch's own implementation, not API"),
    ("nn.functional", r"^scaled_(grouped_)?mm$",
     "float8 GEMMs: scaled_mm takes float8 operands only (sbpflow's global tensors hold no "
     "float8 dtype; torch.float8_* boxing is unsupported), scaled_grouped_mm has no CPU "
     "kernel in torch 2.13 (CUDA only)"),
]

OPTIMIZERS = ("SGD", "Adam", "AdamW", "Adagrad", "Adadelta", "Adamax", "ASGD", "NAdam",
              "RAdam", "RMSprop", "Rprop", "LBFGS", "SparseAdam", "Adafactor")


def _excluded(space: str, name: str) -> str | None:
    for where, pattern, reason in EXCLUDED:
        if reason and where in ("*", space) and re.search(pattern, name):
            return reason
    return None


def _public(names) -> list[str]:
    return sorted(n for n in names if not n.startswith("_"))


def _functions(mod) -> list[str]:
    out = []
    for n in _public(dir(mod)):
        v = getattr(mod, n, None)
        if callable(v) and not inspect.isclass(v) and not isinstance(v, types.ModuleType):
            out.append(n)
    return out


def resolves(target, name: str) -> bool:
    """Whether ``target.name`` exists: an AttributeError says no; another exception (a
    property that refuses as torch's does: ``imag`` of a real tensor) says yes."""
    try:
        getattr(target, name)
    except AttributeError:
        return False
    except Exception:  # noqa: BLE001 - the attribute exists and raised on purpose
        return True
    return True


def namespaces() -> list[tuple[str, list[str], object]]:
    """(label, torch's names, the sbpflow object they are looked up on)."""
    import sbpflow
    import sbpflow.nn.functional

    local = sbpflow.tensor(torch.ones(2, 2))
    glob = sbpflow.tensor(torch.ones(2, 2), placement=sbpflow.placement.all("cpu"),
                          sbp=sbpflow.sbp.broadcast)
    tensor_names = _public(dir(torch.Tensor))
    modules = [n for n in _public(dir(torch.nn)) if inspect.isclass(getattr(torch.nn, n))
               and issubclass(getattr(torch.nn, n), torch.nn.Module)]
    return [
        ("Tensor (local)", tensor_names, local),
        ("Tensor (global)", tensor_names, glob),
        ("torch", _functions(torch), sbpflow),
        ("nn.functional", _functions(torch.nn.functional), sbpflow.nn.functional),
        ("nn modules", modules, sbpflow.nn),
        ("optim", list(OPTIMIZERS), sbpflow.optim),
    ]


def measure() -> list[dict]:
    """Per namespace: applicable names, the ones found, missing and excluded."""
    rows = []
    for label, names, target in namespaces():
        space = label.split()[0]
        excluded = {n: r for n in names if (r := _excluded(space, n))}
        applicable = [n for n in names if n not in excluded]
        found = [n for n in applicable if resolves(target, n)]
        rows.append(dict(label=label, applicable=applicable, found=found,
                         missing=[n for n in applicable if n not in found],
                         excluded=excluded))
    try:
        importlib.import_module("sbpflow.optim.lr_scheduler")
        sched = True
    except ImportError:
        sched = False
    rows.append(dict(label="optim.lr_scheduler importable", applicable=["lr_scheduler"],
                     found=["lr_scheduler"] if sched else [],
                     missing=[] if sched else ["lr_scheduler"], excluded={}))
    return rows


def table(rows) -> str:
    lines = [f"| namespace (torch {torch.__version__.split('+')[0]}) | applicable | "
             f"in sbpflow | coverage |", "|---|---:|---:|---:|"]
    for r in rows:
        n, k = len(r["applicable"]), len(r["found"])
        lines.append(f"| {r['label']} | {n} | {k} | {100 * k / max(n, 1):.0f}% |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--missing", action="store_true", help="list the missing names")
    ap.add_argument("--excluded", action="store_true", help="list the excluded names")
    args = ap.parse_args(argv)
    rows = measure()
    print(table(rows))
    for r in rows:
        if args.missing and r["missing"]:
            print(f"\nmissing from {r['label']} ({len(r['missing'])}):\n  "
                  + " ".join(r["missing"]))
        if args.excluded and r["excluded"]:
            by_reason: dict[str, list[str]] = {}
            for n, why in r["excluded"].items():
                by_reason.setdefault(why, []).append(n)
            print(f"\nexcluded from {r['label']}:")
            for why, names in by_reason.items():
                print(f"  {why}: {' '.join(names)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
