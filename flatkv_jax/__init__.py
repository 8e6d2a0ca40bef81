"""flatkv_jax: the device-side KV cache of DeepSeek-V4-style models on heterogeneous flat pools.

Public surface (import from here):

- row formats: :mod:`flatkv_jax.formats`
- groups: :class:`GroupSpec`, :class:`FieldSpec`, :class:`Retention`, :class:`Owner`
- the plan: :class:`CachePlan`, :class:`ServingLimits`, :func:`plan_for_budget`,
  :func:`plan_with_pages`, :func:`memory_report`
- pools: :class:`Pools`, :func:`create_pools`
- recipes: :mod:`flatkv_jax.recipes`

``__version__`` is the package version (pyproject reads it from here).
"""

__version__ = "0.1.0"

from flatkv_jax import formats
from flatkv_jax.capacity import parse_size, plan_for_budget, plan_with_pages
from flatkv_jax.groups import FieldSpec, GroupSpec, Owner, Retention
from flatkv_jax.plan import NULL_PAGE, RESERVED_PAGES, CachePlan, ServingLimits
from flatkv_jax.pools import Pools, create_pools, pool_specs
from flatkv_jax.report import memory_report
from flatkv_jax.status import Status

__all__ = [
    "NULL_PAGE",
    "RESERVED_PAGES",
    "CachePlan",
    "FieldSpec",
    "GroupSpec",
    "Owner",
    "Pools",
    "Retention",
    "ServingLimits",
    "Status",
    "create_pools",
    "formats",
    "memory_report",
    "parse_size",
    "plan_for_budget",
    "plan_with_pages",
    "pool_specs",
]
