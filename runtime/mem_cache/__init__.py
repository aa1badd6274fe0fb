"""KV-cache memory: the slot pool, the radix prefix cache, the decode mirror."""
