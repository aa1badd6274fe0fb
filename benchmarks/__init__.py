"""Benchmarks: workloads that print numbers (also reachable as `plait bench ...`)."""
