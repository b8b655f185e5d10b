"""The engine process (``python -m enginestub``): a FlowServe-like serving engine on emulated dies.

- :mod:`.config` — what the process is (role, model, dies, batch, time scale), from flags/env;
- :mod:`.clock` — emulated time: every duration reported is emulated seconds; a time scale
  (emulated seconds per wall second) compresses long phases without changing any ratio;
- :mod:`.sharing` — processor sharing in emulated time (prefill compute, KV links);
- :mod:`.core` — the engine (facade): lifecycle, health, each request's path through its parts:
  :mod:`.prefill` (accept or reject, no queue), :mod:`.to_decode` (forwarding to a decode),
  :mod:`.kvpull` (the KV pull, both sides), :mod:`.decode` (continuous batching),
  :mod:`.kvcache` (HBM for KV), :mod:`.faults` (device status file, injected faults);
  the wire format is :mod:`matrixserve.api.engine_protocol`;
- :mod:`.resident` — the P/D-Serve resident process over ZooKeeper (§3.2-3.4), also a fork
  source's registry entry; :mod:`.zkbridge` — what it shares with a warm engine (kazoo's
  threads to the event loop, re-registration after a lost session);
- :mod:`.fork` — NPU-fork (DeepServe §6.2): the source's broadcast, the target's load plan;
- :mod:`.warm` — a pre-warmed, model-agnostic engine waiting for its assignment (§6.1);
- :mod:`.server` — HTTP: engine API, health, metrics, fault injection.
"""
