"""The benchmarks' parts: HTTP load clients, the page-load visitors, kernel counts and machine code, percentiles."""
