"""How every weftboard client reaches the board: TLS options and the one gRPC channel factory.

A client speaks plaintext unless it is given TLS options: ``tls_ca`` (the CA bundle that signed
the board's certificate), or ``tls=True`` for the system's roots; ``tls_cert`` and ``tls_key``
add a client certificate (mutual TLS); ``server_name`` overrides the name checked against the
board's certificate (dialling an IP address or a tunnel).

Invariants:
- ``open_channel`` is the only place that builds client channel credentials; ``BoardClient``
  (and through it the publisher, the island, the sidecar, the trajectory consumer and the
  CLI) opens its channel with it.
- TLS files are read when the options are resolved (``client_tls``), so a missing, unreadable
  or non-PEM file fails before any connection with an ``InvalidArgument`` naming the file and
  the option; a client certificate without its key (or a key without its certificate) too.
- ``unavailable_message`` words an UNAVAILABLE from the board for a person: it names the
  board's address, and says so when TLS failed (handshake, certificate, server name) or when a
  plaintext client met a TLS board.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from weftboard.proto.errors import InvalidArgument

__all__ = ["TlsConfig", "client_tls", "open_channel", "unavailable_message"]

# Words in gRPC's UNAVAILABLE details that mean the TLS layer failed, not the network.
_TLS_FAILURE_MARKERS = ("handshake", "ssl", "tls", "certificate", "hostname verification")


def _read_pem(path: str | Path, what: str) -> bytes:
    """The bytes of a PEM file, or an ``InvalidArgument`` naming the file and the option."""
    try:
        data = Path(path).expanduser().read_bytes()
    except OSError as exc:
        raise InvalidArgument(f"cannot read the {what} {str(path)!r}: {exc.strerror or exc}") from None
    if b"-----BEGIN " not in data:
        raise InvalidArgument(f"the {what} {str(path)!r} holds no PEM data (expected '-----BEGIN ...')")
    return data


@dataclass(frozen=True)
class TlsConfig:
    """Client-side TLS: the CA that signed the board's certificate (None: the system's roots),
    and for mutual TLS a client certificate and key. ``server_name`` overrides the name checked
    against the board's certificate (useful when dialling an IP address)."""

    root_cert: bytes | None = None
    client_cert: bytes | None = None
    client_key: bytes | None = None
    server_name: str | None = None

    def __post_init__(self) -> None:
        if (self.client_cert is None) != (self.client_key is None):
            given, missing = ("tls_cert", "tls_key") if self.client_key is None else ("tls_key", "tls_cert")
            raise InvalidArgument(f"mutual TLS needs a client certificate and its key: {given} is set, {missing} is not "
                                  f"(--tls-cert/--tls-key)")

    @classmethod
    def from_files(
        cls,
        root_cert: str | Path | None = None,
        client_cert: str | Path | None = None,
        client_key: str | Path | None = None,
        server_name: str | None = None,
    ) -> TlsConfig:
        """Read the PEM files now; a file that cannot be read is named in the error."""
        return cls(
            _read_pem(root_cert, "TLS CA bundle (tls_ca / --tls-ca)") if root_cert else None,
            _read_pem(client_cert, "TLS client certificate (tls_cert / --tls-cert)") if client_cert else None,
            _read_pem(client_key, "TLS client key (tls_key / --tls-key)") if client_key else None,
            server_name or None,
        )

    @property
    def mutual(self) -> bool:
        return self.client_cert is not None


def client_tls(
    tls: TlsConfig | bool | None = None,
    *,
    tls_ca: str | Path | None = None,
    tls_cert: str | Path | None = None,
    tls_key: str | Path | None = None,
    server_name: str | None = None,
) -> TlsConfig | None:
    """A client's TLS settings from its options; None means plaintext.

    ``tls`` may already be a ``TlsConfig`` (then no other option may be given), ``True`` (TLS
    with the system's roots unless ``tls_ca`` names a bundle) or None/False (TLS only if a
    file or ``server_name`` is given).
    """
    files_given = any(v for v in (tls_ca, tls_cert, tls_key, server_name))
    if isinstance(tls, TlsConfig):
        if files_given:
            raise InvalidArgument("give either a TlsConfig or tls_ca/tls_cert/tls_key/server_name, not both")
        return tls
    if not tls and not files_given:
        return None
    return TlsConfig.from_files(tls_ca, tls_cert, tls_key, server_name)


def open_channel(address: str, tls: TlsConfig | None, options: Sequence[tuple[str, object]] = ()) -> grpc.aio.Channel:
    """An asyncio gRPC channel to the board: plaintext when ``tls`` is None, else TLS (mutual
    when it carries a client certificate)."""
    opts = list(options)
    if tls is None:
        return grpc.aio.insecure_channel(address, options=opts)
    if tls.server_name:
        opts.append(("grpc.ssl_target_name_override", tls.server_name))
    creds = grpc.ssl_channel_credentials(tls.root_cert, tls.client_key, tls.client_cert)
    return grpc.aio.secure_channel(address, creds, options=opts)


def unavailable_message(address: str, tls: TlsConfig | None, details: str) -> str:
    """What an UNAVAILABLE from the board at ``address`` means, for a person to act on.

    Only a failure to connect is reworded; an UNAVAILABLE the board itself sent (its Redis or
    blob store away) keeps the board's own message.
    """
    lowered = details.lower()
    if not lowered.startswith("failed to connect"):
        return details
    if tls is not None and any(marker in lowered for marker in _TLS_FAILURE_MARKERS):
        hint = "check the CA bundle (--tls-ca) and that the address serves TLS"
        if "hostname" in lowered:
            hint = "the board's certificate does not name the address dialled: check --tls-server-name"
        return f"TLS with the board at {address} failed ({hint}): {details}"
    if "socket closed" in lowered:
        if tls is None:
            return (f"the board at {address} closed the connection; if it serves TLS, give its CA "
                    f"(--tls-ca, or --tls for the system's roots): {details}")
        if not tls.mutual:
            return (f"TLS with the board at {address} failed: it closed the connection after the handshake; "
                    f"if it requires mutual TLS, give a client certificate (--tls-cert/--tls-key): {details}")
        return (f"TLS with the board at {address} failed: it closed the connection (was the client certificate "
                f"refused?): {details}")
    return f"board at {address} unreachable: {details}"
