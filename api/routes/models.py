"""``GET /api/models``: the built-in model kinds and the JSON schema of each one's spec."""

from __future__ import annotations

from fastapi import APIRouter

from distbelief import models
from distbelief.api.schemas import ModelKindPublic, ModelsPublic

from .._http import error_responses

__all__ = ["router"]

router = APIRouter(prefix="/models", tags=["models"], responses=error_responses(401))


@router.get("", response_model=ModelsPublic, response_model_by_alias=True)
async def list_models() -> ModelsPublic:
    """Every model kind a job can use, with the JSON schema its ``model`` spec must follow."""
    return ModelsPublic(
        data=[
            ModelKindPublic.model_validate({"kind": kind, "schema": models.spec_schema(kind)})
            for kind in models.MODEL_KINDS
        ]
    )
