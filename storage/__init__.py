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

from distbelief.storage._actor import keep_loop_responsive
from distbelief.storage._dataset import Dataset, resolve_name
from distbelief.storage._digits import digits_dataset, load_digits
from distbelief.storage._kernels import accrue_step, axpy, scaled_gradient
from distbelief.storage._layout import Layout
from distbelief.storage._malloc import reuse_freed_memory
from distbelief.storage._partition_layout import partition_layout, partition_shards
from distbelief.storage._rowcache import ROW_CACHE_ENV, RowCache, default_row_cache
from distbelief.storage._rules import RULES, adagrad_update, check_rule, sgd_update
from distbelief.storage._server import Batch, ParameterServer, ServerStats, ShardMap, reduce_results
from distbelief.storage._session import (
    as_dataset,
    embedded_client,
    is_loopback,
    scheduler_identity,
    start_vector,
    worker_addresses,
)
from distbelief.storage._shard import OPS, Shard

__all__ = [
    "OPS",
    "ROW_CACHE_ENV",
    "RULES",
    "Batch",
    "Dataset",
    "Layout",
    "ParameterServer",
    "RowCache",
    "ServerStats",
    "Shard",
    "ShardMap",
    "accrue_step",
    "adagrad_update",
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
    "worker_addresses",
]
