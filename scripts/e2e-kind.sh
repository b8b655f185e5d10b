#!/usr/bin/env bash
# End to end on kind (users with Docker; `make e2e-kind`): the chart with real kubelets and the
# node-emulator DaemonSet, a sample PDGroup Ready, one chat completion through the gateway, an
# upgrade, then deletion and uninstall with nothing left. Uses the current kubectl context.
set -euo pipefail
ns=matrixserve-system
demo=matrixserve-e2e
fail() { echo "e2e-kind: $*" >&2; exit 1; }
helm upgrade --install matrixserve charts/matrixserve -n "$ns" --create-namespace --wait --timeout 5m \
  --set nodeEmulator.enabled=true --set image.pullPolicy=Never
kubectl create namespace "$demo" --dry-run=client -o yaml | kubectl apply -f -
sed 's/name: chat-g0/name: g/' crds/samples/pdgroup-2p1d.yaml | kubectl apply -n "$demo" -f -
kubectl wait -n "$demo" pdgroup/g --for=condition=Ready --timeout=5m
# From inside the cluster: the gateway listens on its pod IP (kubectl port-forward would dial
# the pod's localhost).
answer=$(kubectl run e2e-curl -n "$demo" --rm -i --restart=Never --quiet --image=curlimages/curl:8.10.1 -- \
  curl -sf "http://matrixserve-gateway.$ns.svc/v1/chat/completions" -H 'Content-Type: application/json' \
  -d '{"model":"general","messages":[{"role":"user","content":"hi"}],"max_tokens":4}') \
  || fail "no answer from the gateway"
echo "$answer" | grep -q '"completion_tokens": *4' || fail "unexpected answer: $answer"
helm upgrade matrixserve charts/matrixserve -n "$ns" --wait --reuse-values --set operator.logLevel=DEBUG
kubectl wait -n "$demo" pdgroup/g --for=condition=Ready --timeout=2m
kubectl delete -n "$demo" pdgroup/g --wait --timeout=2m
helm uninstall matrixserve -n "$ns" --wait
left=$(kubectl get pods -n "$demo" -o name | wc -l)
[ "$left" = 0 ] || fail "$left pods left in $demo"
echo "e2e-kind: passed"
