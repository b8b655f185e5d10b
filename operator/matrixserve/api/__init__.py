"""The API, imported by everyone (the engine stub included); pure, no I/O imports.

- :mod:`.kinds` — group, version, the kinds, label keys;
- :mod:`.resources` — pydantic models of the custom resources' specs, mirroring ``crds/`` (a
  contract test checks that they agree);
- :mod:`.status` — pydantic models of their statuses as stored, read once and written whole;
- :mod:`.zk_layout` — ZooKeeper paths, payloads and znode operations;
- :mod:`.engine_protocol` — the engine's HTTP protocol;
- :mod:`.catalog` — hardware facts and model shapes, with their sources.
"""
