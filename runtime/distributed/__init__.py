"""Tensor parallelism: ranks, parallel linears, the step channel."""
