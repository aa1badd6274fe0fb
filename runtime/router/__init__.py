"""The data-parallel router: routing policy, relaying, launching replicas."""
