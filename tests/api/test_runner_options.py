"""The runner's own arguments never clash with a job's options; datasets are opened once per version.

Issue 18: a ``resume`` in a job's options (a record from elsewhere, or a ``JobCreate`` built without
validation) met the runner's own ``resume`` as a TypeError ("got multiple values for keyword argument"),
for Sandblaster on every run and for Downpour on every resumed run.
"""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import pytest
from distributed import Client as DaskClient

from distbelief import downpour, models, sandblaster
from distbelief.api._jobstore import JobStore
from distbelief.api.runner import (
    SERVICE_OPTIONS,
    JobRunner,
    RunContext,
    UnknownDatasetError,
    run_downpour,
    run_sandblaster,
)
from distbelief.api.schemas import JobCreate
from distbelief.errors import InvalidOptionError
from distbelief.storage import Dataset
from tests.api.conftest import LOGISTIC, running_app, settings_for, tiny_xy


class _Called(Exception):
    """Raised by the stand-in algorithms with the keyword arguments they were given."""

    def __init__(self, kwargs: dict[str, Any]) -> None:
        super().__init__("called")
        self.kwargs = kwargs


def _stand_in(*args: Any, **kwargs: Any) -> Any:
    raise _Called(kwargs)


def _ctx(algorithm: str, options: dict[str, Any], *, resume: bool) -> RunContext:
    return RunContext(
        job_id="0" * 16,
        algorithm=algorithm,
        model=models.Logistic(4),
        data=None,  # type: ignore[arg-type]  # the stand-ins never read it
        eval_data=None,
        options=options,
        client=None,  # type: ignore[arg-type]
        store="/nowhere",
        callback=lambda record: None,
        resume=resume,
    )


@pytest.mark.parametrize(
    ("adapter", "algorithm", "module", "entry"),
    [
        (run_sandblaster, "sandblaster-lbfgs", sandblaster, "minimize"),
        (run_downpour, "downpour-sgd", downpour, "train"),
    ],
)
@pytest.mark.parametrize("resume", [False, True])
def test_the_runner_passes_resume_once_and_refuses_a_users_own(
    monkeypatch: pytest.MonkeyPatch, adapter: Any, algorithm: str, module: Any, entry: str, resume: bool
) -> None:
    monkeypatch.setattr(module, entry, _stand_in)
    with pytest.raises(_Called) as called:
        adapter(_ctx(algorithm, {"epochs": 1}, resume=resume))
    assert called.value.kwargs["resume"] is resume and called.value.kwargs["epochs"] == 1
    for key in ("resume", "store"):
        with pytest.raises(InvalidOptionError, match=f"sets '{key}' itself"):
            adapter(_ctx(algorithm, {"epochs": 1, key: not resume}, resume=resume))


def test_a_job_carrying_a_service_option_is_refused_at_submit_and_nothing_is_stored(
    tmp_path: Path, client: DaskClient
) -> None:
    store = JobStore(str(tmp_path / "store"))
    Dataset.from_arrays(*tiny_xy(), path=store.url("datasets", "tiny"))
    runner = JobRunner(settings_for(tmp_path / "store"), store, client)
    try:
        cases: tuple[tuple[Any, dict[str, Any]], ...] = (
            ("sandblaster-lbfgs", {}),
            ("downpour-sgd", {"epochs": 1}),
        )
        for algorithm, options in cases:
            for key in sorted(SERVICE_OPTIONS):
                # model_construct skips JobCreate's own check, as a caller of the runner might.
                create = JobCreate.model_construct(
                    algorithm=algorithm,
                    model=LOGISTIC,  # type: ignore[arg-type]  # a spec dict, left as it is by model_construct
                    dataset="tiny",
                    eval_dataset=None,
                    options={**options, key: True},
                    name=None,
                )
                with pytest.raises(InvalidOptionError, match=f"sets '{key}' itself"):
                    runner.submit(create)
        assert store.load_records() == [] and runner.list_jobs() == ([], 0)
    finally:
        runner.stop(timeout=1)


def test_an_opened_dataset_is_reused_until_the_datasets_change(tmp_path: Path, client: DaskClient) -> None:
    store = JobStore(str(tmp_path / "store"))
    runner = JobRunner(settings_for(tmp_path / "store"), store, client)

    def install(n: int) -> None:
        staged = store.staging_url("d")
        Dataset.from_arrays(*tiny_xy(n=n), path=staged)
        store.install_dataset("d", staged)

    try:
        install(40)
        first = runner.open_dataset("d")
        assert first.n_rows == 40 and runner.open_dataset("d") is first
        install(80)  # replaced: the next open sees the new rows
        assert runner.open_dataset("d").n_rows == 80
        store.save_link("e", store.url("datasets", "d"))  # registered under another name
        assert runner.open_dataset("e").n_rows == 80
        store.delete_link("e")
        with pytest.raises(UnknownDatasetError):
            runner.open_dataset("e")
        store.delete_dataset("d")
        with pytest.raises(UnknownDatasetError):
            runner.open_dataset("d")
    finally:
        runner.stop(timeout=1)


@pytest.mark.anyio
async def test_the_app_freezes_once_after_its_first_job(
    tmp_path: Path, client: DaskClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    freezes: list[int] = []
    freeze = gc.freeze

    def counted() -> None:
        freezes.append(1)
        freeze()

    monkeypatch.setattr(gc, "freeze", counted)
    async with running_app(settings_for(tmp_path / "store"), client) as (app, _):
        runner = app.state.runner
        assert freezes == [1]  # the app's own, at its start
        # A job's thread collects garbage as the job ends: the first time the runner is idle then, what the
        # first job left (its modules' objects) is frozen ...
        runner._collect_garbage()
        assert len(freezes) == 2
        # ... and only then: later collections leave the frozen set alone.
        runner._collect_garbage()
        assert len(freezes) == 2
    # A runner of its own (not the app's) never freezes: the process is not the service's.
    alone = JobRunner(settings_for(tmp_path / "store"), JobStore(str(tmp_path / "store")), client)
    alone._collect_garbage()
    alone.stop(timeout=1)
    assert len(freezes) == 2


def test_a_downpour_job_with_more_replicas_than_rows_is_refused_at_submission(tmp_path: Path) -> None:
    # It was accepted (201) and failed when it started: "cannot split 10 rows among 20 replicas".
    X, y = tiny_xy(n=10)
    settings = settings_for(tmp_path)
    store = JobStore(settings.store)
    Dataset.from_arrays(X, y, path=f"{store.datasets_root}/ten")
    runner = JobRunner(settings, store, client=None)  # type: ignore[arg-type]
    body = {"algorithm": "downpour-sgd", "dataset": "ten", "model": LOGISTIC}
    try:
        with pytest.raises(InvalidOptionError, match="cannot split 10 rows among 20 replicas"):
            runner.submit(JobCreate.model_validate({**body, "options": {"epochs": 1, "replicas": 20}}))
        assert runner.list_jobs()[1] == 0 and store.load_records() == []  # nothing queued or stored
    finally:
        runner._stopping.set()
        runner.stop(timeout=0.1)
