"""Device kernels used by attention backends (Triton; imported only by the backends that need them)."""
