"""Sizes a request must keep within, shared by the board (which refuses what exceeds them) and
its clients (which stay inside them instead of learning them from a refusal).

Invariants: a trajectory record over ``MAX_TRAJECTORY_RECORD_BYTES`` serialized is refused on
its own, never silently truncated; a batch of records a client sends holds at most
``MAX_TRAJECTORY_BATCH`` records and ``MAX_TRAJECTORY_BATCH_BYTES`` bytes, well inside the
board's 64 MiB gRPC message limit; so does a ConsumeTrajectories reply, which the board ends
after 16 MiB of records read in chunks of 100 (at most 100 records of this limit more).
"""

from __future__ import annotations

MAX_TRAJECTORY_BATCH = 10_000  # records in one ReportTrajectories or ConsumeTrajectories call
MAX_TRAJECTORY_RECORD_BYTES = 64 << 10  # one record, serialized: metadata, not the trajectory itself
MAX_TRAJECTORY_BATCH_BYTES = 8 << 20  # what a reporter puts in one call
