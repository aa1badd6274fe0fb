"""The scheduler: batching, KV admission, speculation and grammar masks."""
