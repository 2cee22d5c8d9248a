"""Tools for testing geartrain backends: tiny models and tokenizer built in code, and the
conformance suites a plugin's tests subclass."""

from geartrain.testing.tiny import tiny_config, tiny_model, tiny_tokenizer

__all__ = ["tiny_config", "tiny_model", "tiny_tokenizer"]
