"""Benchmarks and dev tools of the codec and kernels; imported only by the CLI and tests, never by product code."""
