"""The engine process (``python -m enginestub``): a FlowServe-like serving engine on emulated dies.

- :mod:`.config` — what the process is (role, model, dies, batch, time scale), from flags/env;
- :mod:`.clock` — emulated time: every duration reported is emulated seconds; a time scale
  (emulated seconds per wall second) compresses long phases without changing any ratio;
- :mod:`.sharing` — processor sharing in emulated time (prefill compute, KV links);
- :mod:`.core` — prefill (accept or reject, no queue), KV pull, decode continuous batching;
- :mod:`.resident` — the P/D-Serve resident process over ZooKeeper (§3.2-3.4);
- :mod:`.server` — HTTP: engine API, health, metrics, fault injection.
"""
