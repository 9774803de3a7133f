"""A multilayer perceptron with softmax cross-entropy output, on one flat parameter vector.

Forward pass ``A_0 = X``, ``A_l = f(A_{l-1} @ W_l + b_l)`` for the hidden layers, logits
``Z = A_{L-1} @ W_L + b_L``; gradient by backpropagation (Rumelhart, Hinton & Williams 1986; see Goodfellow,
Bengio & Courville, *Deep Learning*, section 6.5). Initialization: Glorot uniform for sigmoid/tanh and the
output layer (Glorot & Bengio, AISTATS 2010), He normal for ReLU layers (He et al., ICCV 2015); biases zero.
DistBelief (Dean et al. 2012, section 3) trains exactly such models, with their parameters sharded across the
parameter server, which is why everything lives in one flat vector here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np
from numpy.typing import ArrayLike, NDArray

from . import _checks
from ._base import ClassifierBase, softmax_
from ._checks import LabelKind
from ._linear import softmax_xent_, softmax_xent_rows
from ._local import activate_
from ._specs import MLPSpec, validate_spec

__all__ = ["MLP"]

FloatArray = NDArray[np.float64]


class MLP(ClassifierBase):
    """Multilayer perceptron classifier: hidden layers with ``activation``, softmax cross-entropy output.

    Parameter layout (one flat float64 vector): for each layer ``l = 1..L`` in order, the weights
    ``W_l`` of shape ``(layer_sizes[l-1], layer_sizes[l])`` stored row-major, then the biases ``b_l`` of
    shape ``(layer_sizes[l],)``::

        w = [W_1.ravel(), b_1, W_2.ravel(), b_2, ..., W_L.ravel(), b_L]

    :meth:`unpack` returns these as views. ``layer_sizes == [n_features, n_classes]`` (no hidden layer)
    is softmax regression with the same layout as :class:`models.Softmax`.

    Parameters
    ----------
    layer_sizes : sequence of int or 1-D integer array
        ``[n_features, hidden_1, ..., n_classes]``: at least two positive sizes, the last >= 2.
    activation : {"sigmoid", "tanh", "relu"}, optional
        Activation of the hidden layers. Default ``"sigmoid"``.

    Raises
    ------
    distbelief.errors.ModelSpecError
        If a size is not a positive integer, there are fewer than two sizes, fewer than two classes, or the
        activation is unknown.

    Examples
    --------
    >>> import numpy as np
    >>> m = MLP([4, 8, 3], activation="tanh")
    >>> m.n_params  # (4*8 + 8) + (8*3 + 3)
    67
    >>> w = m.init_params(seed=0)
    >>> X, y = np.random.default_rng(0).normal(size=(5, 4)), np.array([0, 1, 2, 1, 0])
    >>> loss, grad = m.loss_and_grad(w, X, y)
    >>> grad.shape, m.predict(w, X).shape
    ((67,), (5,))
    """

    kind: ClassVar[str] = "mlp"
    label_kind: ClassVar[LabelKind] = "classes"
    _name: ClassVar[str] = "MLP"

    def __init__(
        self, layer_sizes: Sequence[int] | NDArray[np.integer[Any]], *, activation: str = "sigmoid"
    ) -> None:
        # Tuples and arrays are fine in Python; the spec stores a list (and rejects a string).
        sizes: Any = layer_sizes
        if isinstance(layer_sizes, Sequence | np.ndarray) and not isinstance(layer_sizes, str | bytes):
            sizes = list(layer_sizes)
        spec = validate_spec({"kind": self.kind, "layer_sizes": sizes, "activation": activation})
        assert isinstance(spec, MLPSpec)
        self._sizes: tuple[int, ...] = tuple(spec.layer_sizes)
        self._activation: str = spec.activation
        # (start of W_l, start of b_l, end of b_l) for every layer.
        self._offsets: list[tuple[int, int, int]] = []
        start = 0
        for fan_in, fan_out in zip(self._sizes[:-1], self._sizes[1:], strict=True):
            self._offsets.append((start, start + fan_in * fan_out, start + fan_in * fan_out + fan_out))
            start += fan_in * fan_out + fan_out
        self._n_params = start

    @property
    def layer_sizes(self) -> tuple[int, ...]:
        """``(n_features, hidden_1, ..., n_classes)``."""
        return self._sizes

    @property
    def activation(self) -> str:
        """Hidden-layer activation: ``"sigmoid"``, ``"tanh"`` or ``"relu"``."""
        return self._activation

    @property
    def n_params(self) -> int:
        """Total number of weights and biases."""
        return self._n_params

    @property
    def n_features(self) -> int:
        """Input size, ``layer_sizes[0]``."""
        return self._sizes[0]

    @property
    def n_classes(self) -> int:
        """Output size, ``layer_sizes[-1]``."""
        return self._sizes[-1]

    @property
    def spec(self) -> dict[str, Any]:
        """``{"kind": "mlp", "layer_sizes": [...], "activation": ...}``."""
        return {"kind": self.kind, "layer_sizes": list(self._sizes), "activation": self._activation}

    def unpack(self, w: ArrayLike) -> list[tuple[FloatArray, FloatArray]]:
        """Views ``[(W_1, b_1), ..., (W_L, b_L)]`` into ``w`` (writing to them writes to ``w``).

        Examples
        --------
        >>> [(W.shape, b.shape) for W, b in MLP([3, 5, 2]).unpack(np.zeros(32))]
        [((3, 5), (5,)), ((5, 2), (2,))]
        """
        w_arr = _checks.as_params(w, self._n_params, self._name)
        return self._layers(w_arr)

    def _layers(self, w: FloatArray) -> list[tuple[FloatArray, FloatArray]]:
        return [
            (w[a:b].reshape(fan_in, fan_out), w[b:c])
            for (a, b, c), fan_in, fan_out in zip(
                self._offsets, self._sizes[:-1], self._sizes[1:], strict=True
            )
        ]

    def init_params(self, seed: int | None = None) -> FloatArray:
        """Random weights scaled to keep activations in range, zero biases.

        Glorot uniform ``U(-sqrt(6 / (fan_in + fan_out)), +...)`` for sigmoid/tanh layers and the output
        layer; He normal ``N(0, 2 / fan_in)`` for ReLU layers. (Hidden units must differ: a zero start
        would keep them identical forever.)

        Parameters
        ----------
        seed : int, optional
            Seed of ``numpy.random.default_rng``; the same seed gives the same vector.

        Returns
        -------
        ndarray, shape (n_params,)

        Examples
        --------
        >>> m = MLP([2, 3, 2])
        >>> bool((m.init_params(seed=1) == m.init_params(seed=1)).all())
        True
        """
        rng = np.random.default_rng(seed)
        w = np.zeros(self._n_params)
        layers = self._layers(w)
        for index, (W, _) in enumerate(layers):
            fan_in, fan_out = W.shape
            if self._activation == "relu" and index < len(layers) - 1:
                W[...] = rng.normal(0.0, np.sqrt(2.0 / fan_in), size=W.shape)
            else:
                limit = np.sqrt(6.0 / (fan_in + fan_out))
                W[...] = rng.uniform(-limit, limit, size=W.shape)
        return w

    def _backprop_activation_(self, delta: FloatArray, A: FloatArray) -> None:
        """``delta *= f'(Z)``, with the derivative expressed through the activation ``A = f(Z)``.

        Overwrites ``A``, which the backward pass no longer needs once this layer is done.
        """
        if self._activation == "sigmoid":
            A *= 1.0 - A  # sigmoid' = a (1 - a)
            delta *= A
        elif self._activation == "tanh":
            np.square(A, out=A)  # tanh' = 1 - a^2
            np.subtract(1.0, A, out=A)
            delta *= A
        else:
            delta *= A > 0.0  # relu' = 1 where a > 0 (0 at the kink)

    def _forward(self, w: ArrayLike, X: ArrayLike) -> tuple[FloatArray, list[FloatArray]]:
        """Checked parameters, then the inputs of every layer ``[X, A_1, ..., A_{L-1}]`` and the logits."""
        w_arr = _checks.as_params(w, self._n_params, self._name)
        X_arr = _checks.as_rows(X, self._sizes[0], self._name)
        layers = self._layers(w_arr)
        inputs = [X_arr]
        for W, b in layers[:-1]:
            A = inputs[-1] @ W
            A += b
            activate_(A, self._activation)
            inputs.append(A)
        W, b = layers[-1]
        Z = inputs[-1] @ W
        Z += b
        inputs.append(Z)
        return w_arr, inputs

    def loss_and_grad(
        self, w: ArrayLike, X: ArrayLike, y: ArrayLike, *, sample_weight: ArrayLike | None = None
    ) -> tuple[float, FloatArray]:
        """Summed cross-entropy over the rows and its gradient by backpropagation: as
        :meth:`Softmax.loss_and_grad` (its arguments, loss and errors)
        with ``Z`` the output layer's logits, and the gradient in the layout of the class docstring.

        Examples
        --------
        >>> m = MLP([1, 2, 2], activation="relu")
        >>> loss, grad = m.loss_and_grad(np.zeros(m.n_params), [[1.0]], [0])
        >>> round(loss, 6)
        0.693147
        """
        w_arr, inputs = self._forward(w, X)
        X_arr = inputs[0]
        y_raw = _checks.as_targets(y, X_arr.shape[0], self._name)
        labels = _checks.class_labels(y_raw, self._sizes[-1], self._name)
        delta = inputs.pop()
        if sample_weight is None:
            loss = softmax_xent_(delta, labels)  # delta = dloss/dZ of the output layer
        else:
            s = _checks.as_weights(sample_weight, X_arr.shape[0], self._name)
            losses, delta = softmax_xent_rows(labels, delta)
            delta *= s[:, None]  # each row's part of the gradient, weighted, is backpropagated as it is
            loss = float(s @ losses)
        grad = np.empty(self._n_params)
        layers = self._layers(w_arr)
        grad_layers = self._layers(grad)
        ones = np.ones(X_arr.shape[0])
        for index in range(len(layers) - 1, -1, -1):
            A = inputs[index]
            gW, gb = grad_layers[index]
            np.matmul(A.T, delta, out=gW)
            np.matmul(ones, delta, out=gb)  # column sums; BLAS is several times faster than sum(axis=0)
            if index > 0:  # no gradient with respect to X is needed
                delta_below = delta @ layers[index][0].T
                self._backprop_activation_(delta_below, A)
                delta = delta_below
        if not np.isfinite(loss):
            loss = _checks.diagnose_nonfinite(loss, X_arr, y_raw, self._name)
        return loss, grad

    def predict_proba(self, w: ArrayLike, X: ArrayLike) -> FloatArray:
        """Class probabilities, shape (n_rows, n_classes); each row sums to 1.

        Examples
        --------
        >>> m = MLP([1, 2, 2])
        >>> m.predict_proba(np.zeros(m.n_params), [[3.0]])
        array([[0.5, 0.5]])
        """
        return softmax_(self._logits(w, X))

    def _logits(self, w: ArrayLike, X: ArrayLike) -> FloatArray:
        return self._forward(w, X)[1][-1]
