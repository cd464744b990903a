"""taxbench: measure the determinism tax of LLM pretraining and verify bitwise determinism."""

__version__ = "0.1.0"
