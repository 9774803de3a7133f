"""One parameter-server shard: the named vectors of one contiguous slice and the ops on them.

This is the *state* of a shard, with no Dask inside (DESIGN.md, "Thin shells around state"): the Dask actor
in :mod:`storage._actor` only forwards to it. Ops follow the DistBelief paper's Sandblaster appendix
(section 4.2 and Appendix): every vector-valued result stays on the shard; only scalars (partial dot
products, partial norms) come back, and the caller reduces them over shards.

Large-vector arithmetic goes through :mod:`storage._kernels` (``axpy``, ``scale``, a fused ``lincomb``) rather
than numpy expressions, which would allocate a temporary per op (~4x slower on 1e7 elements), or BLAS, whose
``daxpy``/``dscal`` round an element differently in a vector's body and tail on some CPUs; dot products are
``np.dot`` (reductions carry no bit promise across cuts of a vector).

Vectors are float64, except those a ``lincomb`` asks to be stored as float32 (its optional fifth element,
``("lincomb", dst, coeffs, names, "float32")``: the L-BFGS history with ``history_dtype="float32"``, issue
29). The arithmetic stays float64: the terms of the combination are added in float64 and the destination
receives the result rounded once per element; a dot product with a float32 vector upcasts its elements
(:func:`storage._kernels.dot_mixed`). Half the RAM, spill bytes and checkpoint bytes per history vector.
"""

from __future__ import annotations

import collections
import functools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from distbelief.errors import InvalidOptionError, ProtocolError

from . import _exactsum, _kernels, _l1
from ._keys import decode_signs
from ._rules import adagrad_update, check_rule, sgd_update
from ._vectorstore import DTYPES, VectorStore, op_operands, run_chunked

__all__ = ["OPS", "Shard"]


@dataclass
class _Accumulator:
    """A gradient accumulator of one evaluation (``epoch``): its vector and which portions it holds.

    Two ways to make the sum's bits independent of which replica computed which portion and of the order
    in which pushes arrive:

    * *ordered* (``ordered=True``): every portion arrives with its own gradient, and ``values`` adds them in
      portion order, ``((g_0 + g_1) + g_2) + ...``, each as soon as the ones before it are in (a portion that
      arrives early waits in ``solos``). An add per element and portion, no wider state;
    * *binned* (otherwise): summed pushes of several portions are allowed; ``binned`` is the exact,
      order-independent sum of what was taken (:mod:`storage._exactsum`, 4 floats an element), and
      ``values`` receives its rounded value when the accumulator settles.
    """

    epoch: int
    values: np.ndarray
    binned: np.ndarray | None
    ordered: bool = False
    #: Ordered: the next portion to add (every one before it is in ``values``).
    next_portion: int = 0
    covered: set[int] = field(default_factory=set)
    #: Solo pushes held aside: portion -> (local keys or None for the whole slice, values).
    solos: dict[int, tuple[np.ndarray | None, np.ndarray]] = field(default_factory=dict)
    #: When set: the number of portions of the evaluation, and ops to run once all of them are in.
    expected: int | None = None
    finalize: list[Any] = field(default_factory=list)
    final: list[Any] | None = None


#: Versions kept per push source for :meth:`Shard.others_since`: a replica has at most a few pushes in
#: flight, so its last 64 cover any fetch it still computes from.
_OWN_VERSIONS = 64

#: op name -> how partial results combine across shards (None: the op returns nothing).
OPS: dict[str, str | None] = {
    "fill": None,
    "copy": None,
    "scale": None,
    "axpy": None,
    "lincomb": None,
    "mul": None,
    "delete": None,
    "reset_acc": None,
    "settle": "min",
    "dot": "sum",
    "dots": "sum",
    "norm2": "sqrt_sum",
    "norm_inf": "max",
    "sum": "sum",
    # OWL-QN (storage._l1): the pseudo-gradient, the sign-aligned direction, the orthant and its projection.
    "pseudo_grad": None,
    "sign_align": None,
    "orthant": None,
    "project_orthant": None,
    "nnz": "sum",
    "norm1": "sum",
}


class Shard:
    """Named float64 vectors for the parameter range ``[lo, hi)``.

    Parameters
    ----------
    index : int
        Shard number.
    lo, hi : int
        The global range this shard owns.
    memory_budget : int, optional
        Bytes of vectors to keep in RAM; the rest are spilled to ``spill_dir`` and streamed in chunks by
        the ops (:mod:`storage._vectorstore`). ``None``: everything in RAM.
    spill_dir : str, optional
        Local directory for spilled vectors (default: a temporary directory).

    Examples
    --------
    >>> s = Shard(0, 0, 3)
    >>> s.set("x", 0, 3, np.arange(3.0)); s.run([("dot", "x", "x")])
    [5.0]
    """

    def __init__(
        self, index: int, lo: int, hi: int, *, memory_budget: int | None = None, spill_dir: str | None = None
    ) -> None:
        self.index = index
        self.lo = lo
        self.hi = hi
        self.vectors = VectorStore(hi - lo, memory_budget, spill_dir=spill_dir)
        #: Number of updates applied by :meth:`push` (Downpour's shard clock, for staleness).
        self.version = 0
        #: Highest sequence number applied per push source: a retried push is applied once.
        self.last_seq: dict[str, int] = {}
        #: Downpour pushes applied, and the sums over them of their ``steps`` (as weighted by the learning
        #: rate: ``steps / (1 + staleness)`` with ``staleness_scale``) and of ``steps**2``. Checkpointed
        #: with the vectors, so a restored shard counts on from its checkpoint (see :meth:`counters`).
        self.applied = 0
        self.applied_weight = 0.0
        self.applied_steps_sq = 0
        #: Per push source, the shard versions its last pushes produced (for :meth:`others_since`).
        self._own_versions: dict[str, collections.deque[int]] = {}
        #: Last epoch whose :meth:`prepare` ops ran, and their results.
        self.prepared_epoch = -1
        self.prepared: list[Any] = []
        #: Seconds spent per op kind (``accumulate`` for gradient pushes), for benchmarks: where time goes.
        self.op_seconds: dict[str, float] = {}
        #: Ops done per kind, for the metrics page (:mod:`storage._monitor`): what the shard is doing.
        self.op_counts: dict[str, int] = {}
        #: Sandblaster gradient accumulators: which portions each holds, for exactly-once counting.
        self.accumulators: dict[str, _Accumulator] = {}
        #: A zero slice that key-value pushes are scattered into (kept zero between pushes).

    @property
    def size(self) -> int:
        """Number of parameters in this shard."""
        return self.hi - self.lo

    # -- vectors ---------------------------------------------------------------------------------------
    def vector(self, name: str) -> np.ndarray:
        """The local slice of vector ``name``; raises if the vector was never created."""
        try:
            return self.vectors[name]
        except KeyError:
            raise InvalidOptionError(
                f"shard {self.index} has no vector {name!r} (it has {sorted(self.vectors)}); "
                "create it first with scatter/fill/copy"
            ) from None

    def _target(self, name: str, dtype: str | None = None) -> np.ndarray:
        """The slice of ``name`` to overwrite, created (uninitialised) if it does not exist yet; with
        ``dtype`` (``"float64"`` or ``"float32"``), made anew when it is stored in another one."""
        vec = self.vectors.get(name)
        if vec is not None and dtype is not None and vec.dtype != _dtype(dtype):
            del self.vectors[name]  # its RAM or its file goes before the new one is placed
            vec = None
        if vec is None:
            # In RAM or spilled, by the memory budget.
            vec = self.vectors.create(name, np.float64 if dtype is None else _dtype(dtype))
        return vec

    def get(self, name: str, lo: int | None = None, hi: int | None = None) -> np.ndarray:
        """A copy of the global range ``[lo, hi)`` of ``name`` that falls in this shard."""
        vec = self.vector(name)
        a, b = self._local(lo, hi)
        return vec[a:b].copy()

    def set(self, name: str, lo: int, hi: int, values: np.ndarray) -> None:
        """Write ``values`` into the global range ``[lo, hi)`` (which must lie in this shard)."""
        values = np.asarray(values, dtype=np.float64)
        if lo < self.lo or hi > self.hi or hi - lo != values.shape[0]:
            raise InvalidOptionError(
                f"shard {self.index} owns [{self.lo}, {self.hi}); cannot set [{lo}, {hi}) "
                f"from {values.shape[0]} values"
            )
        if lo == self.lo and hi == self.hi:
            self.vectors[name] = np.array(values, dtype=np.float64, copy=True)
        else:
            self._target(name)[lo - self.lo : hi - self.lo] = values

    def _local(self, lo: int | None, hi: int | None) -> tuple[int, int]:
        a = self.lo if lo is None else max(lo, self.lo)
        b = self.hi if hi is None else min(hi, self.hi)
        return a - self.lo, max(a, b) - self.lo

    # -- batched ops -----------------------------------------------------------------------------------
    def run(self, ops: Sequence[Sequence[Any]]) -> list[Any]:
        """Apply ``ops`` in order; return one partial result per op (``None`` for vector-valued ops).

        Each op is a tuple ``(name, *args)``; see :data:`OPS` and the ``_op_*`` methods.
        """
        out: list[Any] = []
        for op in ops:
            handler = getattr(self, f"_op_{op[0]}", None)
            if handler is None or op[0] not in OPS:
                raise ProtocolError(f"unknown shard op {op[0]!r}; known ops: {sorted(OPS)}")
            t0 = time.perf_counter()
            # A destination stored as float32 exists before the op streams into it chunk by chunk (made
            # only once every term is there: else the op's own code says what is missing, nothing touched).
            if op[0] == "lincomb" and len(op) > 4 and op[1] not in op[3] and self._has_all(op[3]):
                self._target(op[1], op[4])
            if self._streams(op):
                out.append(run_chunked(self.vectors, op, functools.partial(self._on_chunk, op)))
            else:
                out.append(handler(*op[1:]))
            self._count(op[0], t0)
        return out

    def _has_all(self, names: Sequence[str]) -> bool:
        return all(n in self.vectors for n in names)

    def _count(self, kind: str, t0: float) -> None:
        """Add the seconds since ``t0`` to :attr:`op_seconds` and one op to :attr:`op_counts` under
        ``kind``."""
        self.op_seconds[kind] = self.op_seconds.get(kind, 0.0) + time.perf_counter() - t0
        self.op_counts[kind] = self.op_counts.get(kind, 0) + 1

    def _streams(self, op: Sequence[Any]) -> bool:
        """Whether ``op`` touches a spilled vector and can run chunk by chunk (else: on the memmap)."""
        if not self.vectors.spilled or not self.size:
            return False
        operands = op_operands(op)
        if operands is None or any(n not in self.vectors for n in operands[0]):
            return False  # a missing operand: the in-RAM path raises the error that says what to do
        return any(self.vectors.is_spilled(n) for n in operands[0] + operands[1])

    def _on_chunk(self, op: Sequence[Any], views: dict[str, np.ndarray], n: int) -> Any:
        # The op's own in-RAM code on one chunk of every operand: same kernels, same order within a chunk.
        chunk = Shard(self.index, 0, n)
        chunk.vectors.update(views)
        return getattr(chunk, f"_op_{op[0]}")(*op[1:])

    def close(self) -> None:
        """Remove this shard's spilled vector files."""
        self.vectors.close()

    def _op_fill(self, name: str, value: float) -> None:
        self._target(name).fill(value)

    def _op_copy(self, src: str, dst: str) -> None:
        source = self.vector(src)
        if src != dst:
            np.copyto(self._target(dst), source)

    def _op_scale(self, alpha: float, name: str) -> None:
        _kernels.scale(alpha, self.vector(name))

    def _op_axpy(self, alpha: float, x: str, y: str) -> None:
        xv, yv = self.vector(x), self.vector(y)
        if xv.shape != yv.shape:
            raise InvalidOptionError(f"axpy: {x!r} has {xv.size} elements and {y!r} {yv.size}")
        _kernels.axpy(alpha, xv, yv)

    def _op_lincomb(
        self, dst: str, coeffs: Sequence[float], names: Sequence[str], dtype: str | None = None
    ) -> None:
        """``dst = sum_i coeffs[i] * names[i]``; ``dst`` may be among ``names`` (updated in place).

        ``dtype`` (``"float64"`` or ``"float32"``): how ``dst`` is stored when this op writes it anew; the
        sum is float64 either way, rounded once per element into a float32 ``dst``.
        """
        if len(coeffs) != len(names) or not names:
            raise InvalidOptionError("lincomb needs as many coefficients as vectors, and at least one")
        if dtype is not None:
            _dtype(dtype)  # refused before any vector is touched
        terms = [(float(c), self.vector(n), n) for c, n in zip(coeffs, names, strict=True)]
        if names.count(dst) > 1:
            raise InvalidOptionError(f"lincomb: destination {dst!r} appears more than once among the terms")
        if dtype is not None and dst in names and self.vector(dst).dtype != _dtype(dtype):
            raise InvalidOptionError(
                f"lincomb: destination {dst!r} is one of the terms and stored as {self.vector(dst).dtype}, "
                f"not {dtype}; combine into another vector to store it as {dtype}"
            )
        if dst in names:
            own = next(c for c, _, n in terms if n == dst)
            rest = [(c, v) for c, v, n in terms if n != dst]
            _kernels.lincomb(self.vector(dst), [c for c, _ in rest], [v for _, v in rest], own=own)
        else:
            out = self._target(dst, dtype)
            _kernels.lincomb(out, [c for c, _, _ in terms], [v for _, v, _ in terms])

    def _op_mul(self, x: str, y: str, dst: str) -> None:
        np.multiply(self.vector(x), self.vector(y), out=self._target(dst))

    def _op_delete(self, name: str) -> None:
        self.vectors.pop(name, None)
        self.accumulators.pop(name, None)

    def _op_reset_acc(
        self,
        name: str,
        epoch: int,
        expected: int | None = None,
        finalize: Sequence[Sequence[Any]] = (),
        ordered: bool = False,
    ) -> None:
        self.reset_accumulator(name, epoch, expected, finalize, ordered=ordered)

    def _op_settle(self, name: str) -> int:
        return len(self.settle(name))

    def _op_dot(self, a: str, b: str) -> float:
        return self._op_dots([(a, b)])[0]

    def _op_dots(self, pairs: Sequence[tuple[str, str]]) -> list[float]:
        # Blocks of np.dot: the same OpenBLAS ddot, which releases the GIL (scipy.linalg.blas's f2py wrappers
        # hold it for the whole call and block the worker's event loop: benchmarks/shard_ops.py), one pass
        # over the distinct vectors (storage._kernels.dots).
        dots = _kernels.dots_mixed if self.vectors.holds_narrow else _kernels.dots  # float32 history
        return dots([(self.vector(a), self.vector(b)) for a, b in pairs])

    def _op_norm2(self, name: str) -> float:
        # The partial *squared* norm: the caller sums over shards and takes one square root.
        return self._op_dot(name, name)

    def _op_norm_inf(self, name: str) -> float:
        return _kernels.norm_inf(self.vector(name))

    def _op_sum(self, name: str) -> float:
        return float(self.vector(name).sum(dtype=np.float64))  # a float32 vector too: summed in float64

    # -- OWL-QN (Andrew & Gao 2007; the kernels are storage._l1's) --------------------------------------
    def _op_pseudo_grad(
        self, dst: str, g: str, x: str, l1: float, free: Sequence[tuple[int, int]] = ()
    ) -> None:
        """``dst`` = the pseudo-gradient of ``f + l1 ||x||_1`` from ``f``'s gradient ``g`` at ``x``; the
        global ranges ``free`` have no L1 term (storage._l1)."""
        local = _l1.local_ranges(free, self.lo, self.hi)
        _l1.pseudo_gradient(self.vector(g), self.vector(x), float(l1), local, out=self._target(dst))

    def _op_sign_align(self, d: str, v: str) -> None:
        """Zero the entries of ``d`` whose sign is not that of ``-v``."""
        _l1.sign_align(self.vector(d), self.vector(v))

    def _op_orthant(self, dst: str, x: str, v: str) -> None:
        """``dst = sign(x)``, or ``sign(-v)`` where ``x`` is 0."""
        _l1.orthant(self.vector(x), self.vector(v), out=self._target(dst))

    def _op_project_orthant(self, x: str, xi: str, free: Sequence[tuple[int, int]] = ()) -> None:
        """Zero the entries of ``x`` whose sign is not ``xi``'s."""
        _l1.project_orthant(self.vector(x), self.vector(xi), _l1.local_ranges(free, self.lo, self.hi))

    def _op_nnz(self, name: str) -> int:
        return _l1.nnz(self.vector(name))

    def _op_norm1(self, name: str, free: Sequence[tuple[int, int]] = ()) -> float:
        return _l1.norm1(self.vector(name), _l1.local_ranges(free, self.lo, self.hi))

    def prepare(self, epoch: int, ops: Sequence[Sequence[Any]]) -> list[Any]:
        """Run ``ops`` once for ``epoch``: the first caller runs them, later callers get the same results.

        Sandblaster fuses the coordinator's per-evaluation ops (form the trial point, zero the gradient
        accumulator) into the replicas' parameter fetch: whichever replica fetches first triggers them, so
        the coordinator saves a round trip per evaluation. An older epoch runs nothing.
        """
        if epoch > self.prepared_epoch:
            self.prepared = self.run(ops)
            self.prepared_epoch = epoch
        return self.prepared if epoch == self.prepared_epoch else []

    # -- updates from replicas -------------------------------------------------------------------------
    def push(
        self,
        grad: np.ndarray | None,
        *,
        source: str,
        seq: int,
        rule: str,
        lr: float,
        param: str = "x",
        fetched_version: int | None = None,
        staleness_scale: bool = False,
        keys: np.ndarray | None = None,
        steps: int = 1,
        tau: float | None = None,
    ) -> tuple[bool, int, int]:
        """Apply a Downpour update from ``source`` with sequence number ``seq`` (paper, section 4.1).

        A push whose ``seq`` is not above the last one applied from ``source`` changes nothing, so a
        retried call is never applied twice. Returns ``(applied, version_after, staleness)`` where staleness
        is the number of updates applied since the pusher fetched (``version - fetched_version``).

        With ``keys`` (sorted unique local offsets) ``grad`` holds only those entries (a key-value push,
        ps-lite style) and the rule runs only there: the same floats as a dense push whose other entries
        are zero, since a zero gradient leaves SGD's ``w`` and Adagrad's ``w`` and accumulator unchanged.

        With ``tau`` (a compressed push, Strom 2015: ``downpour._compress``) ``grad`` is None and ``keys`` are
        sign-coded (:func:`storage._keys.encode_signs`): each entry pushes ``+tau`` or ``-tau`` as a
        key-value push of those values would.

        ``steps`` (how many mini-batch gradients the push sums) only feeds the counters of :meth:`counters`.

        With ``staleness_scale`` the step is ``lr / (1 + s)`` where ``s`` counts the updates of *other*
        sources since ``fetched_version`` (:meth:`others_since`): the pusher's own earlier pushes are in
        the local copy its gradient was computed at (Downpour's replicas read their own writes), so they do
        not make it stale. The staleness returned counts every update.
        """
        if tau is not None:
            grad, keys = _signed_values(self.index, grad, keys, tau)
        staleness = 0 if fetched_version is None else max(0, self.version - fetched_version)
        if seq <= self.last_seq.get(source, -1):
            return False, self.version, staleness
        grad = np.asarray(grad, dtype=np.float64)
        w = self.vector(param)
        others = self.others_since(source, fetched_version) if staleness_scale else staleness
        step = lr / (1.0 + others) if staleness_scale else lr
        if keys is not None:
            self._push_at(np.asarray(keys), grad, rule, step, param)
            self._applied_push(source, seq)
            self._count_applied(steps, others, staleness_scale)
            return True, self.version, staleness
        if grad.shape != w.shape:
            raise InvalidOptionError(
                f"shard {self.index}: pushed slice has shape {grad.shape}, expected {w.shape}"
            )
        self._apply_rule(w, grad, rule, step, param, None)
        self._applied_push(source, seq)
        self._count_applied(steps, others, staleness_scale)
        return True, self.version, staleness

    def push_and_fetch(
        self,
        grad: np.ndarray | None,
        names: Sequence[str],
        *,
        fetch_keys: np.ndarray | None = None,
        **push: Any,
    ) -> tuple[tuple[bool, int, int], tuple[int, list[np.ndarray]]]:
        """:meth:`push`, then a replica's fetch of ``names`` (at ``fetch_keys`` only, if given), in one call.

        Downpour's fused step (issue 17, item 5): with ``n_push == n_fetch`` a replica's push of step ``k``
        and its fetch for step ``k + 1`` travel back to back on the same channel anyway, so one message
        does both and the fetched slices already hold the push. Returns ``(push answer, (version,
        slices))`` where the push answer is :meth:`push`'s and ``version`` is the shard's version after it.

        Examples
        --------
        >>> s = Shard(0, 0, 2); s.set("x", 0, 2, np.zeros(2))
        >>> s.push_and_fetch(np.ones(2), ["x"], source="r", seq=0, rule="sgd", lr=0.5)
        ((True, 1, 0), (1, [array([-0.5, -0.5])]))
        """
        answer = self.push(grad, **push)
        if fetch_keys is None:
            return answer, (self.version, [self.get(name) for name in names])
        return answer, (self.version, [self.gather(name, fetch_keys) for name in names])

    def others_since(self, source: str, fetched_version: int | None) -> int:
        """Updates applied since ``fetched_version`` by sources other than ``source`` (0 when unknown).

        Examples
        --------
        >>> s = Shard(0, 0, 2); s.set("x", 0, 2, np.zeros(2))
        >>> for src, seq in [("a", 0), ("b", 0), ("a", 1)]:
        ...     _ = s.push(np.ones(2), source=src, seq=seq, rule="sgd", lr=0.1)
        >>> s.others_since("a", 0), s.others_since("b", 0)
        (1, 2)
        """
        if fetched_version is None:
            return 0
        mine = self._own_versions.get(source, ())
        own = sum(1 for v in mine if v > fetched_version)
        return max(0, self.version - fetched_version - own)

    def _applied_push(self, source: str, seq: int) -> None:
        self.last_seq[source] = seq
        self.version += 1
        self._own_versions.setdefault(source, collections.deque(maxlen=_OWN_VERSIONS)).append(self.version)

    def _count_applied(self, steps: int, staleness: int, staleness_scale: bool) -> None:
        """``staleness`` here is the one the step was scaled by (other sources' updates)."""
        # The counters fault tests check answers against (a restored shard counts on from its checkpoint).
        self.applied += 1
        self.applied_weight += steps / (1.0 + staleness) if staleness_scale else float(steps)
        self.applied_steps_sq += steps * steps

    def _push_at(self, keys: np.ndarray, grad: np.ndarray, rule: str, step: float, param: str) -> None:
        """The update rule at ``keys`` only: the dense rule on the gathered entries, scattered back."""
        w = self.vector(param)
        _check_keys(self.index, keys, w.size)
        if grad.shape != keys.shape:
            raise InvalidOptionError(
                f"shard {self.index}: key-value push with {keys.size} keys and {grad.size} values "
                f"for a slice of {w.size}"
            )
        self._apply_rule(w, grad, rule, step, param, keys)

    def _apply_rule(
        self, w: np.ndarray, grad: np.ndarray, rule: str, step: float, param: str, keys: np.ndarray | None
    ) -> None:
        """SGD or Adagrad on ``w`` (the whole slice), or on its entries at ``keys`` (the same elementwise
        arithmetic in one pass over the keys: the same floats as a dense update there)."""
        check_rule(rule)
        acc: np.ndarray | None = None
        if rule == "adagrad":
            acc = self.vectors.get(f"{param}.adagrad")
            if acc is None:
                self.vectors[f"{param}.adagrad"] = np.zeros(self.size)
                # Read back: over the memory budget the store spilled it, and updates to the array given
                # would not reach the file.
                acc = self.vectors[f"{param}.adagrad"]
        if keys is not None and not keys.size:
            return  # nothing to update
        if acc is None:
            sgd_update(w, grad, lr=step, keys=keys)
        else:
            adagrad_update(w, grad, acc, lr=step, keys=keys)

    def gather(self, name: str, keys: np.ndarray | None) -> np.ndarray:
        """The values of vector ``name`` at the local offsets ``keys`` (a key-value pull, ps-lite style);
        ``None``: a copy of the whole slice (fewer bytes than keys that cover most of it).

        Examples
        --------
        >>> s = Shard(0, 10, 14); s.set("x", 10, 14, np.arange(4.0))
        >>> s.gather("x", np.array([1, 3], dtype=np.int32)).tolist()
        [1.0, 3.0]
        """
        vec = self.vector(name)
        if keys is None:
            return np.array(vec, dtype=np.float64, copy=True)
        keys = np.asarray(keys)
        if keys.size and (int(keys.min()) < 0 or int(keys.max()) >= vec.size):
            raise InvalidOptionError(f"shard {self.index}: keys outside its slice of {vec.size}")
        picked: np.ndarray = vec[keys]
        return picked

    def push_parts(
        self,
        name: str,
        parts: Sequence[tuple[np.ndarray | None, np.ndarray]],
        portions: Sequence[int],
        *,
        epoch: int,
    ) -> tuple[bool, list[Any] | None]:
        """Several portions in one message, each with its own gradient: ``parts[i]`` is portion
        ``portions[i]``'s ``(local keys or None for the whole slice, values)``. Each is taken as a solo push
        (:meth:`accumulate`), and the finalize ops run if they completed the evaluation.

        Examples
        --------
        >>> s = Shard(0, 0, 3)
        >>> s.reset_accumulator("g", 1, expected=2, finalize=[("settle", "g"), ("sum", "g")], ordered=True)
        >>> s.push_parts("g", [(np.array([0]), np.array([1.0])), (None, np.ones(3))], [1, 0], epoch=1)
        (True, [2, 4.0])
        >>> s.get("g").tolist()
        [2.0, 1.0, 1.0]
        """
        if len(parts) != len(portions) or len(set(portions)) != len(portions):
            raise InvalidOptionError(
                f"shard {self.index}: {len(parts)} gradients for portions {list(portions)[:8]}: one each"
            )
        checked: list[tuple[np.ndarray | None, np.ndarray]] = []
        for (keys, values), p in zip(parts, portions, strict=True):  # all checked before any is taken
            values = np.asarray(values, dtype=np.float64)
            if keys is not None:
                keys = np.asarray(keys)
                if values.ndim != 1 or keys.shape != values.shape:
                    raise InvalidOptionError(
                        f"shard {self.index}: portion {p} has {keys.size} keys but values of shape "
                        f"{values.shape}"
                    )
                _check_keys(self.index, keys, self.size)
            elif values.shape != (self.size,):
                raise InvalidOptionError(
                    f"shard {self.index}: portion {p}'s slice has shape {values.shape}, "
                    f"expected ({self.size},)"
                )
            checked.append((keys, values))
        taken = False
        for (keys, values), p in zip(checked, portions, strict=True):
            taken = self.accumulate(name, values, [p], epoch=epoch, solo=True, keys=keys) or taken
        return self._maybe_finalize(name, taken)

    def counters(self) -> dict[str, Any]:
        """The shard's Downpour counters: ``version``, ``applied`` (pushes applied), ``applied_weight`` and
        ``applied_steps_sq`` (see :meth:`push`). A shard restored from a checkpoint has the checkpoint's
        counters, so they always describe the updates its vectors hold.

        Examples
        --------
        >>> s = Shard(0, 0, 2); s.set("x", 0, 2, np.zeros(2))
        >>> s.push(np.ones(2), source="r", seq=0, rule="sgd", lr=0.1, steps=3)
        (True, 1, 0)
        >>> s.counters()
        {'version': 1, 'applied': 1, 'applied_weight': 3.0, 'applied_steps_sq': 9}
        """
        return {
            "version": self.version,
            "applied": self.applied,
            "applied_weight": self.applied_weight,
            "applied_steps_sq": self.applied_steps_sq,
        }

    def accumulate(
        self,
        name: str,
        values: np.ndarray,
        portions: Sequence[int],
        *,
        epoch: int,
        solo: bool = False,
        keys: np.ndarray | None = None,
    ) -> bool:
        """Add a replica's gradient over ``portions`` into accumulator ``name``, each portion exactly once.

        Sandblaster (paper, section 4.2) pushes two kinds of sums. A replica's *own* portions come as one
        summed push; no two such pushes share a portion within an epoch. Backup copies and portions
        recomputed after a replica was lost come *solo*, one portion per push, and are held aside: a solo
        portion that a summed push covers (before or after it) is dropped, and the rest are added by
        :meth:`settle`. So whichever copies arrive, in whatever order, every portion counts once, even
        after a replica died half-way through pushing to the shards.

        Reproducible (issue 18, item 6): ``values`` is either one portion's gradient slice (1-D), or a
        *binned* sum of several (a :mod:`storage._exactsum` state, 2-D), and the shard sums exactly, so the
        gradient's bits do not depend on which replica summed which portions or in what order pushes
        arrive. A 1-D push of several portions is taken as one term: its own rounding is the pusher's.

        With ``keys`` (local offsets, sorted and unique), ``values`` is one gradient's entries at those
        offsets only (a key-value push, :meth:`push_parts`); the other entries are zeros.

        Pushes for another ``epoch`` (a straggler's late result from an earlier evaluation) change nothing.
        Returns whether anything was taken.
        """
        t0 = time.perf_counter()
        try:
            return self._accumulate(name, values, portions, epoch, solo, keys)
        finally:
            self._count("accumulate", t0)

    def _accumulate(
        self,
        name: str,
        values: np.ndarray,
        portions: Sequence[int],
        epoch: int,
        solo: bool,
        keys: np.ndarray | None,
    ) -> bool:
        acc = self._accumulator(name)
        if epoch != acc.epoch:
            return False
        values = np.asarray(values, dtype=np.float64)
        bins = _exactsum.BINS + 1
        if keys is not None:
            if values.shape != keys.shape:
                raise InvalidOptionError(
                    f"shard {self.index}: pushed values have shape {values.shape}, expected {keys.shape}"
                )
        elif values.shape not in (acc.values.shape, (bins, *acc.values.shape)):
            raise InvalidOptionError(
                f"shard {self.index}: pushed slice has shape {values.shape}, expected {acc.values.shape} "
                f"(a gradient) or {(bins, *acc.values.shape)} (a binned sum)"
            )
        new = set(portions)
        if acc.ordered and len(new) == 1 and values.ndim == 1:
            solo = True  # one portion's own gradient: the same term, summed or not
        if solo:
            if len(new) != 1:
                raise ProtocolError(f"shard {self.index}: a solo push carries one portion, got {sorted(new)}")
            (p,) = new
            if p in acc.covered or p in acc.solos:
                return False
            if acc.ordered and p == acc.next_portion:
                _add_portion(acc, p, keys, values)  # its turn: added now, never held
            else:
                acc.solos[p] = (None if keys is None else keys.copy(), values.copy())
            if acc.ordered:
                _add_in_order(acc)
            return True
        if acc.ordered:
            raise ProtocolError(
                f"shard {self.index}: {name!r} sums portions in order and takes every portion's own gradient "
                f"(push_parts); got a sum over portions {sorted(new)[:5]}"
            )
        assert acc.binned is not None
        if new <= acc.covered:
            return False  # a retried push
        if new & acc.covered:
            raise ProtocolError(
                f"shard {self.index}: summed push to {name!r} overlaps portions already summed "
                f"({sorted(new & acc.covered)[:5]}); a portion is re-sent solo, never in a second sum"
            )
        for p in new & acc.solos.keys():
            del acc.solos[p]  # the summed push holds it: its backup copy must not count too
        _add_exactly(acc.binned, values, keys)
        acc.covered |= new
        return True

    def push_portions(
        self, name: str, values: np.ndarray, portions: Sequence[int], *, epoch: int, solo: bool = False
    ) -> tuple[bool, list[Any] | None]:
        """:meth:`accumulate`, then, if that completed the evaluation, its finalize ops (see ``reset_acc``).

        Returns ``(taken, results of the finalize ops or None)``: the push that brings in the last
        portion runs them (the gradient formed from the accumulator, the dot products the coordinator
        needs next) and carries their results back, which saves the coordinator a round trip.
        """
        taken = self.accumulate(name, values, portions, epoch=epoch, solo=solo)
        return self._maybe_finalize(name, taken)

    def _maybe_finalize(self, name: str, taken: bool) -> tuple[bool, list[Any] | None]:
        """Run the finalize ops if the push just taken completed the evaluation (:meth:`push_portions`)."""
        acc = self.accumulators[name]
        if (
            taken
            and acc.expected is not None
            and acc.final is None
            and len(acc.covered) + len(acc.solos) == acc.expected
        ):
            acc.final = self.run(acc.finalize)
            return True, acc.final
        return taken, None

    def final_results(self, name: str, epoch: int) -> list[Any] | None:
        """The finalize results of ``epoch`` if they ran (a fallback when the pusher's report was lost)."""
        acc = self.accumulators.get(name)
        return acc.final if acc is not None and acc.epoch == epoch else None

    def settle(self, name: str) -> list[int]:
        """Add the solo portions no summed push covered; return every portion the accumulator now holds."""
        acc = self._accumulator(name)
        if acc.ordered:
            # Portions that never came (a lost replica's, not recomputed) leave gaps: the rest in order.
            for p in sorted(acc.solos):
                _add_portion(acc, p, *acc.solos.pop(p))
            return sorted(acc.covered)
        assert acc.binned is not None
        for keys, values in acc.solos.values():
            _add_exactly(acc.binned, values, keys)
        acc.covered |= acc.solos.keys()
        acc.solos = {}
        # Rounded once, from the exact sum: the same bits whatever the pushes' grouping and order.
        np.copyto(acc.values, _exactsum.value(acc.binned))
        return sorted(acc.covered)

    def reset_accumulator(
        self,
        name: str,
        epoch: int,
        expected: int | None = None,
        finalize: Sequence[Sequence[Any]] = (),
        *,
        ordered: bool = False,
    ) -> None:
        """Zero accumulator ``name`` and open ``epoch`` (one evaluation): older pushes are refused.

        With ``expected`` (the number of portions), the push that completes the set runs ``finalize``
        (ops as in :meth:`run`; the first is normally ``("settle", name)``) and returns their results.
        ``ordered``: the sum of the portions ``0, 1, 2, ...`` in that order, each pushed with its own
        gradient (see :class:`_Accumulator`); else summed pushes are taken too, and summed exactly.
        """
        if expected is not None and expected > _exactsum.MAX_TERMS:
            raise InvalidOptionError(
                f"{expected} portions per evaluation: at most {_exactsum.MAX_TERMS} are summed exactly"
            )
        vec = self._target(name)
        vec.fill(0.0)
        old = self.accumulators.get(name)
        binned: np.ndarray | None = None
        if not ordered:
            if old is not None and old.binned is not None and old.binned.shape[1:] == vec.shape:
                binned = _exactsum.clear(old.binned)  # reused: a wide shard's binned sum is 4 vectors
            else:
                binned = _exactsum.zeros(vec.size)
        self.accumulators[name] = _Accumulator(
            epoch=epoch,
            values=vec,
            binned=binned,
            ordered=ordered,
            expected=expected,
            finalize=[tuple(op) for op in finalize],
        )

    def _accumulator(self, name: str) -> _Accumulator:
        acc = self.accumulators.get(name)
        if acc is None or acc.values is not self.vectors.get(name):
            raise InvalidOptionError(
                f"shard {self.index}: {name!r} is not an open accumulator; reset_acc it first"
            )
        return acc

    # -- persistence -----------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """Scalar state kept beside the vectors in a checkpoint (JSON-able).

        It includes the versions each source's pushes produced: :meth:`others_since` of a shard restored
        from it (a new one, or this one rolled back) leaves out the same updates as this shard does now.
        """
        own = {src: list(versions) for src, versions in self._own_versions.items()}
        state = {**self.counters(), "last_seq": dict(self.last_seq), "own_versions": own}
        narrow = self.narrow_dtypes()
        if narrow:
            state["dtypes"] = narrow  # only then: a float64 shard's state is as it always was
        return state

    def narrow_dtypes(self, names: Sequence[str] | None = None) -> dict[str, str]:
        """``{name: dtype}`` of the vectors (of ``names``, default all) not stored as float64.

        Examples
        --------
        >>> s = Shard(0, 0, 2); s.set("x", 0, 2, np.ones(2))
        >>> s.run([("lincomb", "s0", [0.5], ["x"], "float32")]); s.narrow_dtypes()
        [None]
        {'s0': 'float32'}
        """
        vs = self.vectors
        return {
            n: str(vs.dtype_of(n)) for n in (vs if names is None else names) if vs.dtype_of(n) != DTYPES[0]
        }

    def restore_dtypes(self, state: dict[str, Any]) -> None:
        """Store the vectors a checkpoint's ``state`` lists under ``dtypes`` in those dtypes again (a
        checkpoint array of another dtype holds their values exactly: float32 values upcast)."""
        for name, dtype in dict(state.get("dtypes", {})).items():
            if name in self.vectors and self.vectors.dtype_of(name) != _dtype(dtype):
                self.vectors[name] = np.asarray(self.vectors[name], dtype=_dtype(dtype))

    def load_state(self, state: dict[str, Any]) -> None:
        """Inverse of :meth:`state`.

        A checkpoint written before ``own_versions`` were kept restores none (every update it holds then
        counts as another source's, as in a new shard): never the versions of pushes it does not hold.
        """
        self.version = int(state.get("version", 0))
        self.last_seq = {str(k): int(v) for k, v in dict(state.get("last_seq", {})).items()}
        self._own_versions = {
            str(src): collections.deque((int(v) for v in versions), maxlen=_OWN_VERSIONS)
            for src, versions in dict(state.get("own_versions", {})).items()
        }
        self.applied = int(state.get("applied", 0))
        self.applied_weight = float(state.get("applied_weight", 0.0))
        self.applied_steps_sq = int(state.get("applied_steps_sq", 0))
        self.restore_dtypes(state)


def _dtype(name: object) -> np.dtype[Any]:
    """The storage dtype called ``name`` (``"float64"`` or ``"float32"``); anything else is refused."""
    for dt in DTYPES:
        if name == dt.name:
            return dt
    raise InvalidOptionError(
        f"a vector is stored as 'float64' or 'float32', got {name!r}; use one of these (history_dtype)"
    )


def _check_keys(index: int, keys: np.ndarray, size: int) -> None:
    """Refuse pushed keys that are not sorted, unique local offsets in ``[0, size)``: a negative one would
    update an entry from the end, a repeated one would lose one of its updates in the scatter."""
    if keys.ndim != 1 or (keys.size and keys.dtype.kind not in "iu"):
        raise InvalidOptionError(
            f"shard {index}: a key-value push needs a 1-D integer array of keys, got {keys.dtype}"
        )
    if keys.size and (int(keys[0]) < 0 or int(keys[-1]) >= size or not bool(np.all(keys[1:] > keys[:-1]))):
        raise InvalidOptionError(
            f"shard {index}: a key-value push needs sorted, unique local offsets in [0, {size}) "
            "(storage._keys.split_keys gives them)"
        )


def _signed_values(
    index: int, grad: np.ndarray | None, codes: np.ndarray | None, tau: float
) -> tuple[np.ndarray, np.ndarray]:
    """The values and keys of a sign-coded push (see :meth:`Shard.push`), checked."""
    if grad is not None or codes is None:
        raise InvalidOptionError(
            f"shard {index}: a compressed push (tau given) carries sign-coded keys and no values"
        )
    tau = float(tau)
    if not (np.isfinite(tau) and tau > 0):
        raise InvalidOptionError(f"shard {index}: a compressed push needs a finite tau > 0, got {tau!r}")
    keys, negative = decode_signs(codes)
    return np.where(negative, -tau, tau), keys


def _add_in_order(acc: _Accumulator) -> None:
    """Add the held portions that are next in order into an ordered accumulator's values."""
    while acc.next_portion in acc.solos:
        _add_portion(acc, acc.next_portion, *acc.solos.pop(acc.next_portion))


def _add_portion(acc: _Accumulator, p: int, keys: np.ndarray | None, values: np.ndarray) -> None:
    """``values`` of portion ``p`` into the accumulator, element by element (``a + g``: the bits do not
    depend on how the vector is cut, and a key-value add equals a dense add of zeros elsewhere)."""
    if keys is None:
        np.add(acc.values, values, out=acc.values)
    else:
        _kernels.add_at(acc.values, keys, values)
    acc.covered.add(p)
    acc.next_portion = max(acc.next_portion, p + 1)


def _add_exactly(binned: np.ndarray, values: np.ndarray, keys: np.ndarray | None = None) -> None:
    """Add a pushed gradient slice (one term) or binned sum (an :mod:`storage._exactsum` state) exactly;
    with ``keys``, ``values`` are one term's entries at those local offsets only.

    States are elementwise, so adding at the keys gives the sums of adding the dense vector that is zero
    elsewhere, in O(keys) time and memory (compiled loops, one pass: :func:`storage._exactsum.deposit_at`).
    """
    if keys is not None:
        _exactsum.deposit_at(binned, keys, values)
    elif values.ndim == 1:
        _exactsum.deposit(binned, values)
    else:
        _exactsum.merge(binned, values)
