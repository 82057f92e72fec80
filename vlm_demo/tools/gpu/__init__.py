"""The GPU check's parts (its kernel stages and measures) and the common GPUs' specs."""
