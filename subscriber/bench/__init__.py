"""Benchmarks of the island library (``weftboard bench engine``) and the kit they run on."""
