"""Benchmarks of the publisher and their tools, not product code: ``bench_sync`` (``weftboard
bench sync``), the island daemons it runs as child processes (``island_processes``) and the
WAN simulator (``wan``). Only the CLI and tests import this package."""
