"""`weftboard history`'s row for a version: the coders column counts changed tensors per coder."""

from __future__ import annotations

from weftboard.board.report import coder_summary, version_row
from weftboard.proto.v1 import board_pb2 as pb


def test_coder_summary_counts_each_coder_most_used_first():
    stats = pb.VersionStats(tensors=[
        pb.TensorStats(name="a", changed=3, coder="huffman", stream_bytes=9),
        pb.TensorStats(name="b", changed=9, coder="bitmap", stream_bytes=4),
        pb.TensorStats(name="c", changed=1, coder="huffman", stream_bytes=2),
        pb.TensorStats(name="d", changed=5),  # an anchor-only version names no coder
    ])
    assert coder_summary(stats) == "huffman 2, bitmap 1"
    assert coder_summary(pb.VersionStats()) == "-"


def test_history_row_shows_the_coders():
    record = pb.VersionRecord(version=2, parent=1, step=7, stats=pb.VersionStats(
        changed_elements=4, total_elements=100, density=0.04, patch_bytes=10,
        tensors=[pb.TensorStats(name="w", changed=4, numel=100, coder="context_huffman", stream_bytes=10)]))
    row = version_row(record)
    assert "context_huffman 1" in row and row[6] == "4.000%"
