"""Checks for ``zero_pages``: static (always, at trace time) and dynamic (opt-in, outside jit)."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from flatkv_jax.errors import fail
from kernels_pallas import _common
from kernels_pallas._common import concrete_ids, positions

_OP = "zero_pages"


def check_zero_pages_static(pools: Any, page_ids: Any) -> None:
    """Trace-time checks: every pool array is a pool, all share ``num_pages``, ids are int32[K].

    Args:
        pools: pytree of ``[num_pages, rows_per_page, *row_shape]`` arrays of one group.
        page_ids: ``int32[K]``.
    """
    leaves_with_path = jax.tree_util.tree_flatten_with_path(pools)[0]
    if not leaves_with_path:
        fail(
            "pools",
            f"{type(pools).__name__} with no arrays",
            f"{_OP}: pools is empty",
            "pass the tuple/dict of all pool arrays of one group",
        )
    first_path, first = leaves_with_path[0]
    for path, leaf in leaves_with_path:
        name = f"pools{jax.tree_util.keystr(path)}"
        _common.check_pool_array(leaf, name=name, op=_OP)
        if leaf.shape[0] != first.shape[0]:
            fail(
                name,
                f"an array of shape {tuple(leaf.shape)}",
                f"{_OP}: {name} has {leaf.shape[0]} pages but "
                f"pools{jax.tree_util.keystr(first_path)} has {first.shape[0]}; one call zeros "
                "the arrays of ONE group, which share page ids and so num_pages",
                "call zero_pages once per group",
            )
    _common.check_ids_array(page_ids, name="page_ids", op=_OP)


def check_page_ids(pools_or_num_pages: Any, page_ids: Any) -> None:
    """Opt-in dynamic check of page ids to zero. Call outside ``jax.jit`` on concrete values.

    Valid ids are -1 (skip) or ``0 <= id <= num_pages - 2``. Page 0 is allowed (it is zero
    already and stays zero); the scratch page ``num_pages - 1`` is not a page anyone owns, so
    asking to zero it signals a bookkeeping bug. Duplicates are harmless and allowed.

    Args:
        pools_or_num_pages: the pools pytree (or one pool array), or ``num_pages`` as an int.
        page_ids: integer ``[K]``.

    Raises:
        ValueError: naming the offending positions and values and the rule they break.
        TypeError: if ``page_ids`` is a tracer (inside jit).
    """
    fn = "check_page_ids"
    if isinstance(pools_or_num_pages, int | np.integer):
        num_pages = int(pools_or_num_pages)
    else:
        leaves = jax.tree.leaves(pools_or_num_pages)
        if not leaves:
            fail(
                "pools", pools_or_num_pages, f"{fn}: pools is empty", "pass the pools or num_pages"
            )
        num_pages = int(leaves[0].shape[0])
    ids = concrete_ids(page_ids, name="page_ids", fn=fn)
    bad_neg = ids < -1
    if bad_neg.any():
        fail(
            "page_ids",
            f"page_ids at positions [{positions(bad_neg)}] ({ids[bad_neg][0]}, ...)",
            f"{fn}: they are negative but only -1 means skip; negative ids are never wrapped",
            "use -1 for padding",
        )
    too_big = ids >= num_pages
    if too_big.any():
        fail(
            "page_ids",
            f"page_ids at positions [{positions(too_big)}] ({ids[too_big][0]}, ...)",
            f"{fn}: they are out of range; a page id must be < num_pages = {num_pages}",
            "pass ids of this group's pools",
        )
    scratch = ids == num_pages - 1
    if scratch.any():
        fail(
            "page_ids",
            f"page_ids at positions [{positions(scratch)}] ({ids[scratch][0]}, ...)",
            f"{fn}: they name page {num_pages - 1}, the reserved scratch page (num_pages - 1), "
            "which is never allocated",
            "only zero pages 1 .. num_pages-2 (or pass -1 to skip)",
        )
