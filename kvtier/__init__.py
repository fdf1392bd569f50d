"""kvtier: a KV-cache tier for LLM inference, run as its own service apart from compute."""

__version__ = "0.1.0"
