"""A real local Kubernetes control plane and ZooKeeper, started by the project's own code.

No Docker and no kubelet here: etcd, kube-apiserver, kube-controller-manager and kube-scheduler
(v1.37.2, built from the Go module proxy's ``k8s.io/kubernetes``; the old v1.20.2 from Debian's
source package with ``MATRIXSERVE_KUBERNETES=1.20``) and ZooKeeper run as local processes on
127.0.0.1 under one state directory. See ``docs/devcluster.md`` and
``../shared/design/LOCAL-CLUSTER.md``.

Command line: ``python -m matrixserve.devcluster setup|up|down|status|env``.
"""

from matrixserve.devcluster.errors import DevClusterError

__all__ = ["DevClusterError"]
