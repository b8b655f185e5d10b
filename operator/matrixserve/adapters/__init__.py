"""Adapters: the operator's reads and writes of the world, below its handlers: the Kubernetes API
(generic by kind) and one ZooKeeper store per kind that keeps state there, built on the shared
session (:mod:`matrixserve.coordination`). No kopf here."""
