"""Attention backends shipped with the core."""
