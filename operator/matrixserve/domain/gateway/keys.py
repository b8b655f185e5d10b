"""API keys and their per-key rate limit, pure (the caller passes the time)."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class TokenBucket:
    """Per-key rate limit: ``rate`` requests per second, bursts up to ``burst``."""

    rate: float
    burst: float
    tokens: float
    updated: float

    def take(self, now: float) -> bool:
        self.tokens = min(self.burst, self.tokens + (now - self.updated) * self.rate)
        self.updated = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False

    def retry_after(self) -> float:
        return max(0.0, (1.0 - self.tokens) / self.rate)

    def retry_after_header(self) -> str:
        """``Retry-After`` as RFC 9110 writes it: whole seconds, rounded up, at least 1."""
        return str(max(1, math.ceil(self.retry_after())))


def parse_keys(data: dict[str, str]) -> dict[str, str]:
    """A Secret's data (already decoded): entry name -> API key. Returns key -> entry name."""
    keys = {}
    for name, value in data.items():
        key = value.strip()
        if len(key) < 16:
            raise ValueError(f"API key {name!r} is shorter than 16 characters")
        keys[key] = name
    return keys


def bearer(header: str | None) -> str | None:
    if not header or not header.startswith("Bearer "):
        return None
    return header[len("Bearer ") :].strip() or None
