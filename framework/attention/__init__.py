"""Attention: backends (kernels + KV layout) and their registry."""
