"""The --tls-* flags of the `baton` commands that serve or call gRPC, and the TLSConfig they make."""
from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (gRPC is imported by the commands that speak it, not by every `baton` command)
    from baton.services.rpc.tls import TLSConfig

# The flags' fields of TLSConfig: --tls-cert-file sets cert_file, and so on.
_FIELDS = ("cert_file", "key_file", "ca_file", "server_name")


def add_tls_flags(p: argparse.ArgumentParser, serving: bool) -> None:
    """Every --tls-* flag (None when not given); `serving`: the help of a server, which also calls
    other servers, rather than of a client."""
    g = p.add_argument_group("TLS")
    if serving:
        g.add_argument("--tls-cert-file", help="PEM certificate chain: serve gRPC (and HTTP) over TLS with it, and "
                                               "present it as the client certificate on internal calls")
        g.add_argument("--tls-key-file", help="PEM private key of --tls-cert-file")
        g.add_argument("--tls-ca-file", help="PEM CA bundle: require client certificates it signed (mTLS), and "
                                             "verify the servers this one calls against it")
        g.add_argument("--tls-server-name", help="the name to verify in the certificates of the servers this one "
                                                 "calls (default: the host of their address; set it when they are "
                                                 "called by IP, as behind a headless Service)")
    else:
        g.add_argument("--tls-ca-file", help="PEM CA bundle to verify the server with (turns TLS on)")
        g.add_argument("--tls-cert-file", help="PEM client certificate, for a server that requires one (mTLS)")
        g.add_argument("--tls-key-file", help="PEM private key of --tls-cert-file")
        g.add_argument("--tls-server-name", help="the name to verify in the server's certificate (default: the host "
                                                 "of the address)")


def tls_config(args) -> TLSConfig | None:
    """The --tls-* flags as a TLSConfig; None when none is given (plaintext). ValueError names
    the flag's field when a file cannot be read or a certificate lacks its key."""
    from baton.services.rpc.tls import TLSConfig

    kwargs = {name: vars(args)[f"tls_{name}"] for name in _FIELDS}
    return TLSConfig(**kwargs) if any(v is not None for v in kwargs.values()) else None
