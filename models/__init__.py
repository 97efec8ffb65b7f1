"""Built-in model architectures (registered through the ``builtin_models`` entry point)."""
