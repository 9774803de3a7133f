"""One router per resource, all under ``/api``: jobs, datasets, models, cluster, health."""

from distbelief.api.routes import cluster, datasets, health, jobs, models

__all__ = ["cluster", "datasets", "health", "jobs", "models"]
