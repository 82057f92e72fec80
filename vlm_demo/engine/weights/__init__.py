"""The weights: loading, placement, quantizing and the packed layout with its kernel."""
