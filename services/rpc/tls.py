"""TLS from PEM files, one object for both ends: a server's credentials (mTLS when a CA is
given; gRPC's, and an SSL context for its HTTP front and frames listener), and the channels
(and frames connections) it opens to the servers it calls (the router to its backends, a
decode to a prefill), which present the same certificate and verify theirs against the CA."""
from __future__ import annotations

import ssl
from dataclasses import dataclass

import grpc


@dataclass(frozen=True)
class TLSConfig:
    cert_file: str | None = None  # PEM chain: served, and presented as the client certificate
    key_file: str | None = None
    ca_file: str | None = None  # verifies peers; on a server it makes client certificates required
    server_name: str | None = None  # checked in servers' certificates instead of the address's host

    def __post_init__(self):
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("tls_cert_file and tls_key_file: give both or neither")
        for name in ("cert_file", "key_file", "ca_file"):
            path = getattr(self, name)
            if path is not None:
                try:
                    with open(path, "rb") as f:
                        f.read(1)
                except OSError as e:
                    raise ValueError(f"tls_{name}: cannot read {path}: {e.strerror}") from None

    def _read(self, name: str) -> bytes | None:
        path = getattr(self, name)
        if path is None:
            return None
        with open(path, "rb") as f:
            return f.read()

    def server_credentials(self) -> grpc.ServerCredentials:
        if self.cert_file is None:
            raise ValueError("tls_cert_file: a server needs a certificate and key to serve TLS")
        ca = self._read("ca_file")
        return grpc.ssl_server_credentials([(self._read("key_file"), self._read("cert_file"))],
                                           root_certificates=ca, require_client_auth=ca is not None)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self._read("ca_file"),
                                            private_key=self._read("key_file"),
                                            certificate_chain=self._read("cert_file"))

    def channel_options(self) -> list[tuple]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []

    def server_context(self) -> ssl.SSLContext:
        """The HTTP front's and the frames listener's: the same certificate, and client
        certificates required with a CA."""
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=self.ca_file)
        context.load_cert_chain(self.cert_file, self.key_file)
        if self.ca_file is not None:
            context.verify_mode = ssl.CERT_REQUIRED
        return context

    def client_context(self) -> ssl.SSLContext:
        """A frames caller's: the server's certificate verified against the CA (the system's
        roots without one), this certificate presented where there is one."""
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=self.ca_file)
        if self.cert_file is not None:
            context.load_cert_chain(self.cert_file, self.key_file)
        return context


def _channel(api, address: str, tls: TLSConfig | None, options: list[tuple]):
    """A channel of `api` (grpc or grpc.aio): plaintext, or TLS with tls's files."""
    if tls is None:
        return api.insecure_channel(address, options=list(options))
    return api.secure_channel(address, tls.channel_credentials(), options=[*options, *tls.channel_options()])


def aio_channel(address: str, tls: TLSConfig | None, options: list[tuple] = ()) -> grpc.aio.Channel:
    return _channel(grpc.aio, address, tls, options)


def sync_channel(address: str, tls: TLSConfig | None, options: list[tuple] = ()) -> grpc.Channel:
    return _channel(grpc, address, tls, options)
