"""Job metrics as ``xarray`` datasets: shared by the service and its light client (numpy and xarray only)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
import xarray as xr

__all__ = ["metrics_to_dataset"]


def metrics_to_dataset(dim: str, columns: Sequence[str], rows: npt.ArrayLike) -> xr.Dataset:
    """Rows of metrics (the first column indexes them) as an ``xarray.Dataset`` with one variable each.

    Examples
    --------
    >>> ds = metrics_to_dataset("iteration", ["iteration", "objective"], [[0, 2.0], [1, 1.5]])
    >>> ds.objective.values.tolist(), ds.iteration.values.tolist()
    ([2.0, 1.5], [0, 1])
    """
    values = np.asarray(rows, dtype=np.float64).reshape(-1, len(columns))
    index = values[:, 0].astype(np.int64)
    return xr.Dataset(
        {name: (dim, values[:, j]) for j, name in enumerate(columns) if j > 0},
        coords={dim: index},
    )
