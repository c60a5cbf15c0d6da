"""Argument-type predicates shared by the public API's SPEC 10 checks (no torch import: formats uses them too)."""
from __future__ import annotations

import numbers


def is_int(v) -> bool:
    """An integer (Python or numpy), not a bool: True would otherwise pass as 1, and 1.5 / "1" must not be truncated
    or parsed."""
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def check_bool(**flags) -> None:
    """Option flags are bools (SPEC 10): a truthy string or number ("no", 2) would otherwise switch a mode on."""
    for name, v in flags.items():
        if not isinstance(v, bool):
            raise TypeError(f"{name} must be True or False, got {type(v).__name__} {v!r}")
