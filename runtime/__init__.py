"""plait.runtime — the engine: scheduler, model worker, KV memory, radix cache, models, sampling."""
