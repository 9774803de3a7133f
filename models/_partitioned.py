"""Model parallelism: one model replica split into K partitions by units (paper, section 3, Figures 1-2).

Each partition owns a contiguous range of the units of every layer and the parameters of those units; it
computes its block of every layer and exchanges only the activations (forward) and input-gradients
(backward) that cross a partition boundary. Here the plan and the per-partition passes are pure numpy:

- a pass of partition ``k`` is a generator that yields :class:`Send` (a message to another partition) and
  :class:`Recv` (wait for one, answered with its array) and returns ``(loss or None, gradient slice)``; the
  same generator runs in one process (:func:`run_partitioned`) and on Dask actors
  (``downpour/_partitioned.py``), so the message counts are the same in both;
- a partition's parameters are one contiguous range of the *partition-major* vector
  ``w[plan.perm]`` (``plan.bounds[k]:plan.bounds[k+1]``), so the parameter-server shards can be aligned to
  partitions (``storage/_partition_layout.py``, Figure 2).

Three plans:

- :class:`MLPPlan`: :class:`models.MLP` split by units within every layer (columns of ``W_l`` and their
  biases). Every layer's input is the full activation of the layer below: an **all-gather** per hidden layer
  (``K (K-1)`` messages), the logits gathered at partition 0 for the softmax and their gradients scattered
  back (``2 (K-1)``), and a **reduce-scatter** of the input-gradients per hidden layer (``K (K-1)``).
- :class:`LocallyConnectedPlan`: :class:`models.LocallyConnected` split spatially; only the **halo**
  (boundary units a neighbour's receptive fields reach) crosses, forward and backward, so a layer costs at
  most ``2 (K-1)`` messages each way; the dense output layer costs a reduce of partial logits at partition 0
  and a broadcast of their gradient (``2 (K-1)``).
- :class:`LocallyConnected2DPlan`: :class:`models.LocallyConnected2D` (image patches) split into bands of
  map rows, the same halo exchange with a row of the map (width x channels values) as the unit.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
from numpy.typing import NDArray

from distbelief.errors import InvalidOptionError, ProtocolError

from . import _checks
from ._base import Model
from ._linear import softmax_xent_
from ._local import (
    LocallyConnected,
    activate_,
    backprop_activation_,
    local_backward,
    local_forward,
)
from ._local2d import LocallyConnected2D, local2d_backward, local2d_forward
from ._mlp import MLP

__all__ = [
    "LocallyConnected2DPlan",
    "LocallyConnectedPlan",
    "MLPPlan",
    "PartitionPlan",
    "PartitionedModel",
    "Recv",
    "Send",
    "Traffic",
    "max_partitions",
    "partition_plan",
    "run_partitioned",
]

FloatArray = NDArray[np.float64]
IntArray = NDArray[np.int64]


@dataclass(frozen=True)
class Send:
    """A message from the running partition to partition ``dest``, named ``tag`` (unique within a pass)."""

    dest: int
    tag: str
    array: FloatArray


@dataclass(frozen=True)
class Recv:
    """Wait for the message ``tag`` from partition ``src``; the generator is resumed with its array."""

    src: int
    tag: str


#: What a partition's pass is: it yields messages to send and receives to wait for, and returns
#: ``(loss, gradient of its parameter slice)``; ``loss`` is None except on partition 0.
PartitionPass = Generator[Send | Recv, FloatArray | None, tuple[float | None, FloatArray]]


@dataclass
class Traffic:
    """Messages and bytes between partitions, in total and by kind (the tag's letters).

    Examples
    --------
    >>> t = Traffic(); t.add(Send(1, "a0", np.zeros(4))); (t.messages, t.bytes, t.by_kind)
    (1, 32, {'a': 1})
    """

    messages: int = 0
    bytes: int = 0
    by_kind: dict[str, int] = field(default_factory=dict)

    def add(self, send: Send) -> None:
        """Count one message."""
        self.messages += 1
        self.bytes += int(send.array.nbytes)
        kind = send.tag.rstrip("0123456789")
        self.by_kind[kind] = self.by_kind.get(kind, 0) + 1

    def merge(self, other: Traffic) -> None:
        """Add ``other``'s counts to these."""
        self.messages += other.messages
        self.bytes += other.bytes
        for k, v in other.by_kind.items():
            self.by_kind[k] = self.by_kind.get(k, 0) + v


class PartitionPlan(Protocol):
    """A model split into ``partitions`` blocks; see the module docstring."""

    @property
    def partitions(self) -> int:
        """Number of partitions K."""
        ...

    @property
    def perm(self) -> IntArray:
        """Indices of the model's flat vector in partition-major order (``w[perm]``)."""
        ...

    @property
    def bounds(self) -> tuple[int, ...]:
        """Partition ``k`` owns ``w[perm][bounds[k]:bounds[k+1]]``."""
        ...

    def input_columns(self, k: int) -> slice:
        """The columns of ``X`` partition ``k`` reads (its part of the input: data, not a message)."""
        ...

    def partition_pass(
        self, k: int, w_k: FloatArray, X_k: FloatArray, y: Any, *, out: FloatArray | None = None
    ) -> PartitionPass:
        """The pass of partition ``k`` on its parameters ``w_k`` and its input columns ``X_k``; its gradient
        slice is written into ``out`` (``w_k``'s shape; a new array when None) and returned."""
        ...


def _split(n: int, k: int) -> list[tuple[int, int]]:
    """``n`` units in ``k`` contiguous ranges as equal as can be (some empty when ``n < k``)."""
    return [(i * n // k, (i + 1) * n // k) for i in range(k)]


def _check_k(partitions: int) -> int:
    if isinstance(partitions, bool) or not isinstance(partitions, int | np.integer) or partitions < 1:
        raise InvalidOptionError(f"partitions must be a positive integer, got {partitions!r}")
    return int(partitions)


def _checked_out(out: FloatArray, w_k: FloatArray) -> FloatArray:
    """``out``, if it can hold the gradient of ``w_k`` (a caller's reused buffer); else a clear error."""
    if out.shape != w_k.shape or out.dtype != np.float64 or not out.flags.c_contiguous:
        raise ValueError(
            f"out must be a C-contiguous float64 array of shape {w_k.shape} (the partition's slice), got "
            f"{out.dtype} {out.shape}"
        )
    return out


def _bounds(perms: Sequence[IntArray]) -> tuple[int, ...]:
    return tuple(int(b) for b in np.cumsum([0, *(p.size for p in perms)]))


class _PlanBase:
    """What both plans share: K, the partition-major permutation (not pickled) and the partition bounds."""

    _units: list[list[tuple[int, int]]]

    def __init__(self, partitions: int) -> None:
        self._k = _check_k(partitions)

    def _finish(self) -> None:
        # Bounds by arithmetic; the permutation (8 bytes per parameter) only when asked for, so sizing a
        # plan (admission control, memory checks) costs nothing even for a huge model.
        self._perm: IntArray | None = None
        self._bounds = tuple(int(b) for b in np.cumsum([0, *self._sizes()]))

    def _sizes(self) -> list[int]:
        """Parameters of every partition."""
        raise NotImplementedError

    def _perms(self) -> list[IntArray]:
        raise NotImplementedError

    def __getstate__(self) -> dict[str, Any]:
        # The permutation (8 bytes per parameter) is the driver's business: partitions never need it.
        return {**self.__dict__, "_perm": None}

    @property
    def partitions(self) -> int:
        """Number of partitions K."""
        return self._k

    @property
    def perm(self) -> IntArray:
        """Indices of the model's flat vector in partition-major order."""
        if self._perm is None:
            perms = self._perms()
            assert _bounds(perms) == self._bounds, "a plan's sizes disagree with its permutation"
            self._perm = np.concatenate(perms)
        return self._perm

    @property
    def bounds(self) -> tuple[int, ...]:
        """Partition ``k`` owns ``w[perm][bounds[k]:bounds[k+1]]``."""
        return self._bounds

    @property
    def min_units(self) -> int:
        """The fewest units a partition owns in any layer (0: some partition has a layer with none)."""
        return min(hi - lo for layer in self._units for lo, hi in layer)


class MLPPlan(_PlanBase):
    """:class:`models.MLP` split by units within every layer (including the output layer).

    Partition ``k`` owns units ``lo:hi`` of every layer (``units(l)[k]``): columns ``W_l[:, lo:hi]`` and
    ``b_l[lo:hi]``, stored in its slice as each layer's column block (row-major) then its biases.

    Examples
    --------
    >>> plan = MLPPlan(MLP([4, 6, 3]), 2)
    >>> plan.bounds
    (0, 22, 51)
    """

    def __init__(self, model: MLP, partitions: int) -> None:
        super().__init__(partitions)
        self.model = model
        self._units = [_split(n, self._k) for n in model.layer_sizes[1:]]
        self._finish()

    def _sizes(self) -> list[int]:
        fans = self.model.layer_sizes[:-1]
        return [
            sum(
                (fan_in + 1) * (units[k][1] - units[k][0])
                for fan_in, units in zip(fans, self._units, strict=True)
            )
            for k in range(self._k)
        ]

    def _perms(self) -> list[IntArray]:
        sizes, offsets = self.model.layer_sizes, self.model._offsets
        perms: list[IntArray] = []
        for k in range(self._k):
            parts: list[IntArray] = []
            for (a, b, _), fan_in, fan_out, units in zip(
                offsets, sizes[:-1], sizes[1:], self._units, strict=True
            ):
                lo, hi = units[k]
                parts.append((a + np.arange(fan_in)[:, None] * fan_out + np.arange(lo, hi)[None, :]).ravel())
                parts.append(b + np.arange(lo, hi))
            perms.append(np.concatenate(parts).astype(np.int64))
        return perms

    def input_columns(self, k: int) -> slice:
        """Every partition reads all of ``X`` (the first layer is fully connected)."""
        return slice(0, self.model.n_features)

    def _local_layers(self, k: int, w_k: FloatArray) -> list[tuple[FloatArray, FloatArray]]:
        sizes = self.model.layer_sizes
        out, start = [], 0
        for fan_in, units in zip(sizes[:-1], self._units, strict=True):
            width = units[k][1] - units[k][0]
            W = w_k[start : start + fan_in * width].reshape(fan_in, width)
            start += fan_in * width
            out.append((W, w_k[start : start + width]))
            start += width
        return out

    def partition_pass(
        self, k: int, w_k: FloatArray, X_k: FloatArray, y: Any, *, out: FloatArray | None = None
    ) -> PartitionPass:
        """Partition ``k``'s forward and backward pass (see the module docstring for its messages); the
        gradient slice goes into ``out`` when given."""
        K, act = self._k, self.model.activation
        if out is not None:
            _checked_out(out, w_k)  # before any message: a bad buffer fails the pass at once
        layers = self._local_layers(k, w_k)
        n_layers = len(layers)
        inputs: list[FloatArray] = [X_k]
        own: list[FloatArray] = []  # this partition's activations of every hidden layer
        for index in range(n_layers - 1):
            W, b = layers[index]
            A_k = inputs[-1] @ W + b
            activate_(A_k, act)
            own.append(A_k)
            units = self._units[index]
            if A_k.shape[1]:
                for m in range(K):
                    if m != k:
                        yield Send(m, f"a{index}", A_k)
            blocks = []
            for m in range(K):
                if m == k:
                    blocks.append(A_k)
                elif units[m][1] > units[m][0]:
                    got = yield Recv(m, f"a{index}")
                    assert got is not None
                    blocks.append(got)
            inputs.append(np.hstack(blocks) if blocks else np.zeros((X_k.shape[0], 0)))
        W, b = layers[-1]
        Z_k = inputs[-1] @ W + b
        out_units = self._units[-1]
        loss: float | None = None
        if k == 0:
            blocks = [Z_k]
            for m in range(1, K):
                if out_units[m][1] > out_units[m][0]:
                    got = yield Recv(m, "z")
                    assert got is not None
                    blocks.append(got)
            Z = np.ascontiguousarray(np.hstack(blocks))
            labels = _checks.class_labels(
                _checks.as_targets(y, Z.shape[0], "MLP"), self.model.n_classes, "MLP"
            )
            loss = softmax_xent_(Z, labels)
            for m in range(1, K):
                lo, hi = out_units[m]
                if hi > lo:
                    yield Send(m, "dz", np.ascontiguousarray(Z[:, lo:hi]))
            delta = Z[:, out_units[0][0] : out_units[0][1]]
        elif Z_k.shape[1]:
            yield Send(0, "z", Z_k)
            got = yield Recv(0, "dz")
            assert got is not None
            delta = got
        else:
            delta = Z_k
        grads: list[FloatArray] = []
        for index in range(n_layers - 1, -1, -1):
            W = layers[index][0]
            grads = [(inputs[index].T @ delta).ravel(), delta.sum(axis=0), *grads]
            if index == 0:
                break
            below = self._units[index - 1]
            here = self._units[index]
            partial = delta @ W.T  # this partition's share of dloss/dA of the whole layer below
            if delta.shape[1]:
                for m in range(K):
                    lo, hi = below[m]
                    if m != k and hi > lo:
                        yield Send(m, f"d{index}", np.ascontiguousarray(partial[:, lo:hi]))
            lo, hi = below[k]
            dA = partial[:, lo:hi].copy()
            if hi > lo:
                for m in range(K):
                    if m != k and here[m][1] > here[m][0]:
                        got = yield Recv(m, f"d{index}")
                        assert got is not None
                        dA += got
            backprop_activation_(dA, own[index - 1], act)
            delta = dA
        if out is None:
            return loss, np.concatenate(grads) if grads else np.zeros(0)
        return loss, np.concatenate(grads, out=out) if grads else out


class _SpatialPlan(_PlanBase):
    """A locally connected model split spatially into bands of *units* along one axis, with halo exchange.

    A unit is a unit of a 1-D layer, or a whole row of a 2-D map (its width x channels values): partition
    ``k`` owns units ``lo:hi`` of every local layer and their parameters, then the output weights of its
    last-layer units (and, partition 0 only, the output biases). Layer ``l``'s unit ``j`` reads units
    ``j*stride .. j*stride + field - 1`` of layer ``l - 1``, so only the units of the neighbours that those
    windows reach (the halo) cross, forward (``h``) and as input-gradients backward (``g``). The subclasses
    give the geometry and the block computation of a layer.
    """

    model: LocallyConnected | LocallyConnected2D

    def __init__(self, model: LocallyConnected | LocallyConnected2D, partitions: int) -> None:
        super().__init__(partitions)
        self.model = model
        self._units = [_split(self._n_units(layer), self._k) for layer in range(1, self._n_layers + 1)]
        self._finish()

    # -- geometry and block computation: the subclasses' part ------------------------------------------
    @property
    def _n_layers(self) -> int:
        raise NotImplementedError

    def _n_units(self, layer: int) -> int:
        """Units of layer ``layer`` (0: the input) along the split axis."""
        raise NotImplementedError

    def _unit_size(self, layer: int) -> int:
        """Values per unit of layer ``layer`` (0: the input)."""
        raise NotImplementedError

    def _window(self, layer: int) -> tuple[int, int]:
        """``(field, stride)`` of local layer ``layer`` along the split axis, in units of the layer below."""
        raise NotImplementedError

    def _unit_params(self, layer: int) -> tuple[int, int]:
        """``(weights, biases)`` of one unit of local layer ``layer``."""
        raise NotImplementedError

    def _block(self, layer: int, w: FloatArray, b: FloatArray, units: int) -> tuple[FloatArray, FloatArray]:
        """``(W, b)`` of ``units`` units of local layer ``layer`` from their flat slices."""
        raise NotImplementedError

    def _forward(self, layer: int, A: FloatArray, W: FloatArray, b: FloatArray) -> FloatArray:
        """Pre-activations (flat, rows x units*unit size) of a block on its input ``A`` (flat)."""
        raise NotImplementedError

    def _backward(
        self,
        layer: int,
        A: FloatArray,
        W: FloatArray,
        delta: FloatArray,
        need_input: bool,
        dW: FloatArray,
        db: FloatArray,
    ) -> FloatArray | None:
        """Gradients of :meth:`_forward` for the flat ``delta``: ``dW`` and ``db`` (blocks shaped as
        :meth:`_block`'s) written in place, the flat ``dA`` (or None) returned."""
        raise NotImplementedError

    # -- the plan ------------------------------------------------------------------------------------
    def _sizes(self) -> list[int]:
        C, L = self.model.n_classes, self._n_layers
        sizes = []
        for k in range(self._k):
            n = 0
            for layer in range(1, L + 1):
                lo, hi = self._units[layer - 1][k]
                pw, pb = self._unit_params(layer)
                n += (hi - lo) * (pw + pb)
            lo, hi = self._units[-1][k]
            n += (hi - lo) * self._unit_size(L) * C + (C if k == 0 else 0)
            sizes.append(n)
        return sizes

    def _perms(self) -> list[IntArray]:
        offsets, C, L = self.model.offsets, self.model.n_classes, self._n_layers
        perms: list[IntArray] = []
        for k in range(self._k):
            parts: list[IntArray] = []
            for layer in range(1, L + 1):
                a, b, _ = offsets[layer - 1]
                lo, hi = self._units[layer - 1][k]
                pw, pb = self._unit_params(layer)
                parts += [np.arange(a + lo * pw, a + hi * pw), np.arange(b + lo * pb, b + hi * pb)]
            a, b, c = offsets[-1]
            lo, hi = self._units[-1][k]
            size = self._unit_size(L) * C
            parts.append(np.arange(a + lo * size, a + hi * size))
            if k == 0:
                parts.append(np.arange(b, c))
            perms.append(np.concatenate(parts).astype(np.int64))
        return perms

    def _need(self, layer: int, k: int) -> tuple[int, int]:
        """Units of layer ``layer - 1`` (0: the input) that partition ``k``'s units of ``layer`` read."""
        lo, hi = self._units[layer - 1][k]
        if hi == lo:
            return (0, 0)
        f, s = self._window(layer)
        return (lo * s, (hi - 1) * s + f)

    def input_columns(self, k: int) -> slice:
        """The input columns partition ``k``'s first-layer units read."""
        lo, hi = self._need(1, k)
        size = self._unit_size(0)
        return slice(lo * size, hi * size)

    def _overlap(self, layer: int, reader: int, owner: int) -> tuple[int, int]:
        """Units of layer ``layer - 1`` owned by ``owner`` that ``reader``'s units of ``layer`` read."""
        lo, hi = self._need(layer, reader)
        olo, ohi = self._units[layer - 2][owner]
        return (max(lo, olo), min(hi, ohi))

    def partition_pass(
        self, k: int, w_k: FloatArray, X_k: FloatArray, y: Any, *, out: FloatArray | None = None
    ) -> PartitionPass:
        """Partition ``k``'s forward and backward pass (halo exchanges; see the module docstring).

        The gradient slice is written into ``out`` (a new array when None), block by block where the
        kernels compute it: no concatenation of the blocks (a copy of the whole slice per step).
        """
        model, K, act = self.model, self._k, self.model.activation
        C, L = model.n_classes, self._n_layers
        rows = X_k.shape[0]

        def cols(lo: int, hi: int, base: int, layer: int) -> slice:
            size = self._unit_size(layer)
            return slice((lo - base) * size, (hi - base) * size)

        grad = np.empty(w_k.size) if out is None else _checked_out(out, w_k)
        layers: list[tuple[FloatArray, FloatArray]] = []
        grad_layers: list[tuple[FloatArray, FloatArray]] = []  # the same blocks of the gradient
        start = 0
        for layer in range(1, L + 1):
            width = self._units[layer - 1][k][1] - self._units[layer - 1][k][0]
            pw, pb = self._unit_params(layer)
            w_end, b_end = start + width * pw, start + width * (pw + pb)
            layers.append(self._block(layer, w_k[start:w_end], w_k[w_end:b_end], width))
            grad_layers.append(self._block(layer, grad[start:w_end], grad[w_end:b_end], width))
            start = b_end
        width = (self._units[-1][k][1] - self._units[-1][k][0]) * self._unit_size(L)
        W_out = w_k[start : start + width * C].reshape(width, C)
        b_out = w_k[start + width * C :]
        gW_out = grad[start : start + width * C].reshape(width, C)
        inputs: list[FloatArray] = [X_k]  # what each layer reads: its need range of the layer below
        own: list[FloatArray] = []
        for layer in range(1, L + 1):
            if layer > 1:
                A_own = own[-1]
                olo = self._units[layer - 2][k][0]
                for m in range(K):
                    lo, hi = self._overlap(layer, m, k)
                    if m != k and hi > lo:
                        part = A_own[:, cols(lo, hi, olo, layer - 1)]
                        yield Send(m, f"h{layer}", np.ascontiguousarray(part))
                nlo, nhi = self._need(layer, k)
                A_in = np.empty((rows, (nhi - nlo) * self._unit_size(layer - 1)))
                for m in range(K):
                    lo, hi = self._overlap(layer, k, m)
                    if hi <= lo:
                        continue
                    if m == k:
                        A_in[:, cols(lo, hi, nlo, layer - 1)] = A_own[:, cols(lo, hi, olo, layer - 1)]
                    else:
                        got = yield Recv(m, f"h{layer}")
                        assert got is not None
                        A_in[:, cols(lo, hi, nlo, layer - 1)] = got
                inputs.append(A_in)
            W, b = layers[layer - 1]
            A = self._forward(layer, inputs[-1], W, b)
            activate_(A, act)
            own.append(A)
        Z_k = own[-1] @ W_out
        loss: float | None = None
        if k == 0:
            Z = Z_k + b_out
            for m in range(1, K):
                got = yield Recv(m, "z")
                assert got is not None
                Z += got
            labels = _checks.class_labels(_checks.as_targets(y, rows, model._name), C, model._name)
            loss = softmax_xent_(Z, labels)
            for m in range(1, K):
                yield Send(m, "dz", Z)
            dZ = Z
        else:
            yield Send(0, "z", Z_k)
            got = yield Recv(0, "dz")
            assert got is not None
            dZ = got
        np.matmul(own[-1].T, dZ, out=gW_out)
        if k == 0:
            np.sum(dZ, axis=0, out=grad[start + width * C :])
        dA = dZ @ W_out.T
        for layer in range(L, 0, -1):
            backprop_activation_(dA, own[layer - 1], act)
            d_in = self._backward(
                layer, inputs[layer - 1], layers[layer - 1][0], dA, layer > 1, *grad_layers[layer - 1]
            )
            if d_in is None:
                break
            nlo, _ = self._need(layer, k)
            olo, ohi = self._units[layer - 2][k]
            for m in range(K):
                lo, hi = self._overlap(layer, k, m)
                if m != k and hi > lo:
                    part = d_in[:, cols(lo, hi, nlo, layer - 1)]
                    yield Send(m, f"g{layer}", np.ascontiguousarray(part))
            dA = np.zeros((rows, (ohi - olo) * self._unit_size(layer - 1)))
            for m in range(K):
                lo, hi = self._overlap(layer, m, k)
                if hi <= lo:
                    continue
                if m == k:
                    dA[:, cols(lo, hi, olo, layer - 1)] += d_in[:, cols(lo, hi, nlo, layer - 1)]
                else:
                    got = yield Recv(m, f"g{layer}")
                    assert got is not None
                    dA[:, cols(lo, hi, olo, layer - 1)] += got
        return loss, grad


class LocallyConnectedPlan(_SpatialPlan):
    """:class:`models.LocallyConnected` split spatially: partition ``k`` owns units ``lo:hi`` of every layer.

    Its slice holds, per local layer, the rows ``W_l[lo:hi]`` and ``b_l[lo:hi]``, then the rows of the output
    weights that its last-layer units feed, then (partition 0 only) the output biases. Input columns it
    needs: the receptive fields of its first-layer units (``input_columns``).

    Examples
    --------
    >>> plan = LocallyConnectedPlan(LocallyConnected(12, 2, fields=[3], strides=[1]), 2)
    >>> plan.input_columns(1)
    slice(5, 12, None)
    """

    model: LocallyConnected

    def __init__(self, model: LocallyConnected, partitions: int) -> None:
        super().__init__(model, partitions)

    @property
    def _n_layers(self) -> int:
        return len(self.model.fields)

    def _n_units(self, layer: int) -> int:
        return self.model.widths[layer]

    def _unit_size(self, layer: int) -> int:
        return 1

    def _window(self, layer: int) -> tuple[int, int]:
        return self.model.fields[layer - 1], self.model.strides[layer - 1]

    def _unit_params(self, layer: int) -> tuple[int, int]:
        return self.model.fields[layer - 1], 1

    def _block(self, layer: int, w: FloatArray, b: FloatArray, units: int) -> tuple[FloatArray, FloatArray]:
        return w.reshape(units, self.model.fields[layer - 1]), b

    def _forward(self, layer: int, A: FloatArray, W: FloatArray, b: FloatArray) -> FloatArray:
        return local_forward(A, W, b, self.model.strides[layer - 1])

    def _backward(
        self,
        layer: int,
        A: FloatArray,
        W: FloatArray,
        delta: FloatArray,
        need_input: bool,
        dW: FloatArray,
        db: FloatArray,
    ) -> FloatArray | None:
        dW[...], db[...], dA = local_backward(
            A, W, delta, self.model.strides[layer - 1], need_input=need_input
        )
        return dA


class LocallyConnected2DPlan(_SpatialPlan):
    """:class:`models.LocallyConnected2D` split into row bands: partition ``k`` owns map rows ``lo:hi`` of
    every local layer (all their columns and filters).

    A band of rows is a contiguous block of the row-major ``(height, width, channels)`` layout, so a
    partition's input is one slice of ``X`` and its parameters are one range of every ``W_l``, ``b_l`` and of
    the output weights. Only the rows a neighbour's patches reach cross (``ph - sh`` rows of each neighbour
    at most, per layer and direction). Bands rather than tiles: a tile grid would cut every boundary twice
    (more messages, up to 8 neighbours instead of 2) and make a partition's input a strided gather; with
    K <= the map's height, bands send the fewest messages.

    Examples
    --------
    >>> plan = LocallyConnected2DPlan(LocallyConnected2D((8, 8), 10, patches=[3]), 2)
    >>> plan.input_columns(0), plan.input_columns(1)  # rows 0-4 and 3-7 of the 8 x 8 image
    (slice(0, 40, None), slice(24, 64, None))
    """

    model: LocallyConnected2D

    def __init__(self, model: LocallyConnected2D, partitions: int) -> None:
        super().__init__(model, partitions)

    @property
    def _n_layers(self) -> int:
        return len(self.model.patches)

    def _n_units(self, layer: int) -> int:
        return self.model.shapes[layer][0]

    def _unit_size(self, layer: int) -> int:
        _, w, c = self.model.shapes[layer]
        return w * c

    def _window(self, layer: int) -> tuple[int, int]:
        return self.model.patches[layer - 1][0], self.model.strides[layer - 1][0]

    def _unit_params(self, layer: int) -> tuple[int, int]:
        (ph, pw), c = self.model.patches[layer - 1], self.model.shapes[layer - 1][2]
        _, w2, f = self.model.shapes[layer]
        return w2 * ph * pw * c * f, w2 * f

    def _block(self, layer: int, w: FloatArray, b: FloatArray, units: int) -> tuple[FloatArray, FloatArray]:
        (ph, pw), c = self.model.patches[layer - 1], self.model.shapes[layer - 1][2]
        _, w2, f = self.model.shapes[layer]
        return w.reshape(units, w2, ph, pw, c, f), b.reshape(units, w2, f)

    def _forward(self, layer: int, A: FloatArray, W: FloatArray, b: FloatArray) -> FloatArray:
        _, w, c = self.model.shapes[layer - 1]
        # Heights spelled out: reshape cannot infer a -1 for no rows.
        Z = local2d_forward(
            A.reshape(A.shape[0], A.shape[1] // (w * c), w, c), W, b, self.model.strides[layer - 1]
        )
        return Z.reshape(A.shape[0], int(np.prod(Z.shape[1:])))

    def _backward(
        self,
        layer: int,
        A: FloatArray,
        W: FloatArray,
        delta: FloatArray,
        need_input: bool,
        dW: FloatArray,
        db: FloatArray,
    ) -> FloatArray | None:
        _, w, c = self.model.shapes[layer - 1]
        rows = A.shape[0]
        _, db[...], dA = local2d_backward(
            A.reshape(rows, A.shape[1] // (w * c), w, c),
            W,
            delta.reshape(rows, *W.shape[:2], W.shape[5]),
            self.model.strides[layer - 1],
            need_input=need_input,
            dW=dW,
        )
        return None if dA is None else dA.reshape(rows, A.shape[1])


AnyPlan = MLPPlan | LocallyConnectedPlan | LocallyConnected2DPlan


def max_partitions(model: Model) -> int:
    """The most partitions ``model`` can be split into with every partition owning a unit of every layer.

    An MLP: its narrowest layer after the input; a locally connected network: its narrowest local layer
    (1-D) or its shortest map (2-D, bands of rows); a model without a partitioned form: 1.

    Examples
    --------
    >>> max_partitions(LocallyConnected2D((8, 8), 10, patches=[3, 3])), max_partitions(MLP([3, 4, 2]))
    (4, 2)
    """
    if isinstance(model, MLP):
        return min(model.layer_sizes[1:])
    if isinstance(model, LocallyConnected):
        return min(model.widths[1:])
    if isinstance(model, LocallyConnected2D):
        return min(h for h, _, _ in model.shapes[1:])
    return 1


def partition_plan(model: Model, partitions: int) -> AnyPlan:
    """The partition plan of a built-in model that can be split by units.

    Raises
    ------
    distbelief.errors.InvalidOptionError
        For a model without a partitioned form (the linear models: use ``partitions=1``).

    Examples
    --------
    >>> partition_plan(MLP([3, 4, 2]), 2).partitions
    2
    """
    if isinstance(model, MLP):
        return MLPPlan(model, partitions)
    if isinstance(model, LocallyConnected):
        return LocallyConnectedPlan(model, partitions)
    if isinstance(model, LocallyConnected2D):
        return LocallyConnected2DPlan(model, partitions)
    raise InvalidOptionError(
        f"{type(model).__name__} cannot be partitioned; model parallelism supports models.MLP, "
        "models.LocallyConnected and models.LocallyConnected2D (use partitions=1 for other models)"
    )


def run_partitioned(plan: AnyPlan, w: FloatArray, X: FloatArray, y: Any) -> tuple[float, FloatArray, Traffic]:
    """Run the K partition passes in one process, delivering their messages; loss, gradient and traffic.

    ``w`` and the returned gradient are in the model's own layout (not partition-major).

    Raises
    ------
    distbelief.errors.ProtocolError
        If the passes wait for messages nobody sends (a bug in a plan).

    Examples
    --------
    >>> m = MLP([3, 4, 2]); w = m.init_params(0); X = np.ones((2, 3)); y = np.array([0, 1])
    >>> loss, grad, traffic = run_partitioned(MLPPlan(m, 2), w, X, y)
    >>> bool(np.allclose(grad, m.loss_and_grad(w, X, y)[1])), traffic.messages
    (True, 6)
    """
    K = plan.partitions
    w_perm = np.asarray(w, dtype=np.float64)[plan.perm]
    X_arr = np.asarray(X, dtype=np.float64)
    gens = [
        plan.partition_pass(
            k, w_perm[plan.bounds[k] : plan.bounds[k + 1]], X_arr[:, plan.input_columns(k)], y
        )
        for k in range(K)
    ]
    mailbox: dict[tuple[int, int, str], FloatArray] = {}
    waiting: list[Recv | None] = [None] * K
    results: list[tuple[float | None, FloatArray] | None] = [None] * K
    traffic = Traffic()

    def advance(k: int, value: FloatArray | None) -> None:
        try:
            op = gens[k].send(value)
            while isinstance(op, Send):
                traffic.add(op)
                mailbox[(op.dest, k, op.tag)] = op.array
                op = gens[k].send(None)
            waiting[k] = op
        except StopIteration as stop:
            results[k] = stop.value
            waiting[k] = None

    for k in range(K):
        advance(k, None)
    while any(r is None for r in results):
        progressed = False
        for k in range(K):
            op = waiting[k]
            if op is not None and (k, op.src, op.tag) in mailbox:
                advance(k, mailbox.pop((k, op.src, op.tag)))
                progressed = True
        if not progressed:
            raise ProtocolError(f"partition passes deadlocked waiting for {waiting}")
    grad = np.empty(w_perm.size)
    grad[plan.perm] = np.concatenate([r[1] for r in results if r is not None])
    loss = results[0][0] if results[0] is not None else None
    assert loss is not None
    return float(loss), grad, traffic


class PartitionedModel:
    """A model whose ``loss_and_grad`` runs its K partition passes in this process, counting their messages.

    The same numbers as the whole model (to rounding), so any optimizer can run on a partitioned replica
    unchanged (e.g. ``sandblaster.minimize(PartitionedModel(model, 2), ...)`` computes every portion through
    the partitions); ``traffic`` accumulates what the partitions exchanged. The partitions run in one
    process here: spreading them over workers is what ``downpour.train(partitions=K)`` does.

    Examples
    --------
    >>> pm = PartitionedModel(MLP([3, 4, 2]), 2)
    >>> loss, grad = pm.loss_and_grad(pm.init_params(0), np.ones((2, 3)), [0, 1])
    >>> pm.traffic.messages, pm.n_params
    (6, 26)
    """

    def __init__(self, model: MLP | LocallyConnected | LocallyConnected2D, partitions: int) -> None:
        self.model = model
        self.plan = partition_plan(model, partitions)
        self.traffic = Traffic()

    def loss_and_grad(self, w: Any, X: Any, y: Any) -> tuple[float, FloatArray]:
        """Summed loss and gradient, computed by the K partitions (``w`` in the model's own layout)."""
        w_arr = _checks.as_params(w, self.model.n_params, type(self.model).__name__)
        X_arr = _checks.as_rows(X, self.model.n_features, type(self.model).__name__)
        loss, grad, traffic = run_partitioned(self.plan, w_arr, X_arr, y)
        self.traffic.merge(traffic)
        return loss, grad

    def __getattr__(self, name: str) -> Any:
        # n_params, init_params, predict, accuracy, check_labels, spec, label_kind, ...: the whole model's.
        if name in ("model", "plan", "traffic"):
            raise AttributeError(name)
        return getattr(self.model, name)
