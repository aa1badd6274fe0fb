"""Speculative decoding: n-gram drafts, draft length, the draft model."""
