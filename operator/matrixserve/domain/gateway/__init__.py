"""The gateway's decisions, pure: no I/O, no clock (``matrixserve.gateway`` does the serving).

- :mod:`.routing`: which prefill entrance a request tries, in what order (P/D-Serve §3.5), and
  its TTFT budget (§2.2.2);
- :mod:`.completions`: the OpenAI request parsed and validated, and the stop-string scanner;
- :mod:`.reoffer`: a stream whose entrance was lost, offered to another;
- :mod:`.refusals`: a prefill's answer that refuses the request itself, and its ``Retry-After``;
- :mod:`.labels`: the known values metric labels take;
- :mod:`.keys`: API keys and their rate limit.
"""
