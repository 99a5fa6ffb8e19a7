"""Throw-away TLS material for tests: a CA, a server certificate for 127.0.0.1 and a client
certificate, made with the ``openssl`` command line (no Python crypto package needed)."""

from __future__ import annotations

import ssl
import subprocess
from dataclasses import dataclass
from pathlib import Path

_EC = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


@dataclass(frozen=True)
class TLSMaterial:
    ca_cert: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path

    def client_context(self, with_cert: bool = True) -> ssl.SSLContext:
        """A client that trusts the CA and, unless told otherwise, presents its certificate."""
        context = ssl.create_default_context(cafile=str(self.ca_cert))
        if with_cert:
            context.load_cert_chain(str(self.client_cert), str(self.client_key))
        return context


def _openssl(folder: Path, *args: str) -> None:
    subprocess.run(["openssl", *args], cwd=folder, check=True, capture_output=True, timeout=60)


def _leaf(folder: Path, name: str, subject: str, extensions: str, serial: int) -> None:
    (folder / f"{name}.ext").write_text(extensions)
    _openssl(folder, "req", *_EC, "-keyout", f"{name}.key", "-out", f"{name}.csr",
             "-subj", subject)
    _openssl(folder, "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
             "-set_serial", str(serial), "-days", "2", "-sha256", "-out", f"{name}.crt",
             "-extfile", f"{name}.ext")


def make_tls_material(folder: Path) -> TLSMaterial:
    folder.mkdir(parents=True, exist_ok=True)
    _openssl(folder, "req", "-x509", *_EC, "-keyout", "ca.key", "-out", "ca.crt", "-days", "2",
             "-sha256", "-subj", "/CN=kvmetrics test CA",
             "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    common = ("basicConstraints=critical,CA:FALSE\n"
              "authorityKeyIdentifier=keyid\nsubjectKeyIdentifier=hash\n")
    _leaf(folder, "server", "/CN=127.0.0.1",
          common + "keyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth\n"
          "subjectAltName=IP:127.0.0.1,DNS:localhost\n", 2)
    _leaf(folder, "client", "/CN=kvmetrics-scraper",
          common + "keyUsage=critical,digitalSignature\nextendedKeyUsage=clientAuth\n", 3)
    return TLSMaterial(folder / "ca.crt", folder / "server.crt", folder / "server.key",
                       folder / "client.crt", folder / "client.key")
