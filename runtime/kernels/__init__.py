"""Hand-written kernels."""
