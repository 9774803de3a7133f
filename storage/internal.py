"""What distbelief's own packages (sandblaster, downpour, models, api, sklearn) use of storage; not for users.

Users import from :mod:`distbelief.storage`. The other packages of distbelief reach storage's private modules
only through this module (docs/architecture.md, "Imports"; ruff's PLC2701 flags an absolute import of a
private module), so what crosses the package boundary is listed here and nowhere else. Nothing here is a
stable API: it changes with the packages that use it.
"""

from . import _exactsum as exactsum
from . import _kernels as kernels
from . import _l1 as l1_ops
from ._actor import HandedPush, HandOut, read_stored_vector
from ._calls import (
    DEAD_STATES,
    POLL,
    ShardRecovery,
    actor_gone,
    await_call,
    confirm_dead_async,
    current_worker,
    gather_calls,
    start_call,
    task_result,
)
from ._cluster import resolve_client
from ._dataset_frames import dataset_from_frame
from ._dataset_location import DATASET_NAME_PATTERN, DATASET_NAME_RULE, list_datasets
from ._dataset_sources import dataset_from_dask
from ._direct import direct_call
from ._direct import install as install_direct_calls
from ._exchange import PartitionPeer, PassAborted, call_peer
from ._keys import (
    COMMUNICATION,
    Communication,
    SparsePortion,
    compact_batch,
    compact_model,
    compact_rows,
    encode_signs,
    kv_bytes,
    param_keys,
    rows_keys,
    sparse_layout_of,
    split_keys,
    union_keys,
    use_sparse,
    whole_slice_is_smaller,
)
from ._malloc import KEEP_FREE_BYTES
from ._monitor import Sample, install_worker, shard_samples
from ._server import read_attrs, worker_alive
from ._session import run_store
from ._sparse import as_csr, is_sparse, nbytes
from ._store import normalize_url

__all__ = [
    "COMMUNICATION",
    "DATASET_NAME_PATTERN",
    "DATASET_NAME_RULE",
    "DEAD_STATES",
    "KEEP_FREE_BYTES",
    "POLL",
    "Communication",
    "HandOut",
    "HandedPush",
    "PartitionPeer",
    "PassAborted",
    "Sample",
    "ShardRecovery",
    "SparsePortion",
    "actor_gone",
    "as_csr",
    "await_call",
    "call_peer",
    "compact_batch",
    "compact_model",
    "compact_rows",
    "confirm_dead_async",
    "current_worker",
    "dataset_from_dask",
    "dataset_from_frame",
    "direct_call",
    "encode_signs",
    "exactsum",
    "gather_calls",
    "install_direct_calls",
    "install_worker",
    "is_sparse",
    "kernels",
    "kv_bytes",
    "l1_ops",
    "list_datasets",
    "nbytes",
    "normalize_url",
    "param_keys",
    "read_attrs",
    "read_stored_vector",
    "resolve_client",
    "rows_keys",
    "run_store",
    "shard_samples",
    "sparse_layout_of",
    "split_keys",
    "start_call",
    "task_result",
    "union_keys",
    "use_sparse",
    "whole_slice_is_smaller",
    "worker_alive",
]
