"""Benchmarks run by `moagen bench ...`: one module per benchmark."""
