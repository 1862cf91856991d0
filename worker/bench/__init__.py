"""Benchmark workloads (ShareGPT) and the side-by-side harness behind `freight bench`."""
