"""Think harder: stage-level beam search inside the running batch."""
