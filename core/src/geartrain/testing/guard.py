"""The guard that keeps conformance suites honest: a plugin's test class may not silently
replace a standard test."""

from __future__ import annotations

from typing import Any, ClassVar


class StandardSuite:
    """Base of the conformance suites.

    A subclass that redefines a ``test_*`` method of a standard suite must list it in
    ``overridden_tests = {"test_name": "why"}``; otherwise defining the class raises
    :class:`TypeError`. Skipping a standard test is an override too, and is said out loud.
    """

    overridden_tests: ClassVar[dict[str, str]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        standard: set[str] = set()
        for base in cls.__mro__[1:]:
            if issubclass(base, StandardSuite) and base.__dict__.get("_standard_suite", False):
                standard |= {n for n in vars(base) if n.startswith("test_")}
        if cls.__dict__.get("_standard_suite", False):
            return
        silent = sorted(n for n in vars(cls) if n in standard and n not in cls.overridden_tests)
        if silent:
            raise TypeError(
                f"{cls.__name__} overrides standard conformance test(s) {', '.join(silent)} without saying why; "
                "list each in overridden_tests = {'test_name': 'reason'}"
            )
        unknown = sorted(set(cls.overridden_tests) - standard)
        if unknown:
            raise TypeError(f"{cls.__name__}.overridden_tests names test(s) that are not standard: {', '.join(unknown)}")
