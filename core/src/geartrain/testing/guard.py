"""The guard that keeps conformance suites honest: a plugin's test class may not silently
replace a standard test."""

from __future__ import annotations

import functools
from collections.abc import Callable
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

    contract_items: ClassVar[dict[str, tuple[str, str]]] = {}
    """A suite's standard tests, by name: ``(the contract item it checks, what to check in
    the backend when it fails)``. A failing assertion of the test is re-raised with both
    before its own message (:func:`explained`)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.__dict__.get("_standard_suite", False):
            items = cls.__dict__.get("contract_items", {})
            tests = sorted(name for name in vars(cls) if name.startswith("test_"))
            missing = [name for name in tests if name not in items]
            if missing:
                raise TypeError(f"{cls.__name__}.contract_items has no entry for {missing}")
            for name in tests:  # in place, so subclasses inherit the explained test itself
                setattr(cls, name, explained(vars(cls)[name], *items[name]))
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


def explained(test: Callable[..., Any], contract: str, check: str) -> Callable[..., Any]:
    """``test``, whose ``AssertionError`` (a bare assert, ``pytest.approx``, or
    ``torch.testing.assert_close``'s "Tensor-likes are not close!") is re-raised as one that
    names the contract item the test checks and what to look at in the backend, followed by
    the original message."""

    @functools.wraps(test)
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return test(*args, **kwargs)
        except BaseException as exc:  # an assertion, or pytest.raises' "DID NOT RAISE" (Failed)
            if not isinstance(exc, AssertionError) and type(exc).__name__ != "Failed":
                raise  # errors, skips and interrupts as they are
            raise AssertionError(
                f"conformance: {test.__name__} failed.\n  contract: {contract}\n  check: {check}\n{exc}"
            ) from exc

    return run
