"""Who runs next and how much prefill work a step may do."""
