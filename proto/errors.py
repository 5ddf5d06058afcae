"""One exception hierarchy for all of weftboard.

Each error names the gRPC status code it travels as, so the board maps domain errors to
precise codes in one place and clients turn codes back into the same classes
(``from_status_code``). Messages are written for a person who has to act on them.
"""

from __future__ import annotations


class WeftboardError(Exception):
    """Base of every error weftboard raises on purpose."""

    grpc_code_name: str = "INTERNAL"


class InvalidArgument(WeftboardError):
    grpc_code_name = "INVALID_ARGUMENT"


class NotFound(WeftboardError):
    grpc_code_name = "NOT_FOUND"


class AlreadyExists(WeftboardError):
    grpc_code_name = "ALREADY_EXISTS"


class FailedPrecondition(WeftboardError):
    grpc_code_name = "FAILED_PRECONDITION"


class Aborted(WeftboardError):
    """A compare-and-set lost a race; re-read and decide again."""

    grpc_code_name = "ABORTED"


class OutOfRange(WeftboardError):
    grpc_code_name = "OUT_OF_RANGE"


class Unavailable(WeftboardError):
    """A backing service (Redis, blob store, the board) could not be reached; safe to retry."""

    grpc_code_name = "UNAVAILABLE"


class Unauthenticated(WeftboardError):
    grpc_code_name = "UNAUTHENTICATED"


class PermissionDenied(WeftboardError):
    grpc_code_name = "PERMISSION_DENIED"


class UrlExpired(PermissionDenied):
    """A presigned URL was refused (HTTP 403): it expired or names another object. Unlike a
    refused token this passes: a new plan from the board carries fresh URLs."""


class DeadlineExceeded(WeftboardError):
    grpc_code_name = "DEADLINE_EXCEEDED"


class CorruptData(WeftboardError):
    """Bytes that do not decode: a truncated or corrupted patch, anchor or stream."""

    grpc_code_name = "DATA_LOSS"


class DigestMismatch(CorruptData):
    """Bytes whose digest differs from the one the version record declares. Never served."""


class ApplyError(WeftboardError):
    """A patch or anchor could not be applied; the destination keeps its previous version."""

    grpc_code_name = "INTERNAL"


_BY_CODE = {
    cls.grpc_code_name: cls
    for cls in (
        InvalidArgument,
        NotFound,
        AlreadyExists,
        FailedPrecondition,
        Aborted,
        OutOfRange,
        Unavailable,
        Unauthenticated,
        PermissionDenied,
        DeadlineExceeded,
        CorruptData,
    )
}


def from_status_code(code_name: str, message: str) -> WeftboardError:
    """The weftboard error for a gRPC status code name (``grpc.StatusCode.X.name``)."""
    return _BY_CODE.get(code_name, WeftboardError)(message)
