"""The REST job options (``SandblasterJobOptions``, ``DownpourJobOptions``) are made from the algorithms'
options dataclasses; their public JSON schema is the one the service published before they were: the same
fields, types and bounds (``data/job_options_schema.json``, descriptions left out: they are docs)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from distbelief import downpour, sandblaster
from distbelief.api.schemas import DownpourJobOptions, SandblasterJobOptions, options_json_schema

SNAPSHOT = Path(__file__).parent / "data" / "job_options_schema.json"


def _contract(node: Any) -> Any:
    """``node`` without descriptions and with every enum sorted (neither changes what is accepted)."""
    if isinstance(node, dict):
        return {k: sorted(v) if k == "enum" else _contract(v) for k, v in node.items() if k != "description"}
    if isinstance(node, list):
        return [_contract(v) for v in node]
    return node


def test_the_options_schema_is_the_published_one() -> None:
    published = json.loads(SNAPSHOT.read_text(encoding="utf-8"))
    schemas = {s["title"]: s for s in json.loads(json.dumps(options_json_schema()))["anyOf"]}
    assert {title: _contract(s["properties"]) for title, s in schemas.items()} == published
    for schema in schemas.values():
        assert schema["additionalProperties"] is False and "required" not in schema


@pytest.mark.parametrize(
    ("model", "options"),
    [(SandblasterJobOptions, sandblaster.SandblasterOptions), (DownpourJobOptions, downpour.DownpourOptions)],
)
def test_every_rest_option_has_the_libraries_default_when_unset(model: Any, options: type) -> None:
    from distbelief.options import defaults

    # Every field of the JSON model is an option of the library's, and unset means "take its default".
    assert set(model.model_fields) <= set(defaults(options))
    assert all(f.default is None and not f.is_required() for f in model.model_fields.values())


def test_the_json_models_are_strict_and_keep_the_rules_between_fields() -> None:
    with pytest.raises(ValidationError, match="needs a limit"):
        DownpourJobOptions.model_validate({"lr": 0.1})
    with pytest.raises(ValidationError, match="Input should be a valid integer"):
        SandblasterJobOptions.model_validate({"maxiter": "50"})
    with pytest.raises(ValidationError, match="give an object"):
        DownpourJobOptions.model_validate({"epochs": 1, "compression": 0.5})
    got = DownpourJobOptions.model_validate({"epochs": 1, "compression": {"tau": 0.5}})
    assert got.model_dump(exclude_none=True) == {"epochs": 1, "compression": {"tau": 0.5}}
