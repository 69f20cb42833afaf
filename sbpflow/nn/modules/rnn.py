"""RNN, LSTM, GRU and their cells RNNCell, LSTMCell, GRUCell (torch.nn's arguments,
parameter names, shapes, registration order and initialisation: a torch state_dict loads
into them and back, and the same seed gives the same parameters bit for bit).

The recurrences are composed from sbpflow ops (``F.linear``, ``sigmoid``, ``tanh``,
``relu``, ``chunk``, ``unbind``, ``stack``, ``cat``), so autograd and SBP layouts come from
the op library. The input projection of a whole layer is one ``F.linear`` over all time
steps (as cuDNN does); the hidden projection runs once per step.

Data parallel: with the parameters ``B`` and the input split on its batch dim (``S(0)``
batch-first, ``S(1)`` seq-first), every step is shard-local; the forward and the backward
run no collective except the gradient reduction of the parameters (their gradients are P
until reduced). The default zero state takes the input's batch split, and a given ``hx``
of shape (D * num_layers, N, H) should be ``S(1)`` there (another layout is boxed).

Gate formulas (torch's, gate order i, f, g, o for LSTM and r, z, n for GRU)::

    RNN : h' = act(W_ih x + b_ih + W_hh h + b_hh)            act = tanh or relu
    LSTM: i, f, g, o = sigmoid, sigmoid, tanh, sigmoid of (W_ih x + b_ih + W_hh h + b_hh)
          c' = f * c + i * g;  h' = o * tanh(c')   (h' = W_hr h' with proj_size > 0)
    GRU : r, z = sigmoid(W_i{r,z} x + b_i{r,z} + W_h{r,z} h + b_h{r,z})
          n = tanh(W_in x + b_in + r * (W_hn h + b_hn));  h' = (1 - z) * n + z * h

Not supported: PackedSequence inputs (``nn.utils.rnn.pack_padded_sequence``). Dropout
between layers (training only) uses :func:`sbpflow.nn.functional.dropout`, whose random
stream is not the one torch's fused RNN kernel draws.
"""

from __future__ import annotations

import math
import numbers
import warnings

import torch

from ...ops import cat, stack
from ...ops.creation import zeros
from ...sbp import broadcast, split
from ...tensor import Tensor
from .. import functional as F
from .. import init
from ..module import Module
from ._common import empty_param, optional_param

__all__ = ["RNNBase", "RNN", "LSTM", "GRU", "RNNCellBase", "RNNCell", "LSTMCell", "GRUCell"]

_GATES = {"RNN_TANH": 1, "RNN_RELU": 1, "LSTM": 4, "GRU": 3}


# ------------------------------------------------------------------ helpers
def _check_tensor(cls: str, name: str, t) -> None:
    if not isinstance(t, Tensor):
        hint = ("; PackedSequence inputs are not supported, pass a padded tensor"
                if type(t).__name__ == "PackedSequence" else
                " (wrap torch tensors with sbpflow.from_torch)")
        raise TypeError(f"{cls}: {name} must be an sbpflow.Tensor, got "
                        f"{type(t).__name__}{hint}")


def _same_kind(cls: str, input: Tensor, **states) -> None:  # noqa: A002
    """``states`` must be local when ``input`` is, global on its placement when it is."""
    for k, t in states.items():
        if t is None:
            continue
        _check_tensor(cls, k, t)
        if t.is_global != input.is_global:
            raise TypeError(f"{cls}: input is {'global' if input.is_global else 'local'} but "
                            f"{k} is {'global' if t.is_global else 'local'}; convert {k} with "
                            f"{k}.to_global(input.placement, sbp) or pass a local input")
        if t.is_global and t.placement != input.placement:
            raise ValueError(f"{cls}: {k} lives on {t.placement!r} but input on "
                             f"{input.placement!r}; move it with {k}.to_global(placement=...)")


def _zeros_state(x: Tensor, batch_dim: int, size: int) -> Tensor:
    """Zeros (N, size) like ``x`` (dtype, device); on a global ``x`` split on ``batch_dim``
    where ``x`` is (B elsewhere), so the recurrence stays shard-local."""
    n = x.shape[batch_dim]
    if x.is_local:
        return Tensor(torch.zeros((n, size), dtype=x.dtype, device=x._local.device))
    nd = tuple(split(0) if s.is_split() and s.dim == batch_dim else broadcast for s in x.sbp)
    return zeros(n, size, dtype=x.dtype, placement=x.placement, sbp=nd)


def _check_shape(cls: str, name: str, t: Tensor, expected: tuple[int, ...]) -> None:
    if tuple(t.shape) != expected:
        raise ValueError(f"{cls}: expected {name} of shape {expected}, got {tuple(t.shape)} "
                         f"(hidden states are (num_layers * num_directions, batch, hidden), "
                         f"without the batch dim for an unbatched input)")


# ------------------------------------------------------------------ cells (one step)
def _rnn_step(act, gi, h, w_hh, b_hh):
    return act(gi + F.linear(h, w_hh, b_hh))


def _lstm_step(gi, h, c, w_hh, b_hh, w_hr):
    gates = gi + F.linear(h, w_hh, b_hh)
    i, f, g, o = gates.chunk(4, -1)
    c = F.sigmoid(f) * c + F.sigmoid(i) * F.tanh(g)
    h = F.sigmoid(o) * F.tanh(c)
    if w_hr is not None:
        h = F.linear(h, w_hr)
    return h, c


def _gru_step(gi, h, w_hh, b_hh):
    gh = F.linear(h, w_hh, b_hh)
    i_r, i_z, i_n = gi.chunk(3, -1)
    h_r, h_z, h_n = gh.chunk(3, -1)
    r = F.sigmoid(i_r + h_r)
    z = F.sigmoid(i_z + h_z)
    n = F.tanh(i_n + r * h_n)
    return (h - n) * z + n  # torch's (1 - z) * n + z * h, in ATen's order


def _act(mode: str):
    return F.relu if mode == "RNN_RELU" else F.tanh


# ------------------------------------------------------------------ multi-layer modules
class RNNBase(Module):
    """The multi-layer (optionally bidirectional) recurrence shared by RNN, LSTM and GRU
    (``torch.nn.RNNBase``). ``mode`` is ``"RNN_TANH"``, ``"RNN_RELU"``, ``"LSTM"`` or
    ``"GRU"``.

    Parameters per layer ``k`` and direction (suffix ``_reverse`` for the backward one),
    registered in torch's order: ``weight_ih_l{k}`` (G * hidden_size, in_k),
    ``weight_hh_l{k}`` (G * hidden_size, H_out), ``bias_ih_l{k}``, ``bias_hh_l{k}``
    (G * hidden_size,) when ``bias``, ``weight_hr_l{k}`` (proj_size, hidden_size) when
    ``proj_size > 0`` (LSTM); G = 1 (RNN), 4 (LSTM), 3 (GRU); in_0 = input_size and
    in_k = D * H_out after, D = 2 if bidirectional else 1, H_out = proj_size or
    hidden_size. All initialised uniform in ``+-1/sqrt(hidden_size)`` in that order, as
    torch does.

    Raises ``ValueError`` for a dropout outside [0, 1], non-positive sizes, a bad
    ``proj_size``, or (in forward) an input that is not 2-D/3-D, whose last dim is not
    ``input_size``, a state of the wrong shape, or an empty sequence; ``TypeError`` for
    non-integer sizes or mixed local/global tensors.
    """

    def __init__(self, mode: str, input_size: int, hidden_size: int, num_layers: int = 1,
                 bias: bool = True, batch_first: bool = False, dropout: float = 0.0,
                 bidirectional: bool = False, proj_size: int = 0, device=None,
                 dtype=None):
        super().__init__()
        if mode not in _GATES:
            raise ValueError(f"Unrecognized RNN mode {mode!r}; expected one of "
                             f"{sorted(_GATES)}")
        name = type(self).__name__
        if (not isinstance(dropout, numbers.Number) or isinstance(dropout, bool)
                or not 0 <= dropout <= 1):
            raise ValueError(f"{name}: dropout should be a number in range [0, 1] representing "
                             f"the probability of an element being zeroed, got {dropout!r}")
        for arg, v in (("input_size", input_size), ("hidden_size", hidden_size),
                       ("num_layers", num_layers), ("proj_size", proj_size)):
            if not isinstance(v, int) or isinstance(v, bool):
                raise TypeError(f"{name}: {arg} should be of type int, got "
                                f"{type(v).__name__}")
        if hidden_size <= 0:
            raise ValueError(f"{name}: hidden_size must be greater than zero, got {hidden_size}")
        if num_layers <= 0:
            raise ValueError(f"{name}: num_layers must be greater than zero, got {num_layers}")
        if proj_size < 0:
            raise ValueError(f"{name}: proj_size should be a positive integer or zero to "
                             f"disable projections, got {proj_size}")
        if proj_size >= hidden_size:
            raise ValueError(f"{name}: proj_size ({proj_size}) has to be smaller than "
                             f"hidden_size ({hidden_size})")
        if proj_size and mode != "LSTM":
            raise ValueError(f"{name}: proj_size argument is only supported for LSTM, not "
                             f"RNN or GRU")
        if dropout > 0 and num_layers == 1:
            warnings.warn(f"dropout option adds dropout after all but last recurrent layer, so "
                          f"non-zero dropout expects num_layers greater than 1, but got "
                          f"dropout={dropout} and num_layers={num_layers}", stacklevel=2)
        self.mode, self.input_size, self.hidden_size = mode, input_size, hidden_size
        self.num_layers, self.bias, self.batch_first = num_layers, bias, batch_first
        self.dropout, self.bidirectional = float(dropout), bidirectional
        self.proj_size = proj_size
        gate_size = _GATES[mode] * hidden_size
        d = 2 if bidirectional else 1
        real_hidden = proj_size if proj_size > 0 else hidden_size
        self._flat_weights_names: list[str] = []
        self._all_weights: list[list[str]] = []
        kw = {"device": device, "dtype": dtype}
        for layer in range(num_layers):
            layer_in = input_size if layer == 0 else real_hidden * d
            for direction in range(d):
                sfx = f"_l{layer}{'_reverse' if direction == 1 else ''}"
                names = [f"weight_ih{sfx}", f"weight_hh{sfx}"]
                setattr(self, names[0], empty_param(gate_size, layer_in, **kw))
                setattr(self, names[1], empty_param(gate_size, real_hidden, **kw))
                if bias:
                    names += [f"bias_ih{sfx}", f"bias_hh{sfx}"]
                    for n in names[2:]:
                        optional_param(self, n, True, gate_size, **kw)
                if proj_size > 0:
                    names.append(f"weight_hr{sfx}")
                    setattr(self, names[-1], empty_param(proj_size, hidden_size, **kw))
                self._flat_weights_names.extend(names)
                self._all_weights.append(names)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Every parameter uniform in ``+-1/sqrt(hidden_size)``, in registration order
        (torch's ``RNNBase.reset_parameters``)."""
        stdv = 1.0 / math.sqrt(self.hidden_size) if self.hidden_size > 0 else 0
        for weight in self.parameters():
            init.uniform_(weight, -stdv, stdv)

    def flatten_parameters(self) -> None:
        """No-op (torch compacts weights for cuDNN here; sbpflow has nothing to compact)."""

    @property
    def all_weights(self) -> list[list]:
        """The parameters per layer and direction, as ``torch.nn.RNNBase.all_weights``."""
        return [[getattr(self, n) for n in names] for names in self._all_weights]

    @property
    def _flat_weights(self) -> list:
        return [getattr(self, n) for n in self._flat_weights_names]

    def _layer_params(self, layer: int, direction: int):
        sfx = f"_l{layer}{'_reverse' if direction == 1 else ''}"
        get = lambda n: getattr(self, n + sfx, None)  # noqa: E731
        return (get("weight_ih"), get("weight_hh"), get("bias_ih"), get("bias_hh"),
                get("weight_hr"))

    def _state_sizes(self) -> tuple[int, int]:
        return (self.proj_size if self.proj_size > 0 else self.hidden_size), self.hidden_size

    def forward(self, input, hx=None):  # noqa: A002
        """input (L, N, input_size), or (N, L, input_size) with ``batch_first``, or
        unbatched (L, input_size); ``hx`` (D * num_layers, N, H_out) or unbatched
        (D * num_layers, H_out), default zeros; an LSTM takes ``hx = (h_0, c_0)`` with
        c_0 (D * num_layers, N, hidden_size). Returns ``(output, h_n)`` (RNN, GRU) or
        ``(output, (h_n, c_n))`` (LSTM): output (L, N, D * H_out) ((N, L, D * H_out) with
        ``batch_first``, (L, D * H_out) unbatched), h_n and c_n shaped as hx."""
        cls = type(self).__name__
        _check_tensor(cls, "input", input)
        lstm = self.mode == "LSTM"
        if lstm and hx is not None:
            if not isinstance(hx, (tuple, list)) or len(hx) != 2:
                raise TypeError(f"{cls}: hx must be a tuple (h_0, c_0), got "
                                f"{type(hx).__name__}")
            h0, c0 = hx
        else:
            h0, c0 = hx, None
        _same_kind(cls, input, h_0=h0, c_0=c0)
        if input.ndim not in (2, 3):
            raise ValueError(f"{cls}: Expected input to be 2D or 3D, got {input.ndim}D tensor "
                             f"instead (shape {tuple(input.shape)})")
        if input.shape[-1] != self.input_size:
            raise ValueError(f"{cls}: input.size(-1) must be equal to input_size. Expected "
                             f"{self.input_size}, got {input.shape[-1]} (input shape "
                             f"{tuple(input.shape)})")
        batched = input.ndim == 3
        if input.shape[1 if batched and self.batch_first else 0] == 0:
            raise ValueError(f"{cls}: Expected sequence length to be larger than 0, got input "
                             f"of shape {tuple(input.shape)}")
        d = 2 if self.bidirectional else 1
        h_out, h_cell = self._state_sizes()
        x = input
        if not batched:
            x = x.unsqueeze(1)
        elif self.batch_first:
            x = x.transpose(0, 1)
        n = x.shape[1]
        for k, t, size in (("h_0", h0, h_out), ("c_0", c0, h_cell)):
            if t is None:
                continue
            want = (d * self.num_layers, n, size) if batched else (d * self.num_layers, size)
            if t.ndim != len(want):
                raise ValueError(f"{cls}: for {'batched 3-D' if batched else 'unbatched 2-D'} "
                                 f"input, {k} should also be {len(want)}-D but got "
                                 f"{t.ndim}-D tensor (shape {tuple(t.shape)})")
            _check_shape(cls, k, t, want)
        if not batched:
            h0 = None if h0 is None else h0.unsqueeze(1)
            c0 = None if c0 is None else c0.unsqueeze(1)
        h0s = h0.unbind(0) if h0 is not None else None
        c0s = c0.unbind(0) if c0 is not None else None
        hn, cn = [], []
        for layer in range(self.num_layers):
            if layer > 0 and self.dropout > 0 and self.training:
                x = F.dropout(x, self.dropout, True)
            outs = []
            for direction in range(d):
                idx = layer * d + direction
                w_ih, w_hh, b_ih, b_hh, w_hr = self._layer_params(layer, direction)
                h = h0s[idx] if h0s is not None else _zeros_state(x, 1, h_out)
                c = None
                if lstm:
                    c = c0s[idx] if c0s is not None else _zeros_state(x, 1, h_cell)
                gis = F.linear(x, w_ih, b_ih).unbind(0)  # (N, G * hidden) per step
                steps = range(len(gis) - 1, -1, -1) if direction == 1 else range(len(gis))
                ys = [None] * len(gis)
                for t in steps:
                    if lstm:
                        h, c = _lstm_step(gis[t], h, c, w_hh, b_hh, w_hr)
                    elif self.mode == "GRU":
                        h = _gru_step(gis[t], h, w_hh, b_hh)
                    else:
                        h = _rnn_step(_act(self.mode), gis[t], h, w_hh, b_hh)
                    ys[t] = h
                outs.append(stack(ys, 0))  # (L, N, H_out)
                hn.append(h)
                cn.append(c)
            x = outs[0] if d == 1 else cat(outs, 2)
        out = x
        h_n = stack(hn, 0)
        c_n = stack(cn, 0) if lstm else None
        if not batched:
            out, h_n = out.squeeze(1), h_n.squeeze(1)
            c_n = c_n.squeeze(1) if lstm else None
        elif self.batch_first:
            out = out.transpose(0, 1)
        return (out, (h_n, c_n)) if lstm else (out, h_n)

    def extra_repr(self) -> str:
        s = f"{self.input_size}, {self.hidden_size}"
        if self.proj_size != 0:
            s += f", proj_size={self.proj_size}"
        if self.num_layers != 1:
            s += f", num_layers={self.num_layers}"
        if self.bias is not True:
            s += f", bias={self.bias}"
        if self.batch_first is not False:
            s += f", batch_first={self.batch_first}"
        if self.dropout != 0:
            s += f", dropout={self.dropout}"
        if self.bidirectional is not False:
            s += f", bidirectional={self.bidirectional}"
        return s


class RNN(RNNBase):
    """Elman RNN, ``h_t = act(W_ih x_t + b_ih + W_hh h_{t-1} + b_hh)`` with act ``tanh``
    or ``relu`` (``torch.nn.RNN``). Arguments, shapes and parameters as
    :class:`RNNBase` (G = 1); ``nonlinearity`` must be ``"tanh"`` or ``"relu"``
    (``ValueError`` otherwise)."""

    def __init__(self, input_size: int, hidden_size: int, num_layers: int = 1,
                 nonlinearity: str = "tanh", bias: bool = True, batch_first: bool = False,
                 dropout: float = 0.0, bidirectional: bool = False, device=None, dtype=None):
        if nonlinearity not in ("tanh", "relu"):
            raise ValueError(f"RNN: Unknown nonlinearity {nonlinearity!r}. Select from 'tanh' "
                             f"or 'relu'.")
        self.nonlinearity = nonlinearity
        super().__init__("RNN_TANH" if nonlinearity == "tanh" else "RNN_RELU", input_size,
                         hidden_size, num_layers, bias, batch_first, dropout, bidirectional,
                         device=device, dtype=dtype)


class LSTM(RNNBase):
    """Long short-term memory (``torch.nn.LSTM``), gates i, f, g, o; with ``proj_size > 0``
    the hidden state is projected by ``weight_hr_l{k}`` (H_out = proj_size). Arguments,
    shapes and parameters as :class:`RNNBase` (G = 4); forward takes and returns
    ``(h, c)`` pairs."""

    def __init__(self, input_size: int, hidden_size: int, num_layers: int = 1,
                 bias: bool = True, batch_first: bool = False, dropout: float = 0.0,
                 bidirectional: bool = False, proj_size: int = 0, device=None, dtype=None):
        super().__init__("LSTM", input_size, hidden_size, num_layers, bias, batch_first,
                         dropout, bidirectional, proj_size, device=device, dtype=dtype)


class GRU(RNNBase):
    """Gated recurrent unit (``torch.nn.GRU``), gates r, z, n with
    ``n = tanh(W_in x + b_in + r * (W_hn h + b_hn))``. Arguments, shapes and parameters as
    :class:`RNNBase` (G = 3)."""

    def __init__(self, input_size: int, hidden_size: int, num_layers: int = 1,
                 bias: bool = True, batch_first: bool = False, dropout: float = 0.0,
                 bidirectional: bool = False, device=None, dtype=None):
        super().__init__("GRU", input_size, hidden_size, num_layers, bias, batch_first,
                         dropout, bidirectional, device=device, dtype=dtype)


# ------------------------------------------------------------------ cells
class RNNCellBase(Module):
    """One step of a recurrence (``torch.nn.RNNCellBase``): ``weight_ih``
    (G * hidden_size, input_size), ``weight_hh`` (G * hidden_size, hidden_size),
    ``bias_ih``, ``bias_hh`` (G * hidden_size,) when ``bias``, all uniform in
    ``+-1/sqrt(hidden_size)`` in that order as torch. Data parallel: input (N, input_size)
    ``S(0)``, parameters B: no collective but the gradient reduction."""

    def __init__(self, input_size: int, hidden_size: int, bias: bool, num_chunks: int,
                 device=None, dtype=None):
        super().__init__()
        self.input_size, self.hidden_size, self.bias = input_size, hidden_size, bias
        kw = {"device": device, "dtype": dtype}
        self.weight_ih = empty_param(num_chunks * hidden_size, input_size, **kw)
        self.weight_hh = empty_param(num_chunks * hidden_size, hidden_size, **kw)
        optional_param(self, "bias_ih", bias, num_chunks * hidden_size, **kw)
        optional_param(self, "bias_hh", bias, num_chunks * hidden_size, **kw)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        stdv = 1.0 / math.sqrt(self.hidden_size) if self.hidden_size > 0 else 0
        for weight in self.parameters():
            init.uniform_(weight, -stdv, stdv)

    def _prepare(self, input, states: dict):  # noqa: A002
        """Check input (N, input_size) or (input_size,) and the states (N, hidden_size) or
        (hidden_size,); returns (2-D input, 2-D states or zeros, batched)."""
        cls = type(self).__name__
        _check_tensor(cls, "input", input)
        _same_kind(cls, input, **states)
        if input.ndim not in (1, 2):
            raise ValueError(f"{cls}: Expected input to be 1D or 2D, got {input.ndim}D instead "
                             f"(shape {tuple(input.shape)})")
        if input.shape[-1] != self.input_size:
            raise ValueError(f"{cls}: input has inconsistent input_size: got "
                             f"{input.shape[-1]}, expected {self.input_size} (input shape "
                             f"{tuple(input.shape)})")
        batched = input.ndim == 2
        x = input if batched else input.unsqueeze(0)
        out = []
        for k, t in states.items():
            if t is None:
                out.append(_zeros_state(x, 0, self.hidden_size))
                continue
            want = (x.shape[0], self.hidden_size) if batched else (self.hidden_size,)
            if tuple(t.shape) != want:
                raise ValueError(f"{cls}: expected {k} of shape {want} for input of shape "
                                 f"{tuple(input.shape)}, got {tuple(t.shape)}")
            out.append(t if batched else t.unsqueeze(0))
        return x, out, batched

    def extra_repr(self) -> str:
        s = f"{self.input_size}, {self.hidden_size}"
        if self.bias is not True:
            s += f", bias={self.bias}"
        nl = getattr(self, "nonlinearity", "tanh")
        return s if nl == "tanh" else s + f", nonlinearity={nl}"


class RNNCell(RNNCellBase):
    """``h' = act(W_ih x + b_ih + W_hh h + b_hh)`` (``torch.nn.RNNCell``), act ``tanh``
    or ``relu``. forward(input (N, input_size) or (input_size,), hx (N, hidden_size) or
    (hidden_size,), default zeros) -> h' shaped as hx."""

    def __init__(self, input_size: int, hidden_size: int, bias: bool = True,
                 nonlinearity: str = "tanh", device=None, dtype=None):
        if nonlinearity not in ("tanh", "relu"):
            raise ValueError(f"RNNCell: Unknown nonlinearity: {nonlinearity!r}. Select from "
                             f"'tanh' or 'relu'.")
        self.nonlinearity = nonlinearity
        super().__init__(input_size, hidden_size, bias, 1, device=device, dtype=dtype)

    def forward(self, input, hx=None):  # noqa: A002
        x, (h,), batched = self._prepare(input, {"hx": hx})
        act = F.relu if self.nonlinearity == "relu" else F.tanh
        h = _rnn_step(act, F.linear(x, self.weight_ih, self.bias_ih), h, self.weight_hh,
                      self.bias_hh)
        return h if batched else h.squeeze(0)


class LSTMCell(RNNCellBase):
    """One LSTM step (``torch.nn.LSTMCell``), gates i, f, g, o. forward(input
    (N, input_size) or (input_size,), hx = (h, c) each (N, hidden_size) or (hidden_size,),
    default zeros) -> (h', c')."""

    def __init__(self, input_size: int, hidden_size: int, bias: bool = True, device=None,
                 dtype=None):
        super().__init__(input_size, hidden_size, bias, 4, device=device, dtype=dtype)

    def forward(self, input, hx=None):  # noqa: A002
        if hx is None:
            hx = (None, None)
        elif not isinstance(hx, (tuple, list)) or len(hx) != 2:
            raise TypeError(f"LSTMCell: hx must be a tuple (h, c), got {type(hx).__name__}")
        x, (h, c), batched = self._prepare(input, {"h": hx[0], "c": hx[1]})
        h, c = _lstm_step(F.linear(x, self.weight_ih, self.bias_ih), h, c, self.weight_hh,
                          self.bias_hh, None)
        return (h, c) if batched else (h.squeeze(0), c.squeeze(0))


class GRUCell(RNNCellBase):
    """One GRU step (``torch.nn.GRUCell``), gates r, z, n. forward(input (N, input_size)
    or (input_size,), hx (N, hidden_size) or (hidden_size,), default zeros) -> h'."""

    def __init__(self, input_size: int, hidden_size: int, bias: bool = True, device=None,
                 dtype=None):
        super().__init__(input_size, hidden_size, bias, 3, device=device, dtype=dtype)

    def forward(self, input, hx=None):  # noqa: A002
        x, (h,), batched = self._prepare(input, {"hx": hx})
        h = _gru_step(F.linear(x, self.weight_ih, self.bias_ih), h, self.weight_hh,
                      self.bias_hh)
        return h if batched else h.squeeze(0)
