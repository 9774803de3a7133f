"""Vector-free L-BFGS: the two-loop recursion run on a small matrix of dot products (DistBelief, section 4.2).

Sandblaster's coordinator cannot touch vectors (DistBelief, section 4.2 and appendix: "a sequence of
scalar-vector products and vector-vector inner products" done by the parameter-server shards). VL-BFGS
(Chen, Wang & Zhou, "Large-scale L-BFGS using MapReduce", NIPS 2014, Algorithm 3) makes the L-BFGS direction
fit that model: with base vectors ``b = [s_1..s_k, y_1..y_k, g]`` (oldest to newest) the direction is
``d = sum_j delta_j b_j``, and the coefficients ``delta`` follow from the Gram matrix ``B_ij = b_i . b_j``
alone. Only the entries that involve the newest pair and the new gradient change from one iteration to
the next, so each iteration costs one batched ``dots`` round trip (``6k`` scalars for ``k`` pairs) and one
``lincomb`` on the shards, whatever ``k``.

:class:`VLBFGSHistory` is the coordinator-side state: slot names, the cached Gram entries, the curvature
check and the recursion. :func:`_minimize_lbfgs` is the method, written once against
:class:`sandblaster._space.ParameterSpace` (on the shards or in process); it reproduces SciPy's
``L-BFGS-B`` on unconstrained problems (same line search, initial step, stopping rules, and restart after a
failed line search; Byrd, Lu, Nocedal & Zhu 1995).

``history_dtype="float32"`` (issue 29) stores the pairs ``s``, ``y`` as float32 on the shards: each is
formed in float64 and rounded once when stored; the Gram entries are float64 dot products of the stored
(rounded) vectors, so the recursion is the exact two-loop recursion of the pairs as stored, and the
direction is a float64 combination of their upcast elements. Half the history's RAM, spill and checkpoint
bytes; the iterates differ from float64 history's by the rounding of the pairs (``benchmarks/
history_dtype.py`` measures it).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from distbelief.errors import DatasetError, InvalidOptionError, ProtocolError

from ._linesearch import (
    LBFGSB_C1,
    LBFGSB_C2,
    LBFGSB_STPMAX,
    LBFGSB_XTOL,
    lbfgsb_initial_step,
)
from ._space import (
    IterationRecord,
    ParameterSpace,
    accept_trial,
    close_iteration,
    other_buffer,
    stop_test,
    wolfe_search,
)

__all__ = [
    "CURVATURE_EPS",
    "HISTORY_DTYPES",
    "VLBFGSHistory",
    "_minimize_lbfgs",
    "history_ops",
    "resumed_history",
    "vlbfgs_coefficients",
]

#: Default relative threshold of the curvature check ``s.y > eps * y.y``.
CURVATURE_EPS = float(np.finfo(np.float64).eps)

#: How the shards may store the pairs ``s``, ``y`` (the arithmetic is float64 either way).
HISTORY_DTYPES = ("float64", "float32")


def history_ops(history_dtype: str) -> tuple[str, ...]:
    """The trailing element of a ``lincomb`` that stores a pair: none for float64 (the ops, and so the
    messages, of a float64 history are those of before the option), ``("float32",)`` for float32.

    Examples
    --------
    >>> history_ops("float64"), history_ops("float32")
    ((), ('float32',))
    """
    if history_dtype not in HISTORY_DTYPES:
        raise InvalidOptionError(f"history_dtype must be one of {HISTORY_DTYPES} here, got {history_dtype!r}")
    return () if history_dtype == "float64" else (history_dtype,)


DotKey = tuple[str, str]


def vlbfgs_coefficients(gram: np.ndarray) -> np.ndarray:
    """The VL-BFGS recursion: coefficients ``delta`` with ``d = sum_j delta_j b_j = -H g``.

    Chen, Wang & Zhou (NIPS 2014), Algorithm 3, i.e. the L-BFGS two-loop recursion (Nocedal & Wright,
    Algorithm 7.4) with every inner product read from the Gram matrix of the base vectors
    ``[s_1..s_k, y_1..y_k, g]`` (oldest to newest). The initial Hessian is ``gamma * I`` with
    ``gamma = s_k.y_k / y_k.y_k`` of the newest pair.

    Parameters
    ----------
    gram : numpy.ndarray
        Symmetric ``(2k+1, 2k+1)`` matrix of dot products, ``k >= 0``.

    Returns
    -------
    numpy.ndarray
        ``delta`` of length ``2k+1``; with ``k = 0`` it is ``[-1]`` (steepest descent).

    Examples
    --------
    >>> s, y, g = np.array([1.0, 0.0]), np.array([2.0, 0.0]), np.array([4.0, 2.0])
    >>> base = np.stack([s, y, g])
    >>> delta = vlbfgs_coefficients(base @ base.T)
    >>> delta @ base       # Newton step along s (curvature 2), gamma = 0.5 scaling across it
    array([-2., -1.])
    """
    n = gram.shape[0]
    if gram.ndim != 2 or gram.shape[1] != n or n % 2 != 1:
        raise InvalidOptionError(f"gram must be a square (2k+1)x(2k+1) matrix, got shape {gram.shape}")
    k = (n - 1) // 2
    delta = np.zeros(n)
    delta[2 * k] = -1.0
    if k == 0:
        return delta
    # The coordinator runs this every iteration: ``ndarray.dot`` for the products (numpy's ``@`` on two
    # vectors runs the same dot routine, so the same bits, at twice the call overhead); ``cols[i]`` is
    # ``gram[:, i]``, the same strided view; ``sy[i]`` is ``s_i.y_i``.
    cols = gram.T
    sy = gram.diagonal(k).tolist()
    alpha = [0.0] * k
    dot = delta.dot  # delta is updated in place
    for i in range(k - 1, -1, -1):
        a = dot(cols[i]) / sy[i]
        alpha[i] = a
        delta[k + i] -= a
    delta *= gram[k - 1, 2 * k - 1] / gram[2 * k - 1, 2 * k - 1]
    for i in range(k):
        delta[i] += alpha[i] - dot(gram[k + i]) / sy[i]
    return delta


class VLBFGSHistory:
    """Coordinator-side L-BFGS memory that only ever sees names and dot products.

    The shards hold the vectors; this object decides which named slot receives the next ``(s, y)`` pair,
    which dot products the shards must return, whether a pair passes the curvature check, and the
    coefficients of the new direction.

    Parameters
    ----------
    m : int
        Number of pairs kept (SciPy's ``maxcor``).
    curvature_eps : float
        A pair is kept only if ``s.y > curvature_eps * y.y`` (which guarantees a positive definite
        update); otherwise it is skipped and the memory is unchanged.
    prefix : str
        Prefix of the slot names: ``"{prefix}s0"``, ``"{prefix}y0"``, ...

    Notes
    -----
    There are ``m + 1`` slots: ``s0..s{m}`` and ``y0..y{m}``. A new pair always goes into a free slot, so
    a pair that then fails the curvature check (known only once its dot products are back) never
    destroys a kept pair; when an accepted pair makes ``m + 1``, the oldest one is dropped and its slot
    becomes the free one. The price is two extra vectors on the shards.

    One iteration of the protocol (after the line search accepted ``x + t*d`` with gradient ``g_new``)::

        s_name, y_name = hist.push_pair()          # shards: s_name = t*d ; y_name = g_new - g
        pairs = hist.dot_requests("g")             # after the shards renamed g_new to "g"
        hist.update_dots(shards.dots(pairs))       # one round trip; runs the curvature check
        shards.lincomb("d", hist.direction_coefficients())

    On the first iteration skip ``push_pair``. Per iteration the requests are exactly:

    * no new pair, ``k`` pairs kept: ``2k + 1`` (the new gradient against every base vector);
    * with a new pair and ``k < m`` pairs kept before it: ``6(k+1)``, all the new entries of the
      ``(2k+3)``-square Gram matrix, each symmetric entry once;
    * with a new pair and a full memory (``k = m``): ``6m + 2``; the new pair is not dotted with the
      oldest pair, which it evicts, but ``g`` is, in case the new pair is skipped.

    Examples
    --------
    >>> hist = VLBFGSHistory(3)
    >>> vec = {"g": np.array([4.0, 2.0])}
    >>> hist.update_dots([float(vec[a] @ vec[b]) for a, b in hist.dot_requests("g")])
    >>> hist.direction_coefficients()                   # no pairs: steepest descent
    [(-1.0, 'g')]
    >>> s, y = hist.push_pair()                         # the shards would write s = t*d, y = g_new - g
    >>> vec[s], vec[y], vec["g"] = np.array([1.0, 0.0]), np.array([2.0, 0.0]), np.array([2.0, 2.0])
    >>> req = hist.dot_requests("g")
    >>> len(req)
    6
    >>> hist.update_dots([float(vec[a] @ vec[b]) for a, b in req])
    True
    >>> sum(c * vec[name] for c, name in hist.direction_coefficients())
    array([-1., -1.])
    """

    def __init__(self, m: int, *, curvature_eps: float = CURVATURE_EPS, prefix: str = "") -> None:
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise InvalidOptionError(f"m (the number of stored pairs) must be an int >= 1, got {m!r}; try 10")
        if not (math.isfinite(curvature_eps) and curvature_eps >= 0.0):
            raise InvalidOptionError(f"curvature_eps must be a finite number >= 0, got {curvature_eps!r}")
        self._m = m
        self._eps = float(curvature_eps)
        self._s_names = tuple(f"{prefix}s{i}" for i in range(m + 1))
        self._y_names = tuple(f"{prefix}y{i}" for i in range(m + 1))
        self._live: list[int] = []  # slot indices of the kept pairs, oldest first
        self._pending: int | None = None
        # The cached dot products by position: slot i's s at i, its y at m + 1 + i, the gradient last; NaN
        # where none is known (a delivered value is always finite). An array rather than a dict by name
        # pair: the Gram matrix is one fancy index, a slot is forgotten by overwriting its row and column,
        # a copy is one memcpy; the dict cost the coordinator ~0.1 ms an iteration at m = 10.
        self._gram = np.full((2 * m + 3, 2 * m + 3), np.nan)
        self._requested: list[DotKey] | None = None
        self._requested_at: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())  # their positions
        self._request_grad: str | None = None
        self._grad: str | None = None  # gradient name whose dots are in the cache
        self._grad_fresh = False  # False from push_pair() until the new gradient's dots arrive
        self._last_accepted: bool | None = None

    # -- introspection -------------------------------------------------------------------------------
    @property
    def m(self) -> int:
        """Maximum number of kept pairs."""
        return self._m

    @property
    def n_pairs(self) -> int:
        """Number of kept pairs (the pending one excluded)."""
        return len(self._live)

    @property
    def pair_names(self) -> list[tuple[str, str]]:
        """``(s_name, y_name)`` of the kept pairs, oldest first."""
        return [(self._s_names[i], self._y_names[i]) for i in self._live]

    def base_names(self) -> list[str]:
        """Names of the base vectors ``[s_1..s_k, y_1..y_k, g]``, in the order of the Gram matrix."""
        if self._grad is None:
            raise ProtocolError("no gradient dots yet: call dot_requests() and update_dots() first")
        return [self._s_names[i] for i in self._live] + [self._y_names[i] for i in self._live] + [self._grad]

    def dot_matrix(self) -> np.ndarray:
        """The ``(2k+1)``-square Gram matrix of :meth:`base_names`, from the cached dot products."""
        if self._grad is None:
            raise ProtocolError("no gradient dots yet: call dot_requests() and update_dots() first")
        pos = [*self._live, *(self._m + 1 + i for i in self._live), 2 * self._m + 2]
        gram = self._gram.take(pos, 0).take(pos, 1)  # np.ix_ costs 3x as much
        if np.isnan(gram).any():  # not after the protocol's calls in order
            raise ProtocolError("a dot product of the base vectors is missing: call update_dots() first")
        return gram

    # -- protocol ------------------------------------------------------------------------------------
    def push_pair(self) -> tuple[str, str]:
        """Reserve the slot for a new ``(s, y)`` pair and return its ``(s_name, y_name)``.

        The caller stores ``s = x_new - x`` (``t*d``) and ``y = g_new - g`` under these names, then calls
        :meth:`dot_requests` and :meth:`update_dots`, which keep or skip the pair.
        """
        if self._requested is not None:
            raise ProtocolError("dot products were requested but not delivered: call update_dots() first")
        if self._pending is not None:
            raise ProtocolError("a pair is already pending: call dot_requests() and update_dots() first")
        used = self._live
        slot = next(i for i in range(self._m + 1) if i not in used)
        self._pending = slot
        self._drop_slot_dots(slot)
        self._grad_fresh = False  # the gradient changed along with the new pair
        return self._s_names[slot], self._y_names[slot]

    def dot_requests(self, grad_name: str) -> list[tuple[str, str]]:
        """The pairs of vector names whose dot products the shards must return now (new entries only).

        Parameters
        ----------
        grad_name : str
            Name of the current gradient on the shards.

        Returns
        -------
        list of (str, str)
            Each unordered pair once; deliver the values in this order to :meth:`update_dots`.
        """
        if not isinstance(grad_name, str) or not grad_name:
            raise InvalidOptionError(f"grad_name must be a non-empty string, got {grad_name!r}")
        s_names, y_names = self._s_names, self._y_names
        if grad_name in s_names or grad_name in y_names:
            raise InvalidOptionError(
                f"grad_name {grad_name!r} collides with a history slot name; use another name or a prefix"
            )
        requests: list[DotKey] = []
        rows: list[int] = []  # the positions of the requests in the cache (see __init__)
        cols: list[int] = []
        mp, g = self._m + 1, 2 * self._m + 2
        p = self._pending
        if p is not None:
            sp, yp = s_names[p], y_names[p]
            # The oldest pair is about to be evicted if the new one is accepted into a full memory.
            survivors = self._live[1:] if len(self._live) == self._m else self._live
            for j in survivors:
                sj, yj = s_names[j], y_names[j]
                requests += [(sp, sj), (sp, yj), (yp, sj), (yp, yj)]
                rows += [p, p, mp + p, mp + p]
                cols += [j, mp + j, j, mp + j]
            requests += [(sp, sp), (sp, yp), (yp, yp)]
            rows += [p, p, mp + p]
            cols += [p, mp + p, mp + p]
        # The gradient is new every iteration: dot it with everything that may be a base vector.
        slots = [*self._live, p] if p is not None else self._live
        for j in slots:
            requests += [(grad_name, s_names[j]), (grad_name, y_names[j])]
            rows += [g, g]
            cols += [j, mp + j]
        requests.append((grad_name, grad_name))
        rows.append(g)
        cols.append(g)
        self._requested = requests
        self._requested_at = (tuple(rows), tuple(cols))
        self._request_grad = grad_name
        return list(requests)

    def update_dots(
        self, values: Sequence[float] | Mapping[tuple[str, str], float], *, descent: float | None = None
    ) -> bool | None:
        """Store the dot products asked for by :meth:`dot_requests`; decide on a pending pair.

        Parameters
        ----------
        values : sequence of float or mapping
            The values in request order, or a mapping from name pairs (either order) to values.
        descent : float, optional
            ``-g_old . s`` for the pending pair (``-t * phi'(0)`` of the line search that produced it). When
            given, the curvature check is L-BFGS-B's, ``s.y > eps * (-g_old . s)``, which does not depend
            on the scale of F; without it, ``s.y > eps * y.y``, which skips every pair once F is scaled
            by ~1e16 or more (``s.y / y.y`` is then below ``eps``).

        Returns
        -------
        bool or None
            For a pending pair: True if kept, False if skipped by the curvature check; None otherwise.
        """
        requests, grad = self._requested, self._request_grad
        if requests is None or grad is None:
            raise ProtocolError("update_dots() without a matching dot_requests(): ask for the pairs first")
        if isinstance(values, Mapping):
            got: list[float] = []
            for a, b in requests:
                if (a, b) in values:
                    got.append(float(values[(a, b)]))
                elif (b, a) in values:
                    got.append(float(values[(b, a)]))
                else:
                    raise ProtocolError(f"the dot product {(a, b)} was requested but not delivered")
            arr = np.array(got, dtype=np.float64)
        else:
            arr = np.array(values, dtype=np.float64)
            if arr.shape != (len(requests),):
                raise ProtocolError(f"expected {len(requests)} dot products (as requested), got {arr.size}")
        if not np.isfinite(arr).all():
            bad = [pair for pair, v in zip(requests, arr.tolist(), strict=True) if not math.isfinite(v)]
            raise DatasetError(
                f"non-finite dot products for {bad[:3]}: the gradient (or a stored pair) holds NaN/inf; "
                "check the data for NaN/inf and lower the step or regularize the model"
            )
        gram = self._gram
        # Dots with the previous gradient are stale once a new gradient arrives (one row for any name).
        gram[-1, :] = np.nan
        gram[:, -1] = np.nan
        rows, cols = (np.array(at, dtype=np.intp) for at in self._requested_at)  # as tuples: 2x the cost
        gram[rows, cols] = arr
        gram[cols, rows] = arr
        self._requested = None
        self._request_grad = None
        self._grad = grad
        self._grad_fresh = True

        p = self._pending
        if p is None:
            return None
        self._pending = None
        yp = self._m + 1 + p
        sy, yy = float(gram[p, yp]), float(gram[yp, yp])
        threshold = yy if descent is None else descent
        accepted = sy > self._eps * threshold and yy > 0.0
        if accepted:
            if len(self._live) == self._m:
                self._drop_slot_dots(self._live.pop(0))
            self._live.append(p)
        else:
            self._drop_slot_dots(p)
        self._last_accepted = accepted
        return accepted

    def direction_coefficients(self) -> list[tuple[float, str]]:
        """``[(delta_j, name_j)]`` such that ``d = sum_j delta_j * name_j`` is the L-BFGS direction ``-H g``.

        Without pairs this is ``[(-1.0, grad_name)]``, steepest descent (the line search scales the
        first step, as L-BFGS-B does).
        """
        if self._requested is not None or self._pending is not None or not self._grad_fresh:
            raise ProtocolError(
                "the gradient's dot products are not up to date: call dot_requests() and update_dots() first"
            )
        delta = vlbfgs_coefficients(self.dot_matrix())
        return list(zip(delta.tolist(), self.base_names(), strict=True))

    def reset(self) -> None:
        """Forget every pair (L-BFGS-B's restart after a failed line search); gradient dots are kept."""
        if self._requested is not None:
            raise ProtocolError("dot products were requested but not delivered: call update_dots() first")
        for slot in [*self._live, *([self._pending] if self._pending is not None else [])]:
            self._drop_slot_dots(slot)
        self._live = []
        self._pending = None

    def copy(self) -> VLBFGSHistory:
        """An independent copy (the containers are copied; names, positions and values are immutable).

        ~30x faster than ``copy.deepcopy``: the line search copies the history for every trial.

        Examples
        --------
        >>> h = VLBFGSHistory(3)
        >>> c = h.copy(); _ = c.push_pair()
        >>> h.n_pairs, c.to_state()["pending"], h.to_state()["pending"]
        (0, 0, None)
        """
        other = VLBFGSHistory.__new__(VLBFGSHistory)
        other.__dict__.update(self.__dict__)
        other._live = list(self._live)
        other._gram = self._gram.copy()
        other._requested = None if self._requested is None else list(self._requested)
        return other

    def to_state(self) -> dict[str, Any]:
        """A JSON-able snapshot (for checkpoints); :meth:`from_state` rebuilds an equal object.

        Examples
        --------
        >>> h = VLBFGSHistory(3)
        >>> VLBFGSHistory.from_state(h.to_state()).m
        3
        """
        names = [*self._s_names, *self._y_names, self._grad]
        known = np.argwhere(np.triu(~np.isnan(self._gram)))  # each symmetric entry once
        return {
            "m": self._m,
            "eps": self._eps,
            "s_names": list(self._s_names),
            "y_names": list(self._y_names),
            "live": list(self._live),
            "pending": self._pending,
            "dots": [[names[i], names[j], float(self._gram[i, j])] for i, j in known.tolist()],
            "requested": None if self._requested is None else [list(k) for k in self._requested],
            "request_grad": self._request_grad,
            "grad": self._grad,
            "grad_fresh": self._grad_fresh,
            "last_accepted": self._last_accepted,
        }

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> VLBFGSHistory:
        """Inverse of :meth:`to_state`."""
        m = int(state["m"])
        hist = cls(m, curvature_eps=float(state["eps"]))
        hist._s_names = tuple(state["s_names"])
        hist._y_names = tuple(state["y_names"])
        if len(hist._s_names) != m + 1 or len(hist._y_names) != m + 1:
            raise ProtocolError(f"a history of m={m} has {m + 1} s and y slots; this state is not one")
        hist._live = [int(i) for i in state["live"]]
        hist._pending = None if state["pending"] is None else int(state["pending"])
        hist._grad = state["grad"]
        at = hist._positions(hist._grad)
        for a, b, v in state["dots"]:
            i, j = at(str(a)), at(str(b))
            hist._gram[i, j] = hist._gram[j, i] = float(v)
        requested = state["requested"]
        hist._request_grad = state["request_grad"]
        if requested is not None:
            hist._requested = [(str(a), str(b)) for a, b in requested]
            at = hist._positions(hist._request_grad)
            hist._requested_at = (
                tuple(at(a) for a, _ in hist._requested),
                tuple(at(b) for _, b in hist._requested),
            )
        hist._grad_fresh = bool(state["grad_fresh"])
        hist._last_accepted = state["last_accepted"]
        return hist

    def _positions(self, grad: str | None) -> Callable[[str], int]:
        """Name -> position in the cache (slots, and ``grad`` last); a ProtocolError for any other name."""
        pos = {name: i for i, name in enumerate((*self._s_names, *self._y_names))}
        if grad is not None:
            pos[grad] = 2 * self._m + 2

        def at(name: str) -> int:
            if name not in pos:
                raise ProtocolError(f"{name!r} is neither a slot of this history nor its gradient {grad!r}")
            return pos[name]

        return at

    def _drop_slot_dots(self, slot: int) -> None:
        gram, y = self._gram, self._m + 1 + slot
        gram[slot, :] = np.nan
        gram[:, slot] = np.nan
        gram[y, :] = np.nan
        gram[:, y] = np.nan


def resumed_history(
    resume: Mapping[str, Any], m: int, history_dtype: str = "float64"
) -> tuple[VLBFGSHistory, list[float], float | None]:
    """The history a checkpoint saved, its pending Gram entries and ``-g.s`` of its pair (``descent``).

    Shared by L-BFGS and OWL-QN, whose checkpoints hold ``hist``, ``next_values``, ``descent`` and, for a
    float32 history, ``history_dtype`` (the stored pairs and their Gram entries are those of that dtype).

    Examples
    --------
    >>> resumed_history({"hist": VLBFGSHistory(3).to_state(), "next_values": [1.0]}, 4)
    Traceback (most recent call last):
    ...
    distbelief.errors.InvalidOptionError: the run was started with history=3; resume with it
    """
    if resume["hist"]["m"] != m:
        started = resume["hist"]["m"]
        raise InvalidOptionError(f"the run was started with history={started}; resume with it")
    started_dtype = resume.get("history_dtype", "float64")
    if started_dtype != history_dtype:
        raise InvalidOptionError(
            f"the run was started with history_dtype={started_dtype!r}; resume with it (or 'auto')"
        )
    return VLBFGSHistory.from_state(resume["hist"]), list(resume["next_values"]), resume.get("descent")


def _checkpoint_extra(
    spec: VLBFGSHistory, values: list[float], descent: float, history_dtype: str = "float64"
) -> dict[str, Any]:
    """L-BFGS's scalars in a checkpoint (made only when one is due: the snapshot is not free)."""
    extra = {"hist": spec.to_state(), "next_values": values, "descent": descent}
    if history_dtype != "float64":
        extra["history_dtype"] = history_dtype  # only then: a float64 run's checkpoint is as before
    return extra


class _SpeculativePair:
    """The ops each trial runs with its gradient: the next pair ``s = t*d``, ``y = g_t - g`` in a free
    slot, and its new Gram entries, assuming the line search accepts the trial (it usually does at once).

    A rejected trial never overwrites a kept pair (the slot is free); :attr:`spec` is the history with
    the last trial's pair pending, :attr:`names` that pair's slot names.
    """

    def __init__(self, hist: VLBFGSHistory, grad: str, trial_grad: str, store: tuple[str, ...] = ()) -> None:
        self.hist, self.grad, self.trial_grad = hist, grad, trial_grad
        self.spec = hist
        self.names = ("", "")
        self.store = store  # history_ops(history_dtype): how the shards store the pair

    def __call__(self, step: float) -> list[tuple[Any, ...]]:
        self.spec = self.hist.copy()
        s_name, y_name = self.names = self.spec.push_pair()
        return [
            ("lincomb", s_name, [step], ["d"], *self.store),
            ("lincomb", y_name, [1.0, -1.0], [self.trial_grad, self.grad], *self.store),
            ("dots", self.spec.dot_requests(self.trial_grad)),
        ]


def _minimize_lbfgs(
    space: ParameterSpace,
    *,
    m: int,
    gtol: float,
    ftol: float,
    maxiter: int,
    maxfev: int,
    maxls: int = 20,
    callback: Callable[[IterationRecord], None] | None = None,
    resume: Mapping[str, Any] | None = None,
    history_dtype: str = "float64",
) -> tuple[bool, str]:
    """Vector-free L-BFGS in ``space``, as SciPy's ``L-BFGS-B`` does it without bounds.

    Moré-Thuente search with L-BFGS-B's constants, first step ``1/||d||``, stop on ``max|g_i| <= gtol`` or
    a relative decrease ``<= ftol`` (Byrd, Lu, Nocedal & Zhu 1995); on a failed line search drop the
    memory and retry along ``-g`` (give up if the memory was already empty). The direction is VL-BFGS's
    (Chen, Wang & Zhou, NIPS 2014): :class:`VLBFGSHistory` turns Gram entries into coefficients, the space
    forms ``d = sum_j delta_j b_j``.

    Every op rides on an evaluation: the direction and ``g.d`` on the first trial's prefix, and with each
    trial's gradient, speculatively (assuming the line search accepts the trial, as it usually does at
    once), the next pair ``s = t*d``, ``y = g_t - g`` in a free slot and the new Gram entries. A typical
    iteration on the shards therefore costs the coordinator no round trip of its own (DESIGN.md, "Fuse
    messages"); only the first direction, and one after a restart, asks for its dots separately.

    Parameters
    ----------
    space : ParameterSpace
        Started (``state.f``, ``state.g_inf`` hold ``F`` at ``state.x``).
    m : int
        Memory size (SciPy's ``maxcor``).
    gtol, ftol, maxiter, maxfev, maxls : float, float, int, int, int
        Stopping rules and the evaluation budget of one line search.
    callback : callable, optional
        Called with each iteration's record.
    resume : mapping, optional
        The metadata of a checkpoint of this method (``hist``, ``next_values``) to continue from.
    history_dtype : {"float64", "float32"}
        How the pairs are stored (see the module's docstring); the arithmetic is float64 either way.

    Returns
    -------
    success : bool
        Whether a convergence test stopped the run.
    message : str
        Why it stopped.

    Examples
    --------
    >>> from distbelief.sandblaster._space import InProcessSpace
    >>> space = InProcessSpace(lambda x: (float(x @ x), 2 * x), np.array([3.0, -4.0]))
    >>> space.start()
    >>> _minimize_lbfgs(space, m=5, gtol=1e-5, ftol=0.0, maxiter=10, maxfev=100)
    (True, 'gradient inf-norm <= gtol')
    """
    store = history_ops(history_dtype)
    st = space.state
    if st.g_inf <= gtol:
        return True, "gradient inf-norm <= gtol at x0"
    hist = VLBFGSHistory(m, prefix="h")
    # ``next_dots`` holds the speculative Gram entries of the accepted trial, the history they fit and
    # ``-g.s`` of its pair (for the curvature check).
    next_dots: tuple[VLBFGSHistory, list[float], float | None] | None = None
    if resume is not None:
        next_dots = resumed_history(resume, m, history_dtype)
    while True:
        descent: float | None = None
        if next_dots is None:
            values = space.run([("dots", hist.dot_requests(st.g))])[0]
        else:
            hist, values, descent = next_dots
            next_dots = None
        hist.update_dots(values, descent=descent)
        coeffs = hist.direction_coefficients()
        # Without pairs d = -g, whose norm is already in the Gram matrix.
        d_norm = math.sqrt(hist.dot_matrix()[-1, -1]) if len(coeffs) == 1 else math.nan
        direction_op = ("lincomb", "d", [c for c, _ in coeffs], [n for _, n in coeffs])
        # The first trial moves x by one unit, whatever the scale of F (L-BFGS-B's 1/||d||). L-BFGS-B also
        # caps it at 1e10, which below ||g|| = 1e-10 (F scaled down) would move x by less: the cap widens.
        stpmax = LBFGSB_STPMAX * max(1.0, 1.0 / d_norm) if st.nit == 0 else LBFGSB_STPMAX
        step0 = lbfgsb_initial_step(st.nit, d_norm, stpmax=stpmax) if st.nit == 0 else 1.0
        pair = _SpeculativePair(hist, st.g, other_buffer(st.g), store)
        found = wolfe_search(
            space, step=step0, setup=[direction_op], speculate=pair, maxfev=maxfev, c1=LBFGSB_C1,
            c2=LBFGSB_C2, xtol=LBFGSB_XTOL, stpmax=stpmax, max_evals=maxls,
        )  # fmt: skip
        if found.over_budget:
            return False, "maximum number of function evaluations reached"
        res = found.result
        if res is None or not res.ok:
            if hist.n_pairs:
                hist.reset()  # L-BFGS-B: back to x, drop the memory, retry along -g
                continue
            if res is None:
                return False, "the search direction is not a descent direction"
            return False, f"line search failed: {res.message}"
        spec, values = pair.spec, found.last.extra[-1]
        next_dots = (spec, values, -res.step * found.dphi0)
        f_old = accept_trial(st, found.last)
        kept = [name for names in spec.pair_names for name in names]
        close_iteration(
            space, res.step, callback, [st.x, st.g, *kept, *pair.names],
            functools.partial(_checkpoint_extra, spec, list(values), next_dots[2], history_dtype),
        )  # fmt: skip
        stop = stop_test(st, f_old, gtol=gtol, ftol=ftol, maxiter=maxiter)
        if stop is not None:
            return stop
