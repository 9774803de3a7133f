"""Sandblaster: distributed batch optimization (L-BFGS, CG, GD) over a sharded parameter server.

DistBelief paper, section 4.2. The coordinator holds scalars only; the vectors live on parameter-server
shards and model replicas compute the objective portion by portion, with backup copies for stragglers.

Examples
--------
>>> from distbelief import sandblaster
>>> from distbelief.models import Logistic
>>> from distbelief.storage import load_digits
>>> X, y = load_digits()
>>> res = sandblaster.minimize(Logistic(64), (X, (y == 0).astype(float)), l2=1e-3)  # doctest: +SKIP
"""

from ._coordinator import IterationRecord
from ._minimize import OptimizeResult, SandblasterOptions, minimize

__all__ = ["IterationRecord", "OptimizeResult", "SandblasterOptions", "minimize"]
