"""plait.frontend — the DSL (coming with the DSL issue)."""
