"""Downpour SGD: asynchronous model replicas against the sharded parameter server (DistBelief, section 4.1).

Each replica trains on its own contiguous part of the rows, fetches the parameters every ``n_fetch`` steps,
pushes its accrued gradient every ``n_push`` steps, and the parameter-server shards apply every push on their
own, with plain SGD or Adagrad. :func:`train` is the front door; :class:`ReplicaCore` is the replica's logic
with no Dask in it, and :func:`sequential_sgd` the single-process reference it reduces to. See :func:`train`
for an example.
"""

from ._batches import BatchPlan, split_rows
from ._compress import Compression
from ._core import FetchRequest, PushMessage, ReplicaCore, ReplicaCounters
from ._options import DEFAULT_LR, DownpourOptions, auto_sync
from ._reference import ReferenceResult, sequential_sgd
from ._train import Progress, TrainResult, train
from ._watch import StepRuleStallWarning

__all__ = [
    "DEFAULT_LR",
    "BatchPlan",
    "Compression",
    "DownpourOptions",
    "FetchRequest",
    "Progress",
    "PushMessage",
    "ReferenceResult",
    "ReplicaCore",
    "ReplicaCounters",
    "StepRuleStallWarning",
    "TrainResult",
    "auto_sync",
    "sequential_sgd",
    "split_rows",
    "train",
]
