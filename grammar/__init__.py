"""plait.grammar — constraints: schema/regex compile, token masks, jump-forward (coming with the grammar issue)."""
