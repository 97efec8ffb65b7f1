"""tokenmill's NVIDIA CUDA platform plugin (entry point ``cuda`` in group ``tokenmill.platforms``)."""
