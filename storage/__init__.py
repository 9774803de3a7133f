"""The parameter server (sharded vectors on Dask actors, kept in zarr) and datasets in zarr.

Examples
--------
>>> import numpy as np
>>> from distributed import Client, LocalCluster
>>> from distbelief.storage import ParameterServer
>>> client = Client(LocalCluster(n_workers=2, processes=False))            # doctest: +SKIP
>>> ps = ParameterServer.create(client, 1_000, shards=2, store="/tmp/ps")  # doctest: +SKIP
>>> ps.scatter("x", np.ones(1_000)); ps.dot("x", "x")                      # doctest: +SKIP
1000.0
"""

from ._actor import keep_loop_responsive
from ._dataset import Dataset
from ._dataset_location import resolve_name
from ._digits import digits_dataset, load_digits, train_test_split_digits
from ._kernels import (
    accrue_at,
    accrue_rows,
    accrue_step,
    add_at_positions,
    add_rows_at_positions,
    axpy,
    scaled_gradient,
    take_at,
)
from ._layout import Layout
from ._malloc import reuse_freed_memory
from ._partition_layout import partition_layout, partition_shards
from ._rowcache import ROW_CACHE_ENV, RowCache, default_row_cache
from ._rules import RULES, Rule, adagrad_update, check_rule, sgd_update
from ._server import Batch, ParameterServer, ServerStats, ShardMap, reduce_results
from ._session import (
    as_dataset,
    embedded_client,
    is_loopback,
    scheduler_identity,
    start_vector,
    worker_addresses,
)
from ._shard import OPS, Shard

__all__ = [
    "OPS",
    "ROW_CACHE_ENV",
    "RULES",
    "Batch",
    "Dataset",
    "Layout",
    "ParameterServer",
    "RowCache",
    "Rule",
    "ServerStats",
    "Shard",
    "ShardMap",
    "accrue_at",
    "accrue_rows",
    "accrue_step",
    "adagrad_update",
    "add_at_positions",
    "add_rows_at_positions",
    "as_dataset",
    "axpy",
    "check_rule",
    "default_row_cache",
    "digits_dataset",
    "embedded_client",
    "is_loopback",
    "keep_loop_responsive",
    "load_digits",
    "partition_layout",
    "partition_shards",
    "reduce_results",
    "resolve_name",
    "reuse_freed_memory",
    "scaled_gradient",
    "scheduler_identity",
    "sgd_update",
    "start_vector",
    "take_at",
    "train_test_split_digits",
    "worker_addresses",
]
