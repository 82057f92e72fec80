"""Operator and developer tools: benchmarks, load clients, the design documents' baseline, the GPU check."""
