"""What distbelief's own packages (api) use of downpour; not for users.

Users import from :mod:`distbelief.downpour`. The other packages of distbelief reach downpour's private
modules only through this module (docs/architecture.md, "Imports"); nothing here is a stable API.
"""

from ._partitioned import check_partitioned_options
from ._resume import resume_point

__all__ = ["check_partitioned_options", "resume_point"]
