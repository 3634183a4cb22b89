"""Benchmarks: `tandem bench`."""
