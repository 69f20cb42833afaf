"""sbpflow.graph: ``nn.Graph``, a step compiled once per input signature and run as each
rank's ``torch.fx`` program (ARCHITECTURE "Graph mode").

Layer: above ``nn/``, ``optim/`` and ``amp`` (a graph holds modules and optimizers);
installed as ``sbpflow.nn.Graph`` and ``sbpflow.nn.graph`` (with ``GraphModule``) by
``sbpflow/__init__.py``. Modules: :mod:`.graph` (the class), :mod:`.trace` (tracing into a
per-rank program), :mod:`.passes` (the passes, in order), :mod:`.config` (``graph.config``,
``GraphModule``), :mod:`.show` (``print(graph)``).
"""

from .config import GraphConfig, GraphModule
from .graph import Graph
from .trace import GraphError, GraphTraceError

__all__ = ["Graph", "GraphConfig", "GraphError", "GraphModule", "GraphTraceError"]
