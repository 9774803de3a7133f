"""What a finished run can do with its model: predict, and be saved to / loaded from zarr with its spec.

:class:`FittedMixin` is shared by ``sandblaster.OptimizeResult`` and ``downpour.TrainResult`` (dataclasses
with ``x`` and a ``model``). A saved result is a zarr v3 group::

    attrs   {"format": "distbelief.result", "type": "OptimizeResult", "model_spec": {...} | null,
             "fields": {every other field that is JSON-able: fun, nit, message, stats, ...}}
    x       the parameters (float64)
    history the per-iteration / per-evaluation xarray.Dataset (written by xarray)
    losses/ Downpour's per-replica traces, one array per replica (when there are any)
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, TypeVar

import numpy as np
from numpy.typing import ArrayLike, NDArray

from distbelief.errors import InvalidOptionError, StoreError

from ._base import Model

__all__ = ["RESULT_FORMAT", "FittedMixin", "model_spec"]

RESULT_FORMAT = "distbelief.result"

T = TypeVar("T", bound="FittedMixin")


def model_spec(model: object) -> dict[str, Any] | None:
    """The JSON-able spec of ``model`` (built-ins, or a wrapper with a ``model`` that has one), or None."""
    for candidate in (model, getattr(model, "model", None)):
        spec = getattr(candidate, "spec", None)
        if isinstance(spec, dict):
            return spec
    return None


def _plain(value: Any) -> Any:
    """``value`` with numpy scalars and arrays turned into JSON types (for the group's attributes)."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    # NaN and infinities stay floats: zarr writes and reads them back as such (a NaN turned into None made
    # a diverged result's fun None after a reload, and its repr raise).
    return value


class FittedMixin:
    """``predict`` through the run's model, and ``to_zarr`` / ``from_zarr`` with the model spec."""

    x: NDArray[np.float64]
    model: Model | None

    def _fitted_model(self, what: str) -> Any:
        method = getattr(self.model, what, None)
        if self.model is None or not callable(method):
            raise InvalidOptionError(
                f"this result's model ({type(self.model).__name__}) has no {what}(w, X); call "
                f"model.{what}(result.x, X) with a model that has one"
            )
        return method

    def predict(self, X: ArrayLike) -> NDArray[Any]:
        """The model's predictions on ``X`` at the parameters ``x`` (labels, or real values).

        Examples
        --------
        >>> res = sandblaster.minimize(models.Logistic(64), (X, y))   # doctest: +SKIP
        >>> res.predict(X[:3])                                         # doctest: +SKIP
        array([1, 0, 0])
        """
        return np.asarray(self._fitted_model("predict")(self.x, X))

    def predict_proba(self, X: ArrayLike) -> NDArray[np.float64]:
        """The model's class probabilities on ``X`` at ``x`` (classifiers only)."""
        return np.asarray(self._fitted_model("predict_proba")(self.x, X), dtype=np.float64)

    def to_zarr(self, url: str, *, storage_options: dict[str, Any] | None = None) -> None:
        """Save the result (parameters, model spec, history, scalars) as a zarr group at ``url``.

        A model without a spec (a custom model) cannot be rebuilt, so it is not saved (``model_spec`` is
        null); the parameters and history still are, and :meth:`from_zarr` then needs ``model=``. Saving
        over an earlier result at ``url`` replaces it. Fields that are not JSON-able are saved as their
        ``repr``.

        Raises
        ------
        InvalidOptionError
            ``url`` is not a non-empty string.

        Examples
        --------
        >>> res.to_zarr("/tmp/run-1")                         # doctest: +SKIP
        >>> OptimizeResult.from_zarr("/tmp/run-1").predict(X)  # doctest: +SKIP
        """
        import xarray as xr
        import zarr

        if not isinstance(url, str) or not url:
            raise InvalidOptionError(f"url must be a directory path or fsspec URL string, got {url!r}")
        fields: dict[str, Any] = {}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            if f.name in ("x", "history", "model", "losses"):
                continue
            value = _plain(getattr(self, f.name))
            try:
                json.dumps(value)
            except (TypeError, ValueError):
                value = repr(value)
            fields[f.name] = value
        group = zarr.open_group(url, mode="a", zarr_format=3, storage_options=storage_options)
        # Saving over an earlier result: its history and per-replica traces must not survive beside ours.
        for stale in ("history", "losses"):
            if stale in group:
                del group[stale]
        history = getattr(self, "history", None)
        if isinstance(history, xr.Dataset):
            history.to_zarr(
                url,
                group="history",
                mode="w",
                zarr_format=3,
                consolidated=False,
                storage_options=storage_options,
            )
        group.attrs.update(
            {
                "format": RESULT_FORMAT,
                "type": type(self).__name__,
                "model_spec": model_spec(self.model),
                "fields": fields,
            }
        )
        x = np.ascontiguousarray(self.x, dtype=np.float64)
        group.create_array("x", shape=x.shape, dtype="float64", overwrite=True)[:] = x
        losses = getattr(self, "losses", None) or {}
        for replica, trace in losses.items():
            arr = np.asarray(trace, dtype=np.float64)
            group.create_array(f"losses/{replica}", shape=arr.shape, dtype="float64", overwrite=True)[:] = arr

    @classmethod
    def from_zarr(
        cls: type[T], url: str, *, model: Model | None = None, storage_options: dict[str, Any] | None = None
    ) -> T:
        """Load a result saved by :meth:`to_zarr`; its model is rebuilt from the spec (or pass ``model=``).

        Raises
        ------
        StoreError
            Nothing readable at ``url``, or it holds something else (another result type, not a result).
        """
        import xarray as xr
        import zarr

        from ._factory import from_spec

        try:
            group = zarr.open_group(url, mode="r", use_consolidated=False, storage_options=storage_options)
        except (FileNotFoundError, ValueError, KeyError, OSError) as exc:
            raise StoreError(
                f"no saved result at {url!r} ({exc}); save one with result.to_zarr(url)"
            ) from exc
        attrs: dict[str, Any] = dict(group.attrs)
        if attrs.get("format") != RESULT_FORMAT or attrs.get("type") != cls.__name__:
            raise StoreError(
                f"{url!r} does not hold a saved {cls.__name__} (format {attrs.get('format')!r}, type "
                f"{attrs.get('type')!r}); open it with the class that saved it"
            )
        spec = attrs.get("model_spec")
        if model is None and spec is not None:
            model = from_spec(spec)
        values: dict[str, Any] = dict(attrs.get("fields", {}))
        x_array: Any = group["x"]
        values["x"] = np.asarray(x_array[:], dtype=np.float64)
        names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        if "history" in names:
            try:
                values["history"] = xr.open_zarr(
                    url, group="history", storage_options=storage_options, consolidated=False
                ).load()
            except (FileNotFoundError, KeyError, OSError):
                values["history"] = xr.Dataset()
        if "losses" in names and "losses" in group:
            traces: Any = group["losses"]
            values["losses"] = {int(k): np.asarray(v[:]) for k, v in traces.arrays()}
        if "model" in names:
            values["model"] = model
        return cls(**{k: v for k, v in values.items() if k in names})
