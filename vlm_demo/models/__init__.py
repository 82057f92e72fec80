"""Models the project builds itself (no download): the tiny test model, the real-shape model, and which one runs."""
