"""The server side of a TLS connection with a small read buffer: the one module that
uses asyncio's private names.

asyncio's public ``loop.start_tls`` and ``connect_accepted_socket(ssl=...)`` build their
own SSL protocol, whose read buffer is 256 KiB, allocated per connection before the
handshake; with glibc's adaptive mmap threshold the freed buffers stay in the heap, so
a burst of 1,000 handshakes left the engine process 850 MB larger for good. No public
setting changes that size, so this module builds the protocol itself.

Private names used, and why:

- ``asyncio.sslproto.SSLProtocol`` (subclassed): the protocol the public calls build.
- ``SSLProtocol.max_size`` (overridden): the size of that read buffer.
- ``SSLProtocol._app_transport`` (read): the transport the application writes to, what
  ``loop.start_tls`` returns.

``tests/test_exporter_hostile.py`` checks, on the Python that runs the suite, that a
connection's buffer is the small one and that TLS scrapes work.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from asyncio import sslproto


class LeanSSLProtocol(sslproto.SSLProtocol):
    """asyncio's SSL protocol with a 16 KiB read buffer instead of 256 KiB. A TLS record
    carries at most 16 KiB, so reads of 16 KiB lose nothing but a few loop turns on
    pages larger than that."""

    max_size = 16 * 1024


async def start_tls(loop: asyncio.AbstractEventLoop, sock: socket.socket,
                    app: asyncio.Protocol, context: ssl.SSLContext,
                    timeout: float) -> asyncio.Transport:
    """The server side of a TLS connection on an accepted ``sock``, handshake done:
    what ``connect_accepted_socket(ssl=...)`` does, with :class:`LeanSSLProtocol`."""
    waiter = loop.create_future()
    protocol = LeanSSLProtocol(loop, app, context, waiter, server_side=True,
                               # arg-type: typeshed says int; asyncio takes any seconds.
                               ssl_handshake_timeout=timeout)  # type: ignore[arg-type]
    transport, _ = await loop.connect_accepted_socket(lambda: protocol, sock)
    try:
        await waiter
    except BaseException:
        transport.abort()  # at once: the caller closes the socket next
        raise
    return protocol._app_transport
