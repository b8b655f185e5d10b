"""What the tests and the benchmarks share: :mod:`.helpers` (polling, the cluster's objects, the
tests' clients) and :mod:`.chaoskit` (traffic through the gateway, faults and their heals, the
group whole in ZooKeeper).

It sits at the repository root, beside ``tests/`` and ``bench/``, so that neither reaches into
the other: pytest finds it through ``pythonpath`` in pyproject.toml, a benchmark (run as
``python bench/<name>.py``) puts the repository root on its path.
"""
