"""``downpour.train(deterministic=True)``: the same bits on every rerun with 1 and 2 replicas, whatever the
timing (storage/_rounds.py), on the session's real cluster; and the options it refuses."""

from __future__ import annotations

import cloudpickle
import numpy as np
import pytest
import scipy.sparse as sp
from distributed import Client

from distbelief import downpour, models
from distbelief.errors import InvalidOptionError
from distbelief.storage import train_test_split_digits
from tests.downpour import _helpers
from tests.downpour._helpers import Jittery

cloudpickle.register_pickle_by_value(_helpers)

X_TR, Y_TR, X_TE, Y_TE = train_test_split_digits(seed=0)


def _run(
    client: Client, model: object, data: tuple[object, np.ndarray], **kw: object
) -> downpour.TrainResult:
    opts = {"rule": "adagrad", "lr": 0.1, "epochs": 2, "n_fetch": 3, "n_push": 3, "client": client, **kw}
    return downpour.train(model, data, **opts)  # type: ignore[arg-type]


@pytest.mark.parametrize("replicas", [1, 2])
def test_reruns_give_the_same_bits_whatever_the_timing(client: Client, replicas: int) -> None:
    # Random sleeps in every step scramble which replica's push reaches a shard first.
    model = Jittery(models.Softmax(64, 10))
    runs = [_run(client, model, (X_TR, Y_TR), replicas=replicas, deterministic=True) for _ in range(2)]
    runs.append(_run(client, model, (X_TR, Y_TR), replicas=replicas, deterministic=True, fuse=False))
    first = runs[0]
    assert first.success and first.stop_reason == "epochs", first.message
    for res in runs[1:]:
        np.testing.assert_array_equal(res.x, first.x)
        assert res.steps == first.steps
    # It trained: better than chance on the held-out rows.
    assert models.Softmax(64, 10).accuracy(first.x, X_TE, Y_TE) > 0.8


def test_sparse_rows_with_key_value_pushes_rerun_bit_for_bit(client: Client) -> None:
    rng = np.random.default_rng(0)
    X = sp.random_array((600, 200), density=0.05, random_state=rng, format="csr")
    y = (X @ rng.normal(size=200) > 0).astype(float)
    model = Jittery(models.Logistic(200))
    runs = [_run(client, model, (X, y), replicas=2, deterministic=True) for _ in range(2)]
    assert runs[0].stats["communication"] == "sparse"
    np.testing.assert_array_equal(runs[0].x, runs[1].x)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"n_fetch": 2, "n_push": 3}, "n_fetch=2 .*equal to n_push"),
        ({"warmstart_steps": 5}, "warmstart_steps=5 .*0 with deterministic=True"),
        ({"deterministic": "yes"}, "deterministic='yes'.*True or False"),
        (
            {"partitions": 2, "max_steps": 4, "epochs": None},
            "deterministic=True is not supported with partitions=2",
        ),
    ],
)
def test_options_it_cannot_honour_are_refused(client: Client, options: dict[str, object], match: str) -> None:
    kw: dict[str, object] = {"deterministic": True, **options}
    with pytest.raises(InvalidOptionError, match=match):
        _run(client, models.Softmax(64, 10), (X_TR, Y_TR), replicas=2, **kw)


def test_resume_is_refused(client: Client, tmp_path: object) -> None:
    with pytest.raises(InvalidOptionError, match=r"resume=True .*False with deterministic=True"):
        _run(client, models.Softmax(64, 10), (X_TR, Y_TR), deterministic=True, resume=True, store=tmp_path)
