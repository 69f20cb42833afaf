"""The applications built on sbpflow, and what only they use.

* :mod:`.train`: ``sbpflow train``, the launcher of a training run of a :mod:`sbpflow.models`
  model on real data (its ranks run ``python -m sbpflow.apps.train``);
* :mod:`.bench`: ``sbpflow bench``, the timing harness (sbpflow against PyTorch in the same
  run), with its sweeps :mod:`.bench.dlrm` (``sbpflow bench dlrm``) and
  :mod:`.bench.partial_fc` (``sbpflow bench partial-fc``);
* their helpers: :mod:`.datasets` (the data they train on), :mod:`.metrics` (ROC AUC,
  log-loss), :mod:`._runlock` (one run per output folder).

This is the top layer (ARCHITECTURE "The layers", with the command line :mod:`sbpflow.cli`):
nothing below imports it. The apps alone need the packages of the ``apps`` extra
(:data:`EXTRA`): ``pip install 'sbpflow[apps]'``. Importing these modules imports none of
them (they are imported where used); each app's ``main`` calls :func:`require_extra` once
its arguments parse, so that a run without the extra stops before any work with one line
naming the install command.
"""

from __future__ import annotations

import importlib.util

__all__ = ["EXTRA", "require_extra"]

#: The ``apps`` extra of pyproject.toml: import name -> distribution name.
EXTRA = {"tqdm": "tqdm", "matplotlib": "matplotlib", "sklearn": "scikit-learn",
         "PIL": "Pillow"}


def require_extra(prog: str) -> None:
    """Check that every package of the ``apps`` extra can be imported (found, not imported).

    Args:
        prog: the command, for the message (e.g. ``"sbpflow train"``).

    Raises:
        SystemExit: exit code 1 with one line, e.g. ``sbpflow train: needs the apps extra
            (not installed: tqdm, Pillow): pip install 'sbpflow[apps]'``.
    """
    missing = [dist for mod, dist in EXTRA.items() if importlib.util.find_spec(mod) is None]
    if missing:
        raise SystemExit(f"{prog}: needs the apps extra (not installed: {', '.join(missing)}): "
                         f"pip install 'sbpflow[apps]'")
