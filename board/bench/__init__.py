"""Benchmarks of the board (top layer: product code never imports them)."""
