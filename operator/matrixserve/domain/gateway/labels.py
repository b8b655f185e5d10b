"""The values the gateway's metric labels take, pure: nothing a client or an engine sends
becomes a label value; each label takes its values from a known set, so a scrape never fails and
the series stay bounded.
"""

from __future__ import annotations

from http import HTTPStatus

UNKNOWN_SCENARIO = "_unknown"  # not a DNS label, so never a routed scenario's name
ENGINE_ERROR_CODES = frozenset(
    {
        "ttft_timeout",
        "kv_exhausted",
        "kv_pull_failed",
        "device_fault",
        "no_decode",
        "decode_failed",
        "unknown_request",
        "upstream_failed",
        "stream_interrupted",
    }
)
_HTTP_STATUSES = frozenset(int(s) for s in HTTPStatus)


def error_code(code: object) -> str:
    """An engine's error code as the gateway passes it on, to clients and as a label: one it
    knows, else ``engine_error``."""
    return code if isinstance(code, str) and code in ENGINE_ERROR_CODES else "engine_error"


def answer_label(status: int) -> str:
    """A prefill's HTTP answer other than accepted or busy, as a label: a status HTTP defines
    (``http_<code>``), else ``http_other``."""
    return f"http_{status}" if status in _HTTP_STATUSES else "http_other"
