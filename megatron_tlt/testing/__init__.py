"""Helpers shared by tests and examples: tiny HF models built locally (no downloads)."""
