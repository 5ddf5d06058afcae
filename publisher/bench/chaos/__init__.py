"""``weftboard bench chaos``: the whole system on this machine under a seeded fault schedule.

Real processes throughout (Redis with AOF, SeaweedFS S3, board replicas, a publishing trainer,
islands with their engines), every link through a TCP fault proxy the bench owns, and a
history checked at the end. One job per module: ``fault_proxy`` (the proxy), ``processes``
(a child process and its /proc figures), ``cluster`` (the topology: start, kill, restart),
``trainer_child`` (the trainer process), ``schedule`` (the seeded faults), ``injector`` (doing
one fault), ``workload`` (requests, the trajectory consumer, the observer), ``history`` (the
record and its checker) and ``bench`` (the run and its JSON). Not product code: only the CLI
and tests import it.
"""
