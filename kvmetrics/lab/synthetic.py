"""Synthetic workloads with the sharing patterns that make prefix caching matter.

Each generator is deterministic under its seed and returns :class:`WorkItem`s
with Poisson arrivals. Token ids are explicit; shared parts are the very same
token lists, so they hash to the same blocks.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from kvmetrics.lab.engine.tokens import VOCAB_SIZE, ExplicitTokens
from kvmetrics.lab.workload import WorkItem

#: One line each; ``kvmetrics workloads`` prints this table.
DESCRIPTIONS: dict[str, str] = {
    "chat": "multi-turn chat: each turn resends the whole conversation so far plus a new "
            "user message",
    "agent": "agent loops: a few long shared system prompts with tool outputs appended "
             "step by step",
    "rag": "retrieval-augmented generation: a shared system prompt plus 2-4 documents drawn "
           "from a small shared pool, then a question",
    "random": "unshared random prompts (no prefix reuse: a floor for hit ratios)",
    "mixed": "the default: chat, agent, rag and random requests interleaved (40/25/25/10 %)",
}


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, VOCAB_SIZE) for _ in range(n)]


class _Builder:
    def __init__(self, seed: int, rate: float, max_tokens: tuple[int, int]) -> None:
        self.rng = random.Random(seed)
        self.rate = rate
        self.max_tokens = max_tokens
        self.clock = 0.0
        self.items: list[WorkItem] = []

    def emit(self, kind: str, prompt: list[int]) -> None:
        self.clock += self.rng.expovariate(self.rate)
        rid = f"{kind}-{len(self.items):05d}"
        self.items.append(WorkItem(rid, self.clock, ExplicitTokens(prompt),
                                   self.rng.randint(*self.max_tokens)))


def _chat(b: _Builder, n: int) -> None:
    rng = b.rng
    while n > 0:
        history = _tokens(rng, rng.randint(20, 120))
        for _ in range(min(n, rng.randint(2, 6))):
            history = history + _tokens(rng, rng.randint(10, 80))
            b.emit("chat", history)
            history = history + _tokens(rng, rng.randint(20, 120))  # the assistant's reply
            n -= 1


def _agent(b: _Builder, n: int, system_prompts: list[list[int]]) -> None:
    rng = b.rng
    while n > 0:
        trajectory = list(rng.choice(system_prompts)) + _tokens(rng, rng.randint(10, 40))
        for _ in range(min(n, rng.randint(2, 5))):
            trajectory = trajectory + _tokens(rng, rng.randint(30, 150))  # tool output
            b.emit("agent", trajectory)
            n -= 1


def _rag(b: _Builder, n: int, system: list[int], docs: list[list[int]]) -> None:
    rng = b.rng
    for _ in range(n):
        prompt = list(system)
        for doc in rng.sample(docs, rng.randint(2, 4)):
            prompt += doc
        b.emit("rag", prompt + _tokens(rng, rng.randint(10, 40)))


def _random(b: _Builder, n: int) -> None:
    for _ in range(n):
        b.emit("random", _tokens(b.rng, b.rng.randint(50, 600)))


def generate(name: str, num_requests: int, seed: int = 0, rate: float = 100.0,
             max_tokens: tuple[int, int] = (8, 48)) -> list[WorkItem]:
    """``rate`` is the mean arrival rate in requests per second of workload time."""
    if name not in DESCRIPTIONS:
        raise ValueError(f"unknown workload {name!r} (choose from {', '.join(DESCRIPTIONS)})")
    b = _Builder(seed, rate, max_tokens)
    rng = b.rng
    system_prompts = [_tokens(rng, rng.randint(300, 700)) for _ in range(3)]
    rag_system = _tokens(rng, 120)
    docs = [_tokens(rng, rng.randint(100, 250)) for _ in range(12)]
    parts: dict[str, Callable[[int], None]] = {
        "chat": lambda k: _chat(b, k),
        "agent": lambda k: _agent(b, k, system_prompts),
        "rag": lambda k: _rag(b, k, rag_system, docs),
        "random": lambda k: _random(b, k),
    }
    if name != "mixed":
        parts[name](num_requests)
        return b.items
    shares = {"chat": 0.40, "agent": 0.25, "rag": 0.25, "random": 0.10}
    remaining = num_requests
    # Interleave in small bursts so the kinds compete for the cache at the same time.
    while remaining > 0:
        for kind, share in shares.items():
            k = min(remaining, max(1, round(share * 10)))
            parts[kind](k)
            remaining -= k
            if remaining <= 0:
                break
    return b.items
