"""Integrations of cupy_gqa.attention with other libraries (each optional)."""
