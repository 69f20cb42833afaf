"""The model registry: :class:`ModelSpec` (a named model configuration) and the table of
registered specs. Its own module so that the model files can import it without importing
the package's ``__init__``, which imports them (no cycle).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

__all__ = ["CPU_BATCH", "ModelSpec", "MODELS", "get", "register", "names", "default_batch",
           "layout_placement", "per_rank_batch_norm", "synthetic_batch", "task_loss"]


@dataclass(frozen=True)
class ModelSpec:
    """A named model configuration.

    Attributes:
        name: e.g. ``"gpt-mini"``. family: ``"gpt"``, ``"bert"``, ``"resnet"``.
        task: ``"lm"``, ``"mlm"``, ``"image"``, ``"ctr"`` or ``"face"`` (see
            :mod:`sbpflow.models`).
        config: the family's config dataclass instance.
        builder: ``builder(config) -> Module``.
        plans: ``layout -> {pattern: ParallelStyle}`` for ``"dp"`` (optional: modules kept
            sharded in a data-parallel layout, e.g. embedding tables; default none),
            ``"tp"`` (the TP part; on a 2-D mesh DP is the other axis).
        default_layout: e.g. ``"tp"`` or ``"dp"``.
        torch_builder: ``torch_builder(config) -> torch.nn.Module``: the same model file's
            classes run under plain PyTorch (see ``sbpflow.models._twin``); with the same
            seed (``torch.manual_seed`` / ``sbpflow.manual_seed``) before building, the two
            models hold equal parameters under equal names. ``None``: no torch twin.
        pipeline_split: ``pipeline_split(config, stages) -> [[module name, ...] per
            stage]``: the model's pipeline-parallel stage assignment (names as
            ``model.get_submodule`` takes them; every stage non-empty); raises ValueError
            when the model cannot be cut into that many stages (fewer layers than
            stages). ``None``: the model has no pipeline split. See
            :meth:`pipeline_stages`.
    """

    name: str
    family: str
    task: str
    config: Any
    builder: Callable[[Any], Any]
    plans: dict = field(default_factory=dict)
    default_layout: str = "dp"
    torch_builder: Callable[[Any], Any] | None = None
    pipeline_split: Callable[[Any, int], list] | None = None

    def build(self, **overrides):
        """The model (local parameters; seed first for torch's initialisation).
        ``overrides`` replace config fields (``spec.build(vocab_size=65, dropout=0.1)``)."""
        return self.builder(self.configure(**overrides))

    def build_torch(self, **overrides):
        """The plain-PyTorch twin of :meth:`build` (a ``torch.nn.Module``; seed with
        ``torch.manual_seed`` first to get :meth:`build`'s parameters).

        Raises:
            ValueError: the spec has no ``torch_builder``.
        """
        if self.torch_builder is None:
            raise ValueError(f"model {self.name!r} has no plain-PyTorch twin (torch_builder)")
        return self.torch_builder(self.configure(**overrides))

    def configure(self, **overrides):
        """The config with ``overrides`` applied (a new instance; the spec is unchanged).

        Raises:
            TypeError: an override that is not a field of the config (names the fields).
            ValueError: from the config's own checks (``__post_init__``), e.g. GPT's
                ``n_embd`` not divisible by ``n_head``.
        """
        if not overrides:
            return self.config
        fields = set(self.config.__dataclass_fields__)
        unknown = sorted(set(overrides) - fields)
        if unknown:
            raise TypeError(f"{self.name}: no config field(s) {unknown}; "
                            f"{type(self.config).__name__} has {sorted(fields)}")
        return replace(self.config, **overrides)

    def plan(self, layout: str) -> dict:
        """The plan for ``layout``: ``"dp"``: ``plans["dp"]`` if the model has one (what
        stays sharded when the rest is data parallel, e.g. the embedding tables of a
        recommendation model split by rows), else ``{}`` (pure data parallel); another
        layout: its tensor-parallel plan."""
        if layout == "dp":
            return self.plans.get("dp", {})
        if layout not in self.plans:
            raise ValueError(f"{self.name} has no {layout!r} plan; it has "
                             f"{sorted(self.plans) + ['dp']}")
        return self.plans[layout]


    def pipeline_stages(self, stages: int, **overrides) -> list[list[str]]:
        """The module names of each of ``stages`` pipeline stages (stage 0 first), for the
        config with ``overrides`` applied; put them in stages with
        ``model.get_submodule(name).to(sbpflow.nn.graph.GraphModule).set_stage(s,
        placement)``. Module code outside them (GPT: the sum of the embeddings, the loss)
        runs where its inputs live.

        Raises:
            ValueError: the model has no pipeline split (names the models that have one),
                ``stages`` < 1, or the split's own refusal (GPT: fewer blocks than stages).
        """
        if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
            raise ValueError(f"pipeline stages must be an integer >= 1, got {stages!r}")
        if self.pipeline_split is None:
            have = [n for n in names() if MODELS[n].pipeline_split is not None]
            raise ValueError(f"{self.name} ({self.family}) has no pipeline split; models "
                             f"with one: {have}")
        split = [list(s) for s in self.pipeline_split(self.configure(**overrides), stages)]
        if len(split) != stages or not all(split):
            raise ValueError(f"{self.name}: its pipeline_split gave {len(split)} stages "
                             f"({[len(s) for s in split]} modules) for {stages}; each of "
                             f"the {stages} stages needs at least one module")
        return split


MODELS: dict[str, ModelSpec] = {}


def register(spec: ModelSpec) -> ModelSpec:
    if spec.name in MODELS:
        raise ValueError(f"model {spec.name!r} is registered twice")
    MODELS[spec.name] = spec
    return spec


def names() -> list[str]:
    return sorted(MODELS)


def get(name: str) -> ModelSpec:
    """The spec named ``name``. Raises ValueError naming the known models."""
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(f"no model {name!r}; known models: {names()}") from None


# ------------------------------------------------------------------ synthetic data
def _in_channels(cfg) -> int:
    return next((getattr(cfg, n) for n in ("in_channels", "in_chans", "channels")
                 if isinstance(getattr(cfg, n, None), int)), 3)


def _num_classes(cfg) -> int:
    return next((getattr(cfg, n) for n in ("num_classes", "n_classes", "classes")
                 if isinstance(getattr(cfg, n, None), int)), 1000)


def _vocab(cfg) -> int:
    return next((getattr(cfg, n) for n in ("vocab_size", "n_vocab")
                 if isinstance(getattr(cfg, n, None), int)), 256)


def synthetic_batch(spec, batch: int, seq_len: int | None, rank: int, seed: int,
                    image_size: int = 224):
    """One rank's synthetic batch for ``spec.task`` as plain torch tensors (CPU).

    * ``image``: ``(images (B, C, S, S) float32 N(0, 1), labels (B,) int64)``, S =
      ``image_size``, C the config's ``in_channels`` (3);
    * ``lm``: ``(idx (B, T) int64, targets (B, T) int64)``, uniform over the vocabulary;
    * ``mlm``: ``(input_ids (B, T) int64, labels (B, T) int64)``, labels -100 except on
      15% of the positions, where they are the token ids;
    * ``ctr``: ``(dense (B, D) float32 N(0, 1), sparse (B, F) int64 (column f uniform over
      table f's rows), bag (B, 3) int64 uniform over the bag's rows, bag_weights (B, 3)
      float32 (each bag's mean over 1-3 of its ids, the rest weight 0), labels (B,)
      float32 0/1, 1 with probability 0.4)``, from the config's ``vocab_sizes``,
      ``bag_vocab`` (0: no bag and bag_weights in the tuple) and ``num_dense``;
    * ``face``: ``(features (B, F) float32 N(0, 1), labels (B,) int64 uniform over the
      classes)``.

    Deterministic in ``(seed, rank)``, so that every process can make any rank's batch.
    """
    import torch

    g = torch.Generator().manual_seed(seed * 100003 + rank)
    cfg = spec.config
    if spec.task == "ctr":
        return _clicks(cfg, batch, g)
    if spec.task == "face":
        return (torch.randn(batch, cfg.in_features, generator=g),
                torch.randint(0, cfg.num_classes, (batch,), generator=g))
    if spec.task == "image":
        c = _in_channels(cfg)
        return (torch.randn(batch, c, image_size, image_size, generator=g),
                torch.randint(0, _num_classes(cfg), (batch,), generator=g))
    ids = torch.randint(0, _vocab(cfg), (batch, seq_len), generator=g)
    if spec.task == "lm":
        return ids, torch.randint(0, _vocab(cfg), (batch, seq_len), generator=g)
    mask = torch.rand(batch, seq_len, generator=g) < 0.15
    mask[:, 0] = True  # at least one label per row
    return ids, torch.where(mask, ids, torch.full_like(ids, -100))


def _clicks(cfg, batch: int, g):
    """``synthetic_batch``'s ``ctr`` tuple (see there)."""
    import torch

    sparse = torch.stack([torch.randint(0, v, (batch,), generator=g)
                          for v in cfg.vocab_sizes], 1)
    bags = ()
    if cfg.bag_vocab:
        weights = (torch.rand(batch, 3, generator=g) < 0.6).float()
        weights[:, 0] = 1.0
        bags = (torch.randint(0, cfg.bag_vocab, (batch, 3), generator=g),
                weights / weights.sum(1, keepdim=True))
    return (torch.randn(batch, cfg.num_dense, generator=g), sparse, *bags,
            (torch.rand(batch, generator=g) < 0.4).float())


#: Samples per rank a benchmark or plan uses by default on the CPU, per task (a 2-core run
#: in minutes; ``sbpflow bench`` and ``sbpflow plan`` share it).
CPU_BATCH = {"image": 8, "lm": 8, "mlm": 8, "ctr": 256, "face": 64}


def default_batch(task: str) -> int:
    """:data:`CPU_BATCH`'s samples per rank for ``task`` (8 for a task it does not list)."""
    return CPU_BATCH.get(task, 8)


# ------------------------------------------------------------- layouts and the loss
def layout_placement(device: str, dp: int, tp: int):
    """The placement of a ``dp x tp`` layout (a 1-D mesh when one of them is 1, else
    ``dp`` rows of ``tp`` ranks) and the batch's nd-SBP: ``S(0)`` over data parallel,
    ``B`` over tensor parallel. Returns ``(placement, sbp)``."""
    import torch

    import sbpflow
    from sbpflow.sbp import broadcast, split

    n = dp * tp
    mesh = torch.arange(n).reshape(dp, tp).tolist() if dp > 1 and tp > 1 else list(range(n))
    sbp = (split(0), broadcast) if dp > 1 and tp > 1 else (split(0) if tp == 1 else broadcast)
    return sbpflow.placement(device, mesh), sbp


def per_rank_batch_norm(model) -> None:
    """BatchNorm layers of ``model`` keep per-rank statistics (as DDP without
    SyncBatchNorm): how sbpflow's benchmarks and plans compare with DDP."""
    from sbpflow.nn.modules.norm import _BatchNorm

    for m in model.modules():
        if isinstance(m, _BatchNorm):
            m.sync_stats = False


def task_loss(functional, task: str, model, *batch):
    """The training loss of a zoo model for ``task`` on ``batch`` (the inputs, then the
    labels: :func:`synthetic_batch`'s tuple; the module docstring's contracts):
    cross-entropy of the logits for ``image``, binary cross-entropy of the click logits
    for ``ctr``, the model's own loss otherwise; ``functional``: ``torch.nn.functional``
    or sbpflow's."""
    *inputs, y = batch
    if task == "image":
        return functional.cross_entropy(model(*inputs), y)
    if task == "ctr":
        return functional.binary_cross_entropy_with_logits(model(*inputs), y)
    return model(*inputs, y)[1]
