"""The codec's public API: encode a version transition into a patch, read and apply patches.

The bitstream is specified in ``cuda/FORMAT.md``; ``container`` reads and writes it, ``encode``
makes the streams, ``decode`` and ``apply`` take them back into tensors. Other packages import
from here (or from ``diff``, ``digest``, ``formats``), never from those modules' internals.

Invariants: a patch applies completely or not at all (every header, checksum and directory is
checked before the first write; a stream found corrupt mid-way is undone), and
``AppliedPatch.revert`` restores the exact previous bytes.
"""

from __future__ import annotations

from weftboard.cuda.apply import AppliedPatch, apply_patch_, apply_patch_arriving_
from weftboard.cuda.container import (
    CODEC_TILE,
    ENCODINGS,
    FORMAT,
    FORMAT_VERSION,
    READ_VERSIONS,
    PatchInfo,
    TensorPatchInfo,
    join_patches,
    read_patch_info,
)
from weftboard.cuda.decode import DecodedTensor, decode_stream
from weftboard.cuda.encode import (
    EncodedPatch,
    EncodedTensor,
    Scans,
    assemble_patch,
    delta_from_encoded,
    delta_from_scans,
    encode_deltas,
    encode_pairs,
    encode_patch,
    encode_streams,
    encoded_from_scans,
    scans_changed,
)
from weftboard.cuda.tile_encode import TileScan, scan_tiles

__all__ = [
    "CODEC_TILE",
    "ENCODINGS",
    "FORMAT",
    "FORMAT_VERSION",
    "READ_VERSIONS",
    "AppliedPatch",
    "DecodedTensor",
    "EncodedPatch",
    "EncodedTensor",
    "PatchInfo",
    "Scans",
    "TensorPatchInfo",
    "TileScan",
    "apply_patch_",
    "apply_patch_arriving_",
    "assemble_patch",
    "decode_stream",
    "delta_from_encoded",
    "delta_from_scans",
    "encode_deltas",
    "encode_pairs",
    "encode_patch",
    "encode_streams",
    "encoded_from_scans",
    "join_patches",
    "read_patch_info",
    "scan_tiles",
    "scans_changed",
]
