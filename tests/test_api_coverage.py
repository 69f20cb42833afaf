"""scripts/api_coverage.py (issue 21's measure of the PyTorch API sbpflow answers to):
it runs, each exclusion rule still removes something from the installed torch (a rule
that matches nothing is stale), and what it counts as found does resolve."""

from __future__ import annotations

import importlib.util
from pathlib import Path

_SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "api_coverage.py"


def _module():
    spec = importlib.util.spec_from_file_location("api_coverage", _SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_coverage_table_is_measured_against_the_installed_torch():
    cov = _module()
    rows = {r["label"]: r for r in cov.measure()}
    assert {"Tensor (local)", "Tensor (global)", "torch", "nn.functional", "nn modules",
            "optim"} <= set(rows)
    assert "| Tensor (local) |" in cov.table(list(rows.values()))
    for label, _, target in cov.namespaces():
        r = rows[label]
        assert r["found"] and all(cov.resolves(target, n) for n in r["found"]), label
        assert not any(cov.resolves(target, n) for n in r["missing"]), label
        assert set(r["found"]) | set(r["missing"]) == set(r["applicable"])
    used = {why for r in rows.values() for why in r["excluded"].values()}
    stale = [why for _, _, why in cov.EXCLUDED if why not in used]
    assert not stale, f"exclusion rules that match no name of this torch: {stale}"
