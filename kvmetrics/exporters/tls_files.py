"""TLS files named by a setting, checked before OpenSSL opens them.

OpenSSL opens what it is given and reads it whole, blocking: a certificate path that
names a FIFO hangs the engine's start until someone writes to it, a device is read
without end, and an encrypted private key makes OpenSSL ask for its passphrase on the
controlling terminal, where an engine started from one waits forever. So each file
is opened here first without blocking and must be a regular file of at most
:data:`MAX_TLS_FILE_BYTES`, and keys are loaded with a passphrase callback that
refuses instead of asking.
"""

from __future__ import annotations

from kvmetrics.metrics.files import FileRefused, open_regular

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
        raise FileRefused(f"cannot load {what} {path!r}: {why}") from None


def refuse_passphrase() -> bytes:
    """The passphrase callback for ``load_cert_chain``: an encrypted key is refused
    with one line, never prompted for."""
    raise EncryptedKey("the private key is encrypted: kvmetrics reads unencrypted keys only "
                       "(decrypt it, e.g. openssl pkey -in KEY -out KEY.plain, and keep it "
                       "readable by this user only)")


__all__ = ["EncryptedKey", "FileRefused", "MAX_TLS_FILE_BYTES", "check_tls_file",
           "refuse_passphrase"]
