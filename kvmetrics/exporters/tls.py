"""TLS settings of the endpoint and the server context made from them.

The files are named by a setting, so they are checked before OpenSSL opens them:
OpenSSL opens what it is given and reads it whole, blocking. A certificate path that
names a FIFO hangs the engine's start until someone writes to it, a device is read
without end, and an encrypted private key makes OpenSSL ask for its passphrase on the
controlling terminal, where an engine started from one waits forever. So each file
is opened here first without blocking and must be a regular file of at most
:data:`MAX_TLS_FILE_BYTES`, and keys are loaded with a passphrase callback that
refuses instead of asking.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass

from kvmetrics.metrics.files import FileRefused, open_regular
from kvmetrics.metrics.text import short_text

#: The largest certificate, key or CA bundle read: a system CA bundle is about 200 KB.
MAX_TLS_FILE_BYTES = 4 * 2**20


class EncryptedKey(ValueError):
    """A private key that needs a passphrase (the message is one line)."""


def check_tls_file(what: str, path: str) -> None:
    """FileRefused ("cannot load WHAT 'PATH': why", one line) unless ``path`` is a
    regular file OpenSSL can read at once; opened without blocking, so a FIFO is
    refused, not waited on."""
    try:
        with open_regular(path, limit=MAX_TLS_FILE_BYTES):
            pass
    except FileRefused as e:
        why = str(e).removeprefix(f"cannot read {path}: ")
        raise FileRefused(f"cannot load {what} {_shown(path)}: {short_text(why)}") from None


def refuse_passphrase() -> bytes:
    """The passphrase callback for ``load_cert_chain``: an encrypted key is refused
    with one line, never prompted for."""
    raise EncryptedKey("the private key is encrypted: kvmetrics reads unencrypted keys only "
                       "(decrypt it, e.g. openssl pkey -in KEY -out KEY.plain, and keep it "
                       "readable by this user only)")


@dataclass
class TLSOptions:
    certfile: str | None = None
    keyfile: str | None = None
    client_cafile: str | None = None
    client_capath: str | None = None
    client_auth_required: bool = False

    @property
    def enabled(self) -> bool:
        return bool(self.certfile or self.keyfile or self.client_cafile or self.client_capath)


class TLSConfigError(ValueError):
    """A TLS setting that cannot work (one line, naming the file and why)."""


def tls_context(tls: TLSOptions) -> ssl.SSLContext:
    """The server context, or TLSConfigError naming the file that is missing or bad.

    A client CA makes client certificates required: a CA that is configured but not
    enforced would look like authentication and be none.
    """
    if not (tls.certfile and tls.keyfile):
        raise TLSConfigError("TLS needs both a certificate and a key file"
                             f" (got cert={_shown(tls.certfile)}, key={_shown(tls.keyfile)})")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        for what, path in (("TLS certificate", tls.certfile), ("TLS key", tls.keyfile),
                           ("client CA", tls.client_cafile)):
            if path:
                check_tls_file(what, path)
    except FileRefused as e:
        raise TLSConfigError(str(e)) from None
    try:
        context.load_cert_chain(tls.certfile, tls.keyfile, password=refuse_passphrase)
    except (OSError, ssl.SSLError, EncryptedKey) as e:
        raise TLSConfigError(f"cannot load TLS certificate {_shown(tls.certfile)} with key "
                             f"{_shown(tls.keyfile)}: {_why(e)}") from None
    if tls.client_cafile or tls.client_capath:
        try:
            context.load_verify_locations(tls.client_cafile, tls.client_capath)
        except (OSError, ssl.SSLError) as e:
            where = tls.client_cafile or tls.client_capath
            raise TLSConfigError(f"cannot load client CA {_shown(where)}: {_why(e)}") from None
        context.verify_mode = ssl.CERT_REQUIRED
    elif tls.client_auth_required:
        raise TLSConfigError("client certificates required but no client CA given")
    return context


def _why(e: BaseException) -> str:
    text = getattr(e, "strerror", None) or getattr(e, "reason", None) or str(e)
    return short_text(" ".join(str(text).split()), 300)


def _shown(path: str | None) -> str:
    """A path as the refusal line shows it: quoted, escaped, cut to 200 characters."""
    return "None" if path is None else f"'{short_text(path)}'"
