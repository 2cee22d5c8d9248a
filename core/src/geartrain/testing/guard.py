"""The guard that keeps conformance suites honest: a plugin's test class may not silently
replace a standard test."""

from __future__ import annotations

from typing import Any, ClassVar


class StandardSuite:
    """Base of the conformance suites.

    A class that sets ``_standard_suite = True`` defines standard tests (its ``test_*``
    methods). A subclass that replaces one of them — anywhere down the hierarchy — must list
    it in ``overridden_tests = {"test_name": "why"}``; otherwise defining the class raises
    :class:`TypeError`. Listing a name that is not a standard test raises too (typos).
    """

    overridden_tests: ClassVar[dict[str, str]] = {}
    """Standard tests this subclass replaces, each with the reason."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.__dict__.get("_standard_suite", False):
            return
        suites = [b for b in cls.__mro__[1:] if b.__dict__.get("_standard_suite", False)]
        standard = {
            name: vars(suite)[name] for suite in reversed(suites) for name in vars(suite) if name.startswith("test_")
        }
        unknown = sorted(set(cls.overridden_tests) - set(standard))
        if unknown:
            raise TypeError(f"{cls.__name__}.overridden_tests names {unknown}, which are not standard tests")
        silent = sorted(
            name
            for name, original in standard.items()
            if getattr(cls, name) is not original and name not in cls.overridden_tests
        )
        if silent:
            raise TypeError(
                f"{cls.__name__} overrides standard conformance test(s) {silent} without saying why: "
                f"list them in overridden_tests = {{'{silent[0]}': '<reason>'}}"
            )
