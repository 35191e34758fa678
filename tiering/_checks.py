"""The checks a constructor makes of a value it was handed (layer 0).

External input (config files, vLLM's ``kv_connector_extra_config``, tier
entries, CLI-built options) is decoded by msgspec Structs (`tiering._decode`);
what is left is a constructor called from Python with a value of any type.
Each check here is the one way to say that a value is wrong: it raises
``error`` (a `ConfigError` unless the caller names its own class) with one line
that names the value, shows it, and says what would be right.

A bool is never taken for a number (``True`` is an ``int`` to Python, never a
size to us); numpy's integers are taken as integers (``operator.index``).
"""

from __future__ import annotations

import math
import operator

from tiering.errors import ConfigError

__all__ = ["check_bool", "check_int", "check_real", "integer_text", "is_int"]


def is_int(value: object) -> bool:
    """Whether ``value`` is an integer (an ``int`` or numpy's integers), not a bool."""
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return True
    try:
        operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return False
    return not hasattr(value, "dtype") or getattr(value, "ndim", 0) == 0


def integer_text(minimum: int | None, maximum: int | None) -> str:
    """What an integer in range must be, in words: "a positive integer", "an integer
    from 1 to 8", "an integer >= 16"."""
    if maximum is not None:
        low = "" if minimum is None else f"from {minimum} "
        return f"an integer {low}to {maximum}" if low else f"an integer <= {maximum}"
    if minimum == 1:
        return "a positive integer"
    if minimum == 0:
        return "a non-negative integer"
    return "an integer" if minimum is None else f"an integer >= {minimum}"


def check_int(
    name: str,
    value: object,
    *,
    minimum: int | None = None,
    maximum: int | None = None,
    error: type[Exception] = ConfigError,
) -> int:
    """``value`` as an ``int`` if it is an integer in ``[minimum, maximum]``; else ``error``
    ("cascade_queue must be a positive integer, got 0")."""
    if is_int(value):
        number = operator.index(value)  # type: ignore[arg-type]
        if (minimum is None or number >= minimum) and (maximum is None or number <= maximum):
            return number
    raise error(f"{name} must be {integer_text(minimum, maximum)}, got {_shown(value)}")


def check_real(
    name: str,
    value: object,
    *,
    minimum: float | None = None,
    inclusive: bool = True,
    infinite: bool = False,
    error: type[Exception] = ConfigError,
) -> float:
    """``value`` as a ``float`` if it is a finite number at or above ``minimum`` (above it,
    if not ``inclusive``), or ``inf`` where ``infinite`` (a timeout that never ends); else
    ``error``."""
    if infinite and value == math.inf and isinstance(value, float):
        return math.inf
    if not isinstance(value, bool) and isinstance(value, (int, float)):
        number = float(value) if abs(value) < 1e308 else math.inf
        in_range = minimum is None or number > minimum or (inclusive and number == minimum)
        if math.isfinite(number) and in_range:
            return number
    bound = "" if minimum is None else f" {'>=' if inclusive else '>'} {minimum:g}"
    endless = " (or inf: no limit)" if infinite else ""
    raise error(f"{name} must be a finite number{bound}{endless}, got {_shown(value)}")


def check_bool(name: str, value: object, *, error: type[Exception] = ConfigError) -> bool:
    """``value`` if it is ``True`` or ``False`` (not a truthy string or number); else ``error``."""
    if isinstance(value, bool):
        return value
    raise error(f"{name} must be true or false, got {_shown(value)}")


def _shown(value: object) -> str:
    """``value`` as an error shows it: its repr, and its type where the repr hides it."""
    text = repr(value)
    if len(text) > 80:
        text = text[:77] + "..."
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return text
    return f"{text} of type {type(value).__name__}"
