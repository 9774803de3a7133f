"""A locally connected network: local receptive fields, no weight sharing (paper, section 3 and Figure 1).

DistBelief's image models are "locally connected": every unit of a layer sees a small window of the layer
below and has weights of its own (no convolution-style sharing). That is what makes model parallelism pay
off (section 3): a partition that owns a contiguous range of units needs only the *boundary* units of its
neighbours. This is the 1-D form: layer ``l`` has ``n_l = (n_{l-1} - field_l) // stride_l + 1`` units, unit
``j`` reads inputs ``j*stride_l .. j*stride_l + field_l - 1``; a dense softmax output layer follows.
The partitioned form is :class:`models.LocallyConnectedPlan` (``models/_partitioned.py``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, ClassVar

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view
from numpy.typing import ArrayLike, NDArray
from scipy.special import expit

from distbelief.errors import ModelSpecError

from . import _checks
from ._base import ClassifierBase
from ._checks import LabelKind
from ._linear import softmax_xent_

__all__ = [
    "LocallyConnected",
    "activate_",
    "backprop_activation_",
    "local_backward",
    "local_forward",
    "per_layer",
]

FloatArray = NDArray[np.float64]
_ACTIVATIONS = ("sigmoid", "tanh", "relu")


def per_layer(name: str, value: Any) -> list[Any]:
    """``value`` as a list with one entry per local layer, or a :class:`ModelSpecError` showing the form."""
    if isinstance(value, str | bytes) or not isinstance(value, Iterable):
        raise ModelSpecError(f"{name} must be a list with one entry per local layer, e.g. [3], got {value!r}")
    return list(value)


def activate_(Z: FloatArray, activation: str) -> None:
    """Apply ``activation`` to ``Z`` in place."""
    if activation == "sigmoid":
        expit(Z, out=Z)
    elif activation == "tanh":
        np.tanh(Z, out=Z)
    else:
        np.maximum(Z, 0.0, out=Z)


def backprop_activation_(delta: FloatArray, A: FloatArray, activation: str) -> None:
    """``delta *= f'(Z)`` with the derivative written through ``A = f(Z)`` (``A`` is left untouched)."""
    if activation == "sigmoid":
        delta *= A * (1.0 - A)
    elif activation == "tanh":
        delta *= 1.0 - A * A
    else:
        delta *= A > 0.0


def local_forward(A: FloatArray, W: FloatArray, b: FloatArray, stride: int) -> FloatArray:
    """Pre-activations of ``W.shape[0]`` local units whose windows start at ``0, stride, 2*stride, ...`` of A.

    ``W`` has shape ``(units, field)``; ``A`` holds (at least) the inputs those windows cover.
    """
    units, field = W.shape
    if units == 0:
        return np.zeros((A.shape[0], 0))
    windows = sliding_window_view(A, field, axis=1)[:, ::stride][:, :units]
    Z: FloatArray = np.einsum("rjt,jt->rj", windows, W)
    Z += b
    return Z


def local_backward(
    A: FloatArray, W: FloatArray, delta: FloatArray, stride: int, *, need_input: bool
) -> tuple[FloatArray, FloatArray, FloatArray | None]:
    """Gradients of :func:`local_forward`: ``(dW, db, dA or None)`` for ``delta = dloss/dZ``."""
    units, field = W.shape
    if units == 0:
        return np.zeros((0, field)), np.zeros(0), np.zeros_like(A) if need_input else None
    windows = sliding_window_view(A, field, axis=1)[:, ::stride][:, :units]
    gW: FloatArray = np.einsum("rj,rjt->jt", delta, windows)
    gb: FloatArray = delta.sum(axis=0)
    if not need_input:
        return gW, gb, None
    dA = np.zeros_like(A)
    last = stride * (units - 1) + 1
    for t in range(field):
        dA[:, t : t + last : stride] += delta * W[:, t]
    return gW, gb, dA


def _positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        raise ModelSpecError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


class _LocalNetwork(ClassifierBase):
    """What :class:`LocallyConnected` and ``LocallyConnected2D`` share (private).

    Both are local layers then a dense softmax output layer, every ``(W, b)`` one contiguous range of the
    flat vector; they differ only in the geometry of a local layer (:meth:`_layer_forward`,
    :meth:`_layer_backward`, :meth:`_local_fans`) and of the input (:attr:`_input_shape`). A subclass's
    ``__init__`` sets ``_n_classes``, ``_strides`` and ``_activation`` and calls :meth:`_set_layout`.
    """

    label_kind: ClassVar[LabelKind] = "classes"
    _n_classes: int
    _activation: str
    _strides: tuple[Any, ...]
    _param_shapes: list[tuple[tuple[int, ...], tuple[int, ...]]]
    _offsets: list[tuple[int, int, int]]
    _n_params: int

    # ------------------------------------------------------------------ what a geometry provides
    @property
    def _input_shape(self) -> tuple[int, ...]:  # pragma: no cover - overridden
        raise NotImplementedError

    def _layer_forward(self, A: FloatArray, W: FloatArray, b: FloatArray, stride: Any) -> FloatArray:
        raise NotImplementedError  # pragma: no cover - overridden

    def _layer_backward(
        self, A: FloatArray, W: FloatArray, delta: FloatArray, stride: Any, *, need_input: bool
    ) -> tuple[FloatArray, FloatArray, FloatArray | None]:
        raise NotImplementedError  # pragma: no cover - overridden

    def _local_fans(self, W: FloatArray) -> tuple[int, int]:
        """``(fan_in, fan_out)`` of a local layer's weights ``W`` (Glorot's limit)."""
        raise NotImplementedError  # pragma: no cover - overridden

    # ------------------------------------------------------------------ checks and layout
    @staticmethod
    def _checked_classes(n_classes: Any) -> int:
        k = _positive("n_classes", n_classes)
        if k < 2:
            raise ModelSpecError(f"n_classes must be >= 2, got {n_classes}; use 2 for binary labels")
        return k

    @staticmethod
    def _checked_activation(activation: str) -> str:
        if activation not in _ACTIVATIONS:
            raise ModelSpecError(f"unknown activation {activation!r}; valid: {', '.join(_ACTIVATIONS)}")
        return activation

    def _set_layout(self, param_shapes: Sequence[tuple[tuple[int, ...], tuple[int, ...]]]) -> None:
        """Shapes of ``(W, b)`` of every layer, the output layer last; their ``(start W, start b, end b)``."""
        self._param_shapes = list(param_shapes)
        self._offsets = []
        start = 0
        for w_shape, b_shape in param_shapes:
            nw, nb = int(np.prod(w_shape)), int(np.prod(b_shape))
            self._offsets.append((start, start + nw, start + nw + nb))
            start += nw + nb
        self._n_params = start

    @property
    def n_params(self) -> int:
        """Total number of weights and biases."""
        return self._n_params

    @property
    def n_classes(self) -> int:
        """Number of classes."""
        return self._n_classes

    @property
    def activation(self) -> str:
        """Activation of the local layers."""
        return self._activation

    @property
    def offsets(self) -> tuple[tuple[int, int, int], ...]:
        """``(start of W, start of b, end of b)`` of every layer in the flat vector, the output layer last."""
        return tuple(self._offsets)

    def unpack(self, w: ArrayLike) -> list[tuple[FloatArray, FloatArray]]:
        """Views ``[(W_1, b_1), ..., (W_out, b_out)]`` into ``w``.

        Examples
        --------
        >>> [W.shape for W, _ in LocallyConnected(6, 2, fields=[3], strides=[1]).unpack(np.zeros(26))]
        [(4, 3), (4, 2)]
        >>> from distbelief.models import LocallyConnected2D
        >>> m = LocallyConnected2D((4, 4), 2, patches=[2], filters=[1])
        >>> [W.shape for W, _ in m.unpack(np.zeros(m.n_params))]
        [(3, 3, 2, 2, 1, 1), (9, 2)]
        """
        return self._layers(_checks.as_params(w, self._n_params, self._name))

    def _layers(self, w: FloatArray) -> list[tuple[FloatArray, FloatArray]]:
        return [
            (w[a:b].reshape(ws), w[b:c].reshape(bs))
            for (a, b, c), (ws, bs) in zip(self._offsets, self._param_shapes, strict=True)
        ]

    def init_params(self, seed: int | None = None) -> FloatArray:
        """Glorot uniform weights, zero biases; the same seed gives the same vector.

        A local layer's fan-in is its receptive field (times the channels in 2-D), its fan-out its filters
        per location (1 in 1-D).

        Examples
        --------
        >>> m = LocallyConnected(6, 2, fields=[3], strides=[1])
        >>> bool((m.init_params(1) == m.init_params(1)).all())
        True
        >>> from distbelief.models import LocallyConnected2D
        >>> m = LocallyConnected2D((4, 4), 2, patches=[2])
        >>> bool((m.init_params(1) == m.init_params(1)).all())
        True
        """
        rng = np.random.default_rng(seed)
        w = np.zeros(self._n_params)
        layers = self._layers(w)
        for index, (W, _) in enumerate(layers):
            fan_in, fan_out = W.shape if index == len(layers) - 1 else self._local_fans(W)
            limit = np.sqrt(6.0 / (fan_in + fan_out))
            W[...] = rng.uniform(-limit, limit, size=W.shape)
        return w

    # ------------------------------------------------------------------ passes
    def _forward(
        self, w: ArrayLike, X: ArrayLike
    ) -> tuple[list[tuple[FloatArray, FloatArray]], list[FloatArray]]:
        w_arr = _checks.as_params(w, self._n_params, self._name)
        X_arr = _checks.as_rows(X, self.n_features, self._name)
        layers = self._layers(w_arr)
        inputs = [X_arr.reshape(X_arr.shape[0], *self._input_shape)]
        for (W, b), stride in zip(layers[:-1], self._strides, strict=True):
            A = self._layer_forward(inputs[-1], W, b, stride)
            activate_(A, self._activation)
            inputs.append(A)
        W, b = layers[-1]
        # The width explicitly: reshape(0, -1) cannot infer it for no rows.
        inputs.append(inputs[-1].reshape(X_arr.shape[0], W.shape[0]) @ W + b)
        return layers, inputs

    def loss_and_grad(self, w: ArrayLike, X: ArrayLike, y: ArrayLike) -> tuple[float, FloatArray]:
        """Summed cross-entropy over the rows and its gradient by backpropagation.

        Examples
        --------
        >>> m = LocallyConnected(4, 2, fields=[2], strides=[2])
        >>> loss, _ = m.loss_and_grad(np.zeros(m.n_params), [[1.0, 2.0, 3.0, 4.0]], [1])
        >>> round(loss, 6)
        0.693147
        >>> from distbelief.models import LocallyConnected2D
        >>> m = LocallyConnected2D((2, 2), 2, patches=[2])
        >>> loss, _ = m.loss_and_grad(np.zeros(m.n_params), [[1.0, 2.0, 3.0, 4.0]], [1])
        >>> round(loss, 6)
        0.693147
        """
        layers, inputs = self._forward(w, X)
        rows = inputs[0].shape[0]
        labels = _checks.class_labels(_checks.as_targets(y, rows, self._name), self._n_classes, self._name)
        delta = np.ascontiguousarray(inputs.pop())
        loss = softmax_xent_(delta, labels)
        W_out = layers[-1][0]
        flat = inputs[-1].reshape(rows, W_out.shape[0])
        grads: list[FloatArray] = [(flat.T @ delta).ravel(), delta.sum(axis=0)]
        dA = (delta @ W_out.T).reshape(inputs[-1].shape)
        for index in range(len(layers) - 2, -1, -1):
            backprop_activation_(dA, inputs[index + 1], self._activation)
            gW, gb, dA_below = self._layer_backward(
                inputs[index], layers[index][0], dA, self._strides[index], need_input=index > 0
            )
            grads = [gW.ravel(), gb.ravel(), *grads]
            if dA_below is not None:
                dA = dA_below
        return loss, np.concatenate(grads)

    def _logits(self, w: ArrayLike, X: ArrayLike) -> FloatArray:
        return self._forward(w, X)[1][-1]


class LocallyConnected(_LocalNetwork):
    """1-D locally connected network (no weight sharing) with a dense softmax cross-entropy output layer.

    Parameter layout (one flat float64 vector): for every local layer ``W_l`` of shape ``(n_l, field_l)``
    (row ``j`` = unit ``j``'s own weights) then ``b_l`` ``(n_l,)``; then the output ``W`` ``(n_L, n_classes)``
    and ``b`` ``(n_classes,)``.

    Parameters
    ----------
    n_features : int
        Input width.
    n_classes : int
        Number of classes (>= 2).
    fields : sequence of int
        Receptive field of every local layer (at least one layer). Default one layer of field 5.
    strides : sequence of int, optional
        Stride of every local layer (same length as ``fields``); default 1 for each.
    activation : {"sigmoid", "tanh", "relu"}
        Activation of the local layers. Default ``"tanh"``.

    Raises
    ------
    distbelief.errors.ModelSpecError
        A size that is not a positive integer, a layer narrower than its field, fewer than two classes.

    Examples
    --------
    >>> m = LocallyConnected(10, 3, fields=[4], strides=[2])
    >>> m.widths  # (10 - 4) // 2 + 1 = 4 units
    (10, 4)
    >>> m.n_params  # 4*4 + 4, then 4*3 + 3
    35
    >>> w = m.init_params(seed=0)
    >>> loss, grad = m.loss_and_grad(w, np.ones((2, 10)), [0, 2])
    >>> grad.shape
    (35,)
    """

    kind: ClassVar[str] = "locally_connected"
    _name: ClassVar[str] = "locally connected network"

    def __init__(
        self,
        n_features: int,
        n_classes: int,
        *,
        fields: Sequence[int] = (5,),
        strides: Sequence[int] | None = None,
        activation: str = "tanh",
    ) -> None:
        self._n_features = _positive("n_features", n_features)
        self._n_classes = self._checked_classes(n_classes)
        fields = per_layer("fields", fields)  # read once: an iterator would be empty the second time
        self._fields = tuple(_positive("fields[]", f) for f in fields)
        strides = [1] * len(fields) if strides is None else per_layer("strides", strides)
        self._strides = tuple(_positive("strides[]", s) for s in strides)
        if not self._fields or len(self._fields) != len(self._strides):
            raise ModelSpecError(
                f"fields and strides must be non-empty and of the same length, got {list(fields)} and "
                f"{list(strides)}; give one (field, stride) per local layer"
            )
        self._activation = self._checked_activation(activation)
        widths = [self._n_features]
        for field, stride in zip(self._fields, self._strides, strict=True):
            if widths[-1] < field:
                raise ModelSpecError(
                    f"a layer of {widths[-1]} units cannot feed a receptive field of {field}; use smaller "
                    "fields or more features"
                )
            widths.append((widths[-1] - field) // stride + 1)
        self._widths = tuple(widths)
        # Unit j of a local layer has its own field's weights (row j of W_l) and one bias.
        self._set_layout(
            [((n, f), (n,)) for n, f in zip(widths[1:], self._fields, strict=True)]
            + [((widths[-1], self._n_classes), (self._n_classes,))]
        )

    @property
    def n_features(self) -> int:
        """Input width."""
        return self._n_features

    @property
    def fields(self) -> tuple[int, ...]:
        """Receptive field of every local layer."""
        return self._fields

    @property
    def strides(self) -> tuple[int, ...]:
        """Stride of every local layer."""
        return self._strides

    @property
    def widths(self) -> tuple[int, ...]:
        """``(n_features, n_1, ..., n_L)``: units of the input and of every local layer."""
        return self._widths

    @property
    def spec(self) -> dict[str, Any]:
        """``{"kind": "locally_connected", "n_features", "n_classes", "fields", "strides", "activation"}``."""
        return {
            "kind": self.kind,
            "n_features": self._n_features,
            "n_classes": self._n_classes,
            "fields": list(self._fields),
            "strides": list(self._strides),
            "activation": self._activation,
        }

    @property
    def _input_shape(self) -> tuple[int, ...]:
        return (self._n_features,)

    def _layer_forward(self, A: FloatArray, W: FloatArray, b: FloatArray, stride: int) -> FloatArray:
        return local_forward(A, W, b, stride)

    def _layer_backward(
        self, A: FloatArray, W: FloatArray, delta: FloatArray, stride: int, *, need_input: bool
    ) -> tuple[FloatArray, FloatArray, FloatArray | None]:
        return local_backward(A, W, delta, stride, need_input=need_input)

    def _local_fans(self, W: FloatArray) -> tuple[int, int]:
        return W.shape[1], 1  # a unit's field in; one unit out
