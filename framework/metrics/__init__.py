"""Engine metrics: stats and Prometheus collectors."""
