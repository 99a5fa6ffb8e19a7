"""Ground-truth KV: what a clean forward pass would have written for each token.

A real model's KV for token ``p`` depends on every token before it (attention
mixes the whole prefix into the hidden state from layer 1 on) and on ``p``
itself (positional encoding). The stand-in here keeps exactly that dependency
and nothing else: the KV row of token ``p`` is a fixed pseudo-random function of
a *prefix digest* ``H_p`` over all ``(token_id, position)`` pairs ``0..p``.
Consequences the verifier relies on:

* KV cached for one prefix does not verify for another prefix, even when the
  block's own tokens are identical (``H_p`` differs), so a prefix-cache hit on a
  wrong or stale block is caught;
* the digest is computed from the request's token ids, never from the engine's
  block hashes, so a hashing bug in the engine cannot hide itself.

The digest is additive, ``H_p = sum_{i<=p} mix(token_i, i) mod P`` in two lanes
modulo the Mersenne prime ``P = 2**31 - 1`` (62 bits against collisions), so a
chunk of tokens extends it with one ``cumsum`` and no per-token Python loop. All
integer products stay below ``2**62``: no reliance on int64 wrap-around, which
is undefined in C++ and could differ between CPU and CUDA kernels. KV values are
24-bit fractions in ``[-1, 1)``, exact in float32; half-precision dtypes round
them the same way everywhere, so equality checks stay exact.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from kvmetrics.lab.engine.tokens import mix64

#: The modulus of every digest lane: the Mersenne prime 2**31 - 1.
P = (1 << 31) - 1
LANES = 2
_ROUNDS = 3
_VALUE_BITS = 24

#: ``tokens(request_id, start, end)`` -> the request's token ids in [start, end).
TokenSource = Callable[[str, int, int], list[int]]


def _constants(seed: int, salt: int, n: int) -> list[int]:
    """``n`` odd-looking constants in 1..P-1, a pure function of (seed, salt)."""
    return [mix64((seed * 0x100000001B3 + salt * 0x10001 + i) & ((1 << 64) - 1)) % (P - 1) + 1
            for i in range(n)]


def _scramble(v: torch.Tensor, mul: torch.Tensor, add: torch.Tensor) -> torch.Tensor:
    """Rounds of multiply-mod-P and xor-shift; inputs and outputs stay in [0, 2**31)."""
    for r in range(_ROUNDS):
        v = (v * mul[r] + add[r]) % P
        v = v ^ (v >> 16)
    return v


class GroundTruth:
    """Batched ground-truth KV on one device, for one ``kv_dim``, dtype and seed."""

    def __init__(self, kv_dim: int = 8, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", seed: int = 0) -> None:
        if isinstance(kv_dim, bool) or not isinstance(kv_dim, int) or kv_dim < 1:
            raise ValueError(f"kv_dim must be a positive integer, got {kv_dim!r}")
        self.kv_dim = kv_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.seed = seed

        def t(values: list[int], device: torch.device) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        cpu = torch.device("cpu")
        # Token mixing runs on the CPU, where the engine's token ids live.
        self._tok_mul = t(_constants(seed, 1, LANES), cpu)
        self._pos_mul = t(_constants(seed, 2, LANES), cpu)
        self._tok_rmul = t(_constants(seed, 3, _ROUNDS * LANES), cpu).view(_ROUNDS, LANES)
        self._tok_radd = t(_constants(seed, 4, _ROUNDS * LANES), cpu).view(_ROUNDS, LANES)
        # KV expansion runs on the data plane's device.
        dev = self.device
        self._dim_mul0 = t(_constants(seed, 5, kv_dim), dev)
        self._dim_mul1 = t(_constants(seed, 6, kv_dim), dev)
        self._dim_add = t(_constants(seed, 7, kv_dim), dev)
        self._dim_rmul = t(_constants(seed, 8, _ROUNDS * kv_dim), dev).view(_ROUNDS, kv_dim)
        self._dim_radd = t(_constants(seed, 9, _ROUNDS * kv_dim), dev).view(_ROUNDS, kv_dim)

    # -- digests (CPU) ---------------------------------------------------------------

    def token_terms(self, token_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Each token's additive contribution to the prefix digest, ``[n, LANES]``."""
        x = (token_ids.to(torch.int64) % P).unsqueeze(1)
        p = (positions.to(torch.int64) % P).unsqueeze(1)
        v = (x * self._tok_mul % P + p * self._pos_mul % P) % P
        return _scramble(v, self._tok_rmul, self._tok_radd)

    def prefix_digests(self, token_ids: Sequence[int] | torch.Tensor, start: int = 0,
                       carry: torch.Tensor | None = None) -> torch.Tensor:
        """Digests ``H_start..H_end-1`` of tokens at positions ``start..``, ``[n, LANES]``.

        ``carry`` is ``H_{start-1}`` (the digest of the prefix before ``start``);
        omit it when ``start`` is 0.
        """
        ids = torch.as_tensor(token_ids, dtype=torch.int64)
        positions = torch.arange(start, start + ids.numel(), dtype=torch.int64)
        sums = self.token_terms(ids, positions).cumsum(0)
        if carry is not None:
            sums = sums + carry
        return sums % P

    # -- KV values (device) ------------------------------------------------------------

    def kv_from_digests(self, digests: torch.Tensor) -> torch.Tensor:
        """KV rows ``[n, kv_dim]`` in ``self.dtype`` on ``self.device`` for given digests."""
        d = digests.to(self.device, non_blocking=True)
        h0, h1 = d[:, 0:1], d[:, 1:2]
        v = (h0 * self._dim_mul0 % P + h1 * self._dim_mul1 % P + self._dim_add) % P
        v = _scramble(v, self._dim_rmul, self._dim_radd)
        u = (v & ((1 << _VALUE_BITS) - 1)).to(torch.float32)
        values = u * (1.0 / (1 << (_VALUE_BITS - 1))) - 1.0
        return values.to(self.dtype)

    def kv(self, token_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """KV of a whole sequence computed from scratch (the slow, obviously right way)."""
        return self.kv_from_digests(self.prefix_digests(token_ids))


class PrefixDigestCache:
    """Per-request digests ``H_0..H_{n-1}``, extended as a request's tokens become known.

    Token ids at a position never change for a request (a discarded step's
    sampled token is never appended, rollbacks keep the tokens), so each token is
    fetched and mixed once per request however often it is recomputed or re-read.
    """

    def __init__(self, truth: GroundTruth, tokens: TokenSource) -> None:
        self.truth = truth
        self.tokens = tokens
        self._digests: dict[str, torch.Tensor] = {}
        self._lengths: dict[str, int] = {}

    def get(self, request_id: str, end: int) -> torch.Tensor:
        """Digests of positions ``0..end-1`` of a request (a CPU view, ``[end, LANES]``)."""
        length = self._lengths.get(request_id, 0)
        buf = self._digests.get(request_id)
        if end > length:
            ids = self.tokens(request_id, length, end)
            if len(ids) != end - length:
                raise ValueError(f"token source gave {len(ids)} tokens for request "
                                 f"{request_id!r} [{length}, {end}), expected {end - length}")
            carry = buf[length - 1] if (buf is not None and length) else None
            fresh = self.truth.prefix_digests(ids, length, carry)
            if buf is None or buf.shape[0] < end:
                grown = torch.empty((max(end, 2 * length, 64), LANES), dtype=torch.int64)
                if buf is not None and length:
                    grown[:length] = buf[:length]
                buf = self._digests[request_id] = grown
            buf[length:end] = fresh
            self._lengths[request_id] = length = end
        assert buf is not None
        return buf[:end]

    def drop(self, request_id: str) -> None:
        self._digests.pop(request_id, None)
        self._lengths.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._digests)
