"""What distbelief's own packages (sandblaster, downpour) use of models; not for users.

Users import from :mod:`distbelief.models`. The other packages of distbelief reach models' private modules
only through this module (docs/architecture.md, "Imports"); nothing here is a stable API.
"""

from ._factory import BuiltIn
from ._fitted import FittedMixin
from ._partitioned import AnyPlan, PartitionPlan

__all__ = ["AnyPlan", "BuiltIn", "FittedMixin", "PartitionPlan"]
