"""weftboard.subscriber: the island library.

``subscriber.Subscriber`` follows a run into a ``destination.Destination``: a checkpoint
directory (``checkpoint_dir``), live tensors (``live_tensors``) or an engine
(``engine_destination``, through an adapter of ``engines``). ``local_follower`` runs one for
``weftboard subscribe``; ``engine_island`` assembles an engine, its adapter, a subscriber, the
admission gate and the version-aware ``sidecar`` for ``weftboard sidecar``.
"""
