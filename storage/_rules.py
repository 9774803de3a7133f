"""Update rules that a shard applies to a pushed gradient slice (DistBelief paper, section 4.1).

Plain numpy functions on one shard's slice, with no Dask or zarr inside, so they are tested on their own and
reused by single-process references. They update ``w`` (and the Adagrad accumulator) in place.
"""

from __future__ import annotations

from typing import Literal, get_args

import numpy as np

from distbelief.errors import InvalidOptionError

from . import _kernels

__all__ = ["ADAGRAD_EPS", "RULES", "Rule", "adagrad_update", "check_rule", "sgd_update"]

#: Added under the square root so the very first Adagrad step is finite; the paper's rule has no epsilon
#: because its accumulators start after at least one gradient. 1e-8 keeps the first step ~= lr * sign(g).
ADAGRAD_EPS = 1e-8


def sgd_update(w: np.ndarray, g: np.ndarray, *, lr: float, keys: np.ndarray | None = None) -> None:
    """Plain SGD, ``w -= lr * g``, in place (:func:`storage._kernels.axpy`: no temporary, and the same bits
    for an entry whether the whole slice or a subset of it is updated, on any CPU). With ``keys`` (unique),
    only ``w[keys]`` moves, by ``g`` holding one value a key.

    Examples
    --------
    >>> w = np.ones(3); sgd_update(w, np.ones(3), lr=0.5); w
    array([0.5, 0.5, 0.5])
    """
    if keys is None:
        _kernels.axpy(-lr, g, w)
    else:
        _kernels.axpy_at(-lr, g, w, keys)


def adagrad_update(
    w: np.ndarray, g: np.ndarray, accumulator: np.ndarray, *, lr: float, keys: np.ndarray | None = None
) -> None:
    """Adagrad as in the paper: ``acc += g**2; w -= lr * g / sqrt(acc)``, per parameter, in place.

    The learning rate of parameter ``i`` at its K-th update is ``lr / sqrt(sum_{j<=K} g_ij**2)``. With
    ``keys`` (unique), only the entries at them move, ``g`` holding one value a key (the same floats there).

    Examples
    --------
    >>> w = np.zeros(2); acc = np.zeros(2)
    >>> adagrad_update(w, np.array([2.0, -4.0]), acc, lr=0.1); np.round(w, 6)
    array([-0.1,  0.1])
    """
    g = np.asarray(g, dtype=np.float64)
    if keys is None:
        _kernels.adagrad_step(w, g, accumulator, lr=lr, eps=ADAGRAD_EPS)
    else:
        _kernels.adagrad_step_at(w, g, accumulator, keys, lr=lr, eps=ADAGRAD_EPS)


#: The update rules a shard applies to Downpour pushes (and the single-process reference, by name): the one
#: registry, which ``downpour.DownpourOptions.rule`` and the REST schema's ``rule`` are typed with.
Rule = Literal["sgd", "adagrad"]
RULES: tuple[str, ...] = get_args(Rule)


def check_rule(rule: object) -> None:
    """Refuse an update rule that is not one of :data:`RULES`, saying which there are.

    Examples
    --------
    >>> check_rule("adagrad")
    >>> check_rule("adam")
    Traceback (most recent call last):
    ...
    distbelief.errors.InvalidOptionError: unknown update rule 'adam'; use 'sgd' or 'adagrad'
    """
    if rule not in RULES:
        raise InvalidOptionError(f"unknown update rule {rule!r}; use 'sgd' or 'adagrad'")
