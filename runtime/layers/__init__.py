"""Layers around the model: prepacked and quantized linears, the sampler."""
