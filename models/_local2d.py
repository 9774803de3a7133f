"""A 2-D locally connected network: image patches, no weight sharing (paper, section 3 and Figure 1).

The paper's image models are locally connected over 2-D maps: every unit sees a ``ph x pw`` patch of all the
channels of the layer below and has weights of its own (a convolution *without* weight sharing). Layer ``l``
maps ``(h, w, c)`` to ``(h', w', F_l)`` with ``h' = (h - ph) // sh + 1`` and ``w' = (w - pw) // sw + 1``;
location ``(i, j)`` holds ``F_l`` filters of shape ``(ph, pw, c)``, reading rows ``i*sh .. i*sh + ph - 1`` and
columns ``j*sw .. j*sw + pw - 1``. A dense softmax output layer follows.

Why a class of its own rather than ``LocallyConnected(..., input_shape=(h, w))``: every geometric option
becomes a pair (patch, stride), a layer has channels and filters per location, and the spatial partition
plan splits *rows of the map* (bands) where the 1-D plan splits units; one class per geometry keeps both
specs strict and simple. Rows of ``X`` are images flattened row-major over ``(height, width, channels)``
(e.g. ``load_digits()``: 8 x 8, one channel). The partitioned form is
:class:`models.LocallyConnected2DPlan` (``models/_partitioned.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np
from numpy.lib.stride_tricks import as_strided, sliding_window_view
from numpy.typing import NDArray

from distbelief.errors import ModelSpecError

from ._local import _LocalNetwork, _positive, per_layer

__all__ = ["LocallyConnected2D", "local2d_backward", "local2d_forward"]

FloatArray = NDArray[np.float64]
Pair = tuple[int, int]


#: A patch row of fewer values than this (``pw * c``) is too narrow a matrix for BLAS (a 5 x 32 product per
#: location costs its call overhead): such a layer copies its whole patches instead (im2col), which is
#: cheap exactly then (``ph * pw * c`` values per location and row; 3.7 MB for the benchmark model's first
#: layer, where it made the forward and weight-gradient products 2-3x faster).
NARROW_ROW = 32


def _patch_blocks(A: FloatArray, W: FloatArray, stride: Pair) -> list[FloatArray]:
    """``A``'s patches as batched matrices ``(h', w', rows, K)``: one per patch row (``K = pw * c``, views),
    or one copy of the whole patches (``K = ph * pw * c``) for narrow rows (:data:`NARROW_ROW`).

    Location ``(i, j)``'s patch row ``a`` is ``A[:, i*sh + a, j*sw : j*sw + pw, :]``: ``pw * c`` values
    contiguous in every row of ``A`` (rows ``w * c`` apart), so each location's block is a plain strided
    matrix that BLAS reads in place. A whole ``ph x pw x c`` patch is not (its rows have gaps), which is why
    a layer is ``ph`` batched matrix products rather than one: copying all the patches (im2col) moves
    ``ph * pw / (sh * sw)`` times the input through memory every pass (82 MB a mini-batch for the 28 x 28
    benchmark model's second layer) and was most of a pass's time. :func:`_weight_blocks` cuts ``W`` to match.
    """
    h2, w2, ph, pw, c, _ = W.shape
    rows, _, _, c_in = A.shape
    if pw * c < NARROW_ROW and ph > 1:
        windows = sliding_window_view(A, (ph, pw), axis=(1, 2))[:, :: stride[0], :: stride[1]][:, :h2, :w2]
        patches = np.ascontiguousarray(windows.transpose(1, 2, 0, 4, 5, 3))  # (h', w', rows, ph, pw, c)
        return [patches.reshape(h2, w2, rows, ph * pw * c)]
    if A.strides[3] != A.itemsize or A.strides[2] != c_in * A.itemsize:
        A = np.ascontiguousarray(A)
    s_r, s_h, s_w, s_c = A.strides
    shape = (h2, w2, rows, pw * c)
    return [
        as_strided(A[:, a:], shape, (stride[0] * s_h, stride[1] * s_w, s_r, s_c), writeable=False)
        for a in range(ph)
    ]


def _weight_blocks(W: FloatArray, n_blocks: int) -> list[FloatArray]:
    """``W`` (or a gradient of its shape) cut as :func:`_patch_blocks` cut the patches into ``n_blocks``:
    ``(h', w', K, F)`` views (``ph``, ``pw``, ``c`` and ``F`` are contiguous in ``W``)."""
    h2, w2, ph, pw, c, f = W.shape
    if n_blocks == 1:
        return [W.reshape(h2, w2, ph * pw * c, f)]
    return [W[:, :, a].reshape(h2, w2, pw * c, f) for a in range(ph)]


def local2d_forward(A: FloatArray, W: FloatArray, b: FloatArray, stride: Pair) -> FloatArray:
    """Pre-activations ``(rows, h', w', F)`` of the local units ``W`` ``(h', w', ph, pw, c, F)`` on ``A``.

    ``A`` has shape ``(rows, h, w, c)`` and holds (at least) the rows the units' patches cover, starting at
    the first unit's first row; ``b`` has shape ``(h', w', F)``. The result is C-contiguous.

    Examples
    --------
    >>> A, W = np.ones((2, 3, 3, 1)), np.ones((2, 2, 2, 2, 1, 1))
    >>> local2d_forward(A, W, np.zeros((2, 2, 1)), (1, 1))[0, :, :, 0]  # each 2 x 2 patch summed
    array([[4., 4.],
           [4., 4.]])
    """
    h2, w2, _, _, _, f = W.shape
    Z = np.empty((A.shape[0], h2, w2, f))
    if Z.size == 0:
        return Z
    # Location-major views of Z: each location's (rows, F) block is written by BLAS in place.
    out = Z.transpose(1, 2, 0, 3)
    windows = _patch_blocks(A, W, stride)
    weights = _weight_blocks(W, len(windows))
    np.matmul(windows[0], weights[0], out=out)
    if len(windows) > 1:
        part = np.empty_like(out)
        for a in range(1, len(windows)):
            np.matmul(windows[a], weights[a], out=part)
            out += part
    Z += b
    return Z


def local2d_backward(
    A: FloatArray,
    W: FloatArray,
    delta: FloatArray,
    stride: Pair,
    *,
    need_input: bool,
    dW: FloatArray | None = None,
) -> tuple[FloatArray, FloatArray, FloatArray | None]:
    """Gradients of :func:`local2d_forward`: ``(dW, db, dA or None)`` for ``delta = dloss/dZ``.

    ``dW`` has ``W``'s shape and ``dA`` ``A``'s (both C-contiguous); ``db`` is ``(h', w', F)``. Given
    ``dW`` (C-contiguous, ``W``'s shape: e.g. a block of a partition's gradient slice), the weight gradient
    is written into it (and returned) instead of a new array.

    Examples
    --------
    >>> A, W = np.ones((2, 3, 3, 1)), np.ones((2, 2, 2, 2, 1, 1))
    >>> dW, db, dA = local2d_backward(A, W, np.ones((2, 2, 2, 1)), (1, 1), need_input=True)
    >>> dA[0, :, :, 0]  # how many patches cover each input
    array([[1., 2., 1.],
           [2., 4., 2.],
           [1., 2., 1.]])
    """
    h2, w2, ph, pw, c, _ = W.shape
    rows = A.shape[0]
    if dW is not None and (dW.shape != W.shape or not dW.flags.c_contiguous):
        raise ValueError(f"dW must be C-contiguous of W's shape {W.shape}, got {dW.shape}")
    gW = np.empty(W.shape) if dW is None else dW
    gb: FloatArray = delta.sum(axis=0)
    dA = np.empty(A.shape) if need_input else None
    if h2 == 0 or w2 == 0 or rows == 0:
        gW.fill(0.0)
        return gW, gb, None if dA is None else np.zeros_like(dA)
    sh, sw = stride
    d_loc = delta.transpose(1, 2, 0, 3)  # (h', w', rows, F): each location's block, no copy
    windows = _patch_blocks(A, W, stride)
    for block, g_block in zip(windows, _weight_blocks(gW, len(windows)), strict=True):
        np.matmul(block.swapaxes(2, 3), d_loc, out=g_block)
    if dA is None:
        return gW, gb, None
    rows_end, cols_end = sh * (h2 - 1) + 1, sw * (w2 - 1) + 1
    # Accumulated location-major, (h, w, rows, c): every patch entry's contribution is then a block of
    # contiguous (rows, c) matrices added in cache (the product is 3 MB for the benchmark model), where
    # adding into (rows, h, w, c) strides through the whole of dA for each of the ph * pw entries (2x the
    # time of the products themselves).
    d_loc_in = np.zeros((A.shape[1], A.shape[2], rows, c))
    part = np.empty((h2, w2, rows, c))
    for a in range(ph):
        for q in range(pw):
            # Every location's patch entry (a, q) reads A[:, i*sh + a, j*sw + q, :]: distinct places for
            # distinct locations, so one add per entry (overlapping patches meet across entries).
            np.matmul(d_loc, W[:, :, a, q].swapaxes(2, 3), out=part)
            d_loc_in[a : a + rows_end : sh, q : q + cols_end : sw] += part
    dA[...] = d_loc_in.transpose(2, 0, 1, 3)
    return gW, gb, dA


def _pair(name: str, value: Any) -> Pair:
    def positive(v: Any) -> int:
        if isinstance(v, bool) or not isinstance(v, int | np.integer) or v < 1:
            raise ModelSpecError(f"{name} must be a positive integer or a pair of them, got {value!r}")
        return int(v)

    if isinstance(value, Sequence) and not isinstance(value, str):
        if len(value) != 2:
            raise ModelSpecError(
                f"{name} must be a positive integer or a pair [rows, columns], got {value!r}"
            )
        return positive(value[0]), positive(value[1])
    side = positive(value)
    return side, side


class LocallyConnected2D(_LocalNetwork):
    """2-D locally connected network (no weight sharing) with a dense softmax cross-entropy output layer.

    Parameter layout (one flat float64 vector): for every local layer ``W_l`` of shape
    ``(h', w', ph, pw, c, F)`` (location ``(i, j)``'s own filters) then ``b_l`` ``(h', w', F)``; then the
    output ``W`` ``(h'*w'*F, n_classes)`` and ``b`` ``(n_classes,)``. A row band of a layer (rows ``lo:hi``
    of its map) is one contiguous range of ``W_l``, of ``b_l`` and of the output rows: what a spatial
    partition owns.

    Parameters
    ----------
    image_shape : (int, int)
        Height and width of the input images.
    n_classes : int
        Number of classes (>= 2).
    channels : int
        Channels of the input (rows of ``X`` are flattened ``(height, width, channels)``). Default 1.
    patches : sequence of int or (int, int)
        Patch (receptive field) of every local layer, ``ph x pw`` (an int ``p`` means ``p x p``). Default one
        layer of 3 x 3.
    strides : sequence of int or (int, int), optional
        Stride of every local layer (same length as ``patches``); default 1 x 1 for each.
    filters : sequence of int, optional
        Filters (output channels) per location of every local layer; default 4 for each.
    activation : {"sigmoid", "tanh", "relu"}
        Activation of the local layers. Default ``"tanh"``.

    Raises
    ------
    distbelief.errors.ModelSpecError
        A size that is not a positive integer, a map smaller than its patch, lists of different lengths,
        fewer than two classes.

    Examples
    --------
    >>> m = LocallyConnected2D((8, 8), 10, patches=[3], strides=[1], filters=[2])
    >>> m.shapes  # (8 - 3) // 1 + 1 = 6 locations a side, 2 filters each
    ((8, 8, 1), (6, 6, 2))
    >>> m.n_params  # 36 locations x (3*3*1*2 weights + 2 biases), then 72*10 + 10
    1450
    >>> loss, grad = m.loss_and_grad(m.init_params(0), np.ones((2, 64)), [0, 9])
    >>> grad.shape
    (1450,)
    """

    kind: ClassVar[str] = "locally_connected_2d"
    _name: ClassVar[str] = "2-D locally connected network"

    def __init__(
        self,
        image_shape: Sequence[int],
        n_classes: int,
        *,
        channels: int = 1,
        patches: Sequence[int | Sequence[int]] = (3,),
        strides: Sequence[int | Sequence[int]] | None = None,
        filters: Sequence[int] | None = None,
        activation: str = "tanh",
    ) -> None:
        if not isinstance(image_shape, Sequence) or isinstance(image_shape, str) or len(image_shape) != 2:
            raise ModelSpecError(f"image_shape must be [height, width], got {image_shape!r}")
        height, width = _pair("image_shape", list(image_shape))
        channels = _positive("channels", channels)
        self._n_classes = self._checked_classes(n_classes)
        self._patches = tuple(_pair("patches[]", p) for p in per_layer("patches", patches))
        n_layers = len(self._patches)
        self._strides = tuple(
            _pair("strides[]", s)
            for s in (per_layer("strides", strides) if strides is not None else [1] * n_layers)
        )
        self._filters = tuple(
            _positive("filters[]", f)
            for f in (per_layer("filters", filters) if filters is not None else [4] * n_layers)
        )
        if not n_layers or len(self._strides) != n_layers or len(self._filters) != n_layers:
            raise ModelSpecError(
                "patches, strides and filters must be non-empty and of the same length, got "
                f"{len(self._patches)}, {len(self._strides)} and {len(self._filters)}; give one patch (and "
                "stride, filters) per local layer"
            )
        self._activation = self._checked_activation(activation)
        shapes = [(height, width, channels)]
        for (ph, pw), (sh, sw), f in zip(self._patches, self._strides, self._filters, strict=True):
            h, w, _ = shapes[-1]
            if h < ph or w < pw:
                raise ModelSpecError(
                    f"a {h} x {w} map cannot feed a {ph} x {pw} patch; use smaller patches or larger images"
                )
            shapes.append(((h - ph) // sh + 1, (w - pw) // sw + 1, f))
        self._shapes = tuple(shapes)
        # Location (i, j) of a local layer has its own filters and biases; the output layer is dense.
        h, w, f = shapes[-1]
        self._set_layout(
            [
                ((h2, w2, ph, pw, c, f), (h2, w2, f))
                for (_, _, c), (h2, w2, f), (ph, pw) in zip(
                    shapes[:-1], shapes[1:], self._patches, strict=True
                )
            ]
            + [((h * w * f, self._n_classes), (self._n_classes,))]
        )

    @property
    def n_features(self) -> int:
        """Input width: height x width x channels."""
        h, w, c = self._shapes[0]
        return h * w * c

    @property
    def shapes(self) -> tuple[tuple[int, int, int], ...]:
        """``(height, width, channels)`` of the input and of every local layer's map."""
        return self._shapes

    @property
    def patches(self) -> tuple[Pair, ...]:
        """Patch ``(ph, pw)`` of every local layer."""
        return self._patches

    @property
    def strides(self) -> tuple[Pair, ...]:
        """Stride ``(sh, sw)`` of every local layer."""
        return self._strides

    @property
    def filters(self) -> tuple[int, ...]:
        """Filters per location of every local layer."""
        return self._filters

    @property
    def spec(self) -> dict[str, Any]:
        """``{"kind": "locally_connected_2d", "image_shape", "channels", "n_classes", "patches", "strides",
        "filters", "activation"}`` (patches and strides as pairs)."""
        h, w, c = self._shapes[0]
        return {
            "kind": self.kind,
            "image_shape": [h, w],
            "channels": c,
            "n_classes": self._n_classes,
            "patches": [list(p) for p in self._patches],
            "strides": [list(s) for s in self._strides],
            "filters": list(self._filters),
            "activation": self._activation,
        }

    @property
    def _input_shape(self) -> tuple[int, ...]:
        return self._shapes[0]

    def _layer_forward(self, A: FloatArray, W: FloatArray, b: FloatArray, stride: Pair) -> FloatArray:
        return local2d_forward(A, W, b, stride)

    def _layer_backward(
        self, A: FloatArray, W: FloatArray, delta: FloatArray, stride: Pair, *, need_input: bool
    ) -> tuple[FloatArray, FloatArray, FloatArray | None]:
        return local2d_backward(A, W, delta, stride, need_input=need_input)

    def _local_fans(self, W: FloatArray) -> tuple[int, int]:
        return int(np.prod(W.shape[2:5])), W.shape[5]  # a patch of all channels in; the filters out
