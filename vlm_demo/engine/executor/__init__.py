"""Running the model: the worker, prefill, the vision tower, the decode step and its attention."""
