"""The engine's HTTP protocol, as the gateway, the engine stub and the benchmarks' null engine
all speak it (one definition)."""

from __future__ import annotations

import math


def count_tokens(text: str) -> int:
    """A deterministic stand-in tokenizer: about four characters a token (the engines count
    prompts with it, and the gateway sizes TTFT budgets with it)."""
    return max(1, math.ceil(len(text) / 4))
