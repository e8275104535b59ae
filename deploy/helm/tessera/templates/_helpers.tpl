{{/* Names and labels shared by every object of the chart. */}}
{{- define "tessera.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "tessera.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "tessera.selector" -}}
app.kubernetes.io/name: {{ .root.Chart.Name }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "tessera.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{- define "tessera.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- .Values.serviceAccount.name | default (include "tessera.fullname" .) -}}
{{- else -}}
{{- .Values.serviceAccount.name | default "default" -}}
{{- end -}}
{{- end -}}

{{- define "tessera.sharedClaim" -}}
{{- .Values.sharedStorage.existingClaim | default (printf "%s-shared" (include "tessera.fullname" .)) -}}
{{- end -}}

{{/* The coordinator's gRPC address inside the cluster. */}}
{{- define "tessera.coordinatorAddress" -}}
{{ include "tessera.fullname" . }}-coordinator.{{ .Release.Namespace }}.svc:{{ .Values.coordinator.grpcPort }}
{{- end -}}

{{- define "tessera.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: [ALL]
{{- end -}}

{{/* Where the chart mounts its Secrets (docs/security.md). Whole directories, never subPath, so
     that rotated certificates and an edited auth file reach the daemons without a restart. */}}
{{- define "tessera.tlsDir" -}}/etc/tessera/tls{{- end -}}
{{- define "tessera.authDir" -}}/etc/tessera/auth{{- end -}}
{{- define "tessera.joinDir" -}}/etc/tessera/join{{- end -}}

{{/* gRPC transport flags of both daemons: TLS from the mounted Secret, else plaintext, which a
     daemon refuses on 0.0.0.0 unless told --insecure. */}}
{{- define "tessera.transportArgs" -}}
{{- if .Values.tls.enabled -}}
- --tls-cert={{ include "tessera.tlsDir" . }}/tls.crt
- --tls-key={{ include "tessera.tlsDir" . }}/tls.key
- --tls-ca={{ include "tessera.tlsDir" . }}/ca.crt
{{- else -}}
- --insecure
{{- end -}}
{{- end -}}

{{/* A probe's handler for a daemon's gRPC port (dict "root" . "port" N). Kubernetes' grpc probe
     speaks plaintext only, so with TLS on it becomes a TCP connect: it proves the port is open,
     not that the health service says SERVING. */}}
{{- define "tessera.grpcProbeHandler" -}}
{{- if .root.Values.tls.enabled -}}
tcpSocket: {port: {{ .port }}}
{{- else -}}
grpc: {port: {{ .port }}}
{{- end -}}
{{- end -}}

