"""Parsing a scrape's request head: strict, because every byte of it is a client's.

A scrape has no body. A head that announces one in two ways (two ``Content-Length``
headers, or one with ``Transfer-Encoding``) is how requests are smuggled past a proxy
that picks the other length, so it is refused outright (400, connection closed)
rather than resolved by a rule such as "the last one wins".
"""

from __future__ import annotations

from dataclasses import dataclass

#: Headers that announce a body: each may appear once, and not together.
_BODY_HEADERS = ("content-length", "transfer-encoding")


class BadRequest(Exception):
    """The head cannot be answered normally: ``status`` and a one-line reason; the
    connection is closed after the answer."""

    def __init__(self, status: int, why: str) -> None:
        super().__init__(why)
        self.status = status


@dataclass(frozen=True)
class RequestHead:
    method: str
    target: str
    version: str
    #: Header names lower-cased; each name at most once.
    headers: dict[str, str]

    @property
    def keeps_alive(self) -> bool:
        connection = self.headers.get("connection", "").lower()
        if self.version == "HTTP/1.0":
            return "keep-alive" in connection
        return "close" not in connection


def parse_head(head: bytes) -> RequestHead:
    """Request line and headers of ``head`` (ending in a blank line); BadRequest for
    anything off."""
    text = head.decode("latin-1")  # decodes any byte
    request_line, *header_lines = text[:-4].split("\r\n")
    parts = request_line.split(" ")
    if len(parts) != 3:
        raise BadRequest(400, "malformed request line")
    method, target, version = parts
    if version not in ("HTTP/1.0", "HTTP/1.1"):
        raise BadRequest(505, "only HTTP/1.0 and HTTP/1.1")
    headers: dict[str, str] = {}
    for line in header_lines:
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip():
            raise BadRequest(400, "malformed header")
        name = name.lower()
        if name in headers and name in _BODY_HEADERS:
            raise BadRequest(400, f"more than one {name} header")
        headers[name] = value.strip()
    if all(name in headers for name in _BODY_HEADERS):
        raise BadRequest(400, "both content-length and transfer-encoding")
    if headers.get("content-length", "0") not in ("", "0") or "transfer-encoding" in headers:
        raise BadRequest(413, "a scrape has no request body")
    return RequestHead(method, target, version, headers)
