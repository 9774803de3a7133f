"""``GET /api/health``: the one route that needs no token (for load balancers and compose health checks)."""

from __future__ import annotations

from fastapi import APIRouter

from distbelief.api.schemas import HealthPublic
from distbelief.api.settings import version

__all__ = ["router"]

router = APIRouter(prefix="/health", tags=["health"])


@router.get("", response_model=HealthPublic)
async def health() -> HealthPublic:
    """The service is up (it says nothing about jobs or data, so it needs no token)."""
    return HealthPublic(status="ok", version=version())
