"""Adapters: the only code that talks to Kubernetes, ZooKeeper and the engines over HTTP."""
