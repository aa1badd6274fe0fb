"""The fused CPU kernels (csrc/) and their build and dispatch."""
