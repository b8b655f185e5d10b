"""The gateway's API keys: ``Authorization: Bearer <key>`` checked against the keys of a Secret,
a rate limit per key (token bucket), and the loader that keeps the keys current (docs/gateway.md,
"API keys"). Fail closed: until the Secret has been read, and whenever it cannot be, no key is
valid. The pure parts (the bucket, the Secret's entries, the header) are in
:mod:`matrixserve.domain.gateway.keys`.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import time

from aiohttp import web
from kubernetes import client

from matrixserve.domain.gateway.keys import TokenBucket, bearer, parse_keys
from matrixserve.domain.gateway.labels import UNKNOWN_SCENARIO
from matrixserve.gateway.config import GatewayConfig, GatewayMetrics
from matrixserve.gateway.openai import failure

log = logging.getLogger("matrixserve.gateway")
KEYS_RELOAD_SECONDS = 10


class ApiKeys:
    def __init__(self, config: GatewayConfig, metrics: GatewayMetrics) -> None:
        self.config = config
        self.metrics = metrics
        self.names: dict[str, str] = {}  # API key -> its name in the Secret (set by keep_keys)
        self.buckets: dict[str, TokenBucket] = {}  # per key name

    def authorize(self, request: web.Request) -> web.Response | None:
        """None if the request may proceed, else the 401/429 answer."""
        if not self.config.require_keys:
            return None
        key = bearer(request.headers.get("Authorization"))
        name = self.names.get(key) if key else None
        if name is None:
            self.metrics.requests.labels(scenario=UNKNOWN_SCENARIO, outcome="unauthorized").inc()
            return failure(
                401,
                "missing or invalid API key: send Authorization: Bearer <key>",
                "invalid_request_error",
                "invalid_api_key",
            )
        if self.config.rate_limit > 0:
            now = time.monotonic()
            bucket = self.buckets.setdefault(
                name,
                TokenBucket(
                    self.config.rate_limit, self.config.rate_burst, self.config.rate_burst, now
                ),
            )
            if not bucket.take(now):
                self.metrics.requests.labels(
                    scenario=UNKNOWN_SCENARIO, outcome="rate_limited"
                ).inc()
                return failure(
                    429,
                    f"rate limit of {self.config.rate_limit:g} requests/s for key {name!r} exceeded",
                    "rate_limit_exceeded",
                    "rate_limited",
                    retry_after=bucket.retry_after_header(),
                )
        return None


async def keep_keys(keys: ApiKeys, api: client.ApiClient, namespace: str, name: str) -> None:
    """Load the API keys from the Secret and re-read it every 10 s; until it can be read, no key
    is valid (fail closed)."""
    core = client.CoreV1Api(api)
    while True:
        try:
            secret = await asyncio.to_thread(
                core.read_namespaced_secret, name, namespace, _request_timeout=(5.0, 30.0)
            )
            data = {k: base64.b64decode(v).decode() for k, v in (secret.data or {}).items()}
            keys.names = parse_keys(data)
        except Exception as exc:  # refused, unreadable, or the API server away: fail closed
            keys.names = {}
            log.warning(
                "API keys from Secret %s/%s unavailable (%s): every request is refused",
                namespace,
                name,
                exc,
            )
        await asyncio.sleep(KEYS_RELOAD_SECONDS)
