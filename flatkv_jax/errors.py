"""One spelling for the library's user-facing error messages.

Every message names the offending value, the rule it broke and the fix, so a serving engineer
can act on it without reading our source (the equinox habit).
"""

from __future__ import annotations

import numbers
from typing import NoReturn


def fail(
    what: str, value: object, rule: str, fix: str, *, exc: type[Exception] = ValueError
) -> NoReturn:
    """Raises ``exc`` with a message of the form ``what=value: rule. Fix: fix.``.

    Args:
      what: the name of the offending argument or field, e.g. ``"rows_per_page"``.
      value: its value (rendered with ``repr``).
      rule: the rule it broke, phrased as what must hold.
      fix: what the caller should do instead.
      exc: the exception type (``ValueError`` for bad values, ``TypeError`` for bad types).
    """
    raise exc(f"{what}={value!r} is invalid: {rule}. Fix: {fix}.")


def is_int(value: object) -> bool:
    """Whether ``value`` is an integer: a Python ``int`` or a NumPy integer scalar, never a
    bool (Python or NumPy) nor a float. Every size check of the library uses this rule."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_positive_int(what: str, value: object, fix: str | None = None) -> int:
    """Returns ``value`` as a Python ``int`` if it is a positive integer (see :func:`is_int`),
    else raises."""
    if not is_int(value):
        fail(what, value, "it must be an int", fix or f"pass {what} as a Python int", exc=TypeError)
    if value <= 0:
        fail(what, value, "it must be positive", fix or f"pass {what} >= 1")
    return int(value)


def check_nonnegative_int(what: str, value: object, fix: str | None = None) -> int:
    """Returns ``value`` as a Python ``int`` if it is an integer >= 0 (see :func:`is_int`),
    else raises."""
    if not is_int(value):
        fail(what, value, "it must be an int", fix or f"pass {what} as a Python int", exc=TypeError)
    if value < 0:
        fail(what, value, "it must be >= 0", fix or f"pass {what} >= 0")
    return int(value)
