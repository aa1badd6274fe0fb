"""Running the model: the runner, forward batches, attention, CUDA graphs, loading, the weight arena."""
