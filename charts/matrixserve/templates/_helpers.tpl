{{/* Names, labels and shared values. */}}
{{- define "matrixserve.fullname" -}}
{{- if contains "matrixserve" .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-matrixserve" .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "matrixserve.labels" -}}
app.kubernetes.io/name: matrixserve
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "matrixserve.selector" -}}
app.kubernetes.io/name: matrixserve
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "matrixserve.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "matrixserve.zookeeper" -}}
{{- if .Values.zookeeper.external -}}
{{- .Values.zookeeper.external -}}
{{- else -}}
{{- /* The bundled ZooKeeper's Service, by the variables the kubelet injects for it (no DNS
needed; Helm creates Services before the Deployments that use them). */ -}}
{{- $var := printf "%s_ZOOKEEPER_SERVICE" (include "matrixserve.fullname" . | upper | replace "-" "_") -}}
{{- printf "$(%s_HOST):$(%s_PORT)" $var $var -}}
{{- end -}}
{{- end -}}

{{/* The container security context every MatrixServe container runs with. */}}
{{- define "matrixserve.securityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
runAsNonRoot: true
capabilities:
  drop: ["ALL"]
{{- end -}}

{{/* Environment every MatrixServe container gets: its pod's IP and namespace. */}}
{{- define "matrixserve.podEnv" -}}
- name: POD_IP
  valueFrom: {fieldRef: {fieldPath: status.podIP}}
- name: POD_NAMESPACE
  valueFrom: {fieldRef: {fieldPath: metadata.namespace}}
{{- end -}}
