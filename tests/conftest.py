"""Shared test configuration.

``tests/third_party_plugin`` is a separate package whose own tests run only after the core
tests pip-install it (tests/core/test_third_party_plugin.py), so it is not collected here.
"""

collect_ignore = ["third_party_plugin"]
