"""Benchmarks: scripts that time Sluice, and its peers on the same shapes, on a GPU machine (not timed tests)."""
