"""tokenmill's AMD ROCm platform plugin (entry point ``rocm`` in group ``tokenmill.platforms``)."""
