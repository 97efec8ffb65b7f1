"""Executors: run the model on one or more workers."""
