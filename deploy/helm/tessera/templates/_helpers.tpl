{{/* Names and labels shared by every object of the chart. */}}

{{/* The prefix of every object's name: at most 39 characters, so that the longest name the chart
     builds, <fullname>-dashboard-control-plane (24 more), fits Kubernetes' 63, and the
     coordinator StatefulSet's name (12 more) stays within 52, which its pods'
     controller-revision-hash label (<name>-<10-character hash>) needs. A longer prefix is cut to
     32 characters and given 6 of its sha256, so that two long release names that share a
     beginning still get names of their own. Helm takes release names with dots or a leading
     digit, which a Service name cannot have: dots become dashes, and such a release is put after
     the chart's name. */}}
{{- define "tessera.fullname" -}}
{{- $release := .Release.Name | replace "." "-" -}}
{{- $name := $release -}}
{{- if regexMatch "^[0-9]" $release -}}
{{- $name = printf "%s-%s" .Chart.Name $release -}}
{{- else if not (contains .Chart.Name $release) -}}
{{- $name = printf "%s-%s" $release .Chart.Name -}}
{{- end -}}
{{- if gt (len $name) 39 -}}
{{- $name = printf "%s-%s" ($name | trunc 32 | trimSuffix "-") (sha256sum $name | trunc 6) -}}
{{- end -}}
{{- $name -}}
{{- end -}}

{{/* Labels of the objects' own metadata. The version labels change with every chart release, so
     they are never in a selector, a volumeClaimTemplate or a pod template (tessera.podLabels):
     the first two are immutable, and a pod template that changed would roll the pods. */}}
{{- define "tessera.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | trunc 63 | trimSuffix "-" | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end -}}

{{/* A component's selector (dict "root" . "component" NAME): the same for the life of a
     release. */}}
{{- define "tessera.selector" -}}
app.kubernetes.io/name: {{ .root.Chart.Name }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* A pod template's labels (dict "root" . "component" NAME "extra" LABELS): the selector, then
     the user's podLabels, which cannot replace a selector label. */}}
{{- define "tessera.podLabels" -}}
{{- $labels := include "tessera.selector" . | fromYaml -}}
{{- toYaml (merge $labels (.extra | default dict)) -}}
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

{{/* A daemon container's security context (dict "add" CAPABILITIES): everything dropped but the
     capabilities the values add (e.g. IPC_LOCK for RDMA). */}}
{{- define "tessera.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: [ALL]
  {{- with .add }}
  add: {{ toJson . }}
  {{- end }}
{{- end -}}

{{/* The pod-level settings both daemons take from values (dict "root" . "v" COMPONENT_VALUES). */}}
{{- define "tessera.podOptions" -}}
{{- with .v.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with .v.runtimeClassName }}
runtimeClassName: {{ . }}
{{- end }}
{{- with .root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .v.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .v.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .v.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* Where the chart mounts its Secrets (docs/security.md). Whole directories, never subPath, so
     that rotated certificates and an edited auth file reach the daemons without a restart. */}}
{{- define "tessera.tlsDir" -}}/etc/tessera/tls{{- end -}}
{{- define "tessera.authDir" -}}/etc/tessera/auth{{- end -}}
{{- define "tessera.joinDir" -}}/etc/tessera/join{{- end -}}
{{- define "tessera.queuesDir" -}}/etc/tessera/queues{{- end -}}
{{- define "tessera.databaseDir" -}}/etc/tessera/database{{- end -}}

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

{{/* A probe's handler (dict "port" N, and "service" NAME to ask about one service rather than the
     process): Kubernetes' grpc probe on a daemon's health-only port (--health-listen), which is
     plaintext whether or not the main port speaks TLS, so the probe always reads the health
     service's statuses. */}}
{{- define "tessera.grpcProbeHandler" -}}
{{- if .service -}}
grpc: {port: {{ .port }}, service: {{ .service }}}
{{- else -}}
grpc: {port: {{ .port }}}
{{- end -}}
{{- end -}}

{{/* "true" when the coordinator keeps its state in PostgreSQL (database.url), else "". Fails
     with the value at fault when several coordinators are asked for without PostgreSQL, or when
     the database settings are incomplete or carry a password in the URL. */}}
{{- define "tessera.coordinatorOnPostgres" -}}
{{- $db := .Values.database | default dict -}}
{{- $url := $db.url | default "" -}}
{{- $replicas := int (.Values.coordinator.replicas | default 1) -}}
{{- if and (gt $replicas 1) (not $url) -}}
{{- fail (printf "coordinator.replicas is %d, but several coordinators need their state in PostgreSQL: set database.url (postgresql://USER@HOST/DB) and database.existingSecret; SQLite state on a volume has a single writer" $replicas) -}}
{{- end -}}
{{- if $url -}}
{{- if regexMatch "^postgres(ql)?://[^/@?]*:[^/@?]*@" $url -}}
{{- fail "database.url carries a password: give it without one (postgresql://USER@HOST/DB) and put the password in the Secret database.existingSecret" -}}
{{- end -}}
{{- if regexMatch "[?&]password=" $url -}}
{{- fail "database.url carries a password parameter: drop it and put the password in the Secret database.existingSecret" -}}
{{- end -}}
{{- if not $db.existingSecret -}}
{{- fail "database.url is set but database.existingSecret is empty: name the Secret holding the database user's password (key database.passwordKey), e.g. CloudNativePG's <cluster>-app" -}}
{{- end -}}
true
{{- end -}}
{{- end -}}

{{/* The coordinators' spread over nodes when several run (coordinator.podAntiAffinity): a node's
     loss then takes at most one of them. */}}
{{- define "tessera.coordinatorAntiAffinity" -}}
{{- $term := dict "labelSelector" (dict "matchLabels" (include "tessera.selector" (dict "root" . "component" "coordinator") | fromYaml)) "topologyKey" "kubernetes.io/hostname" -}}
podAntiAffinity:
{{- if eq (.Values.coordinator.podAntiAffinity | default "preferred") "required" }}
  requiredDuringSchedulingIgnoredDuringExecution:
    {{- toYaml (list $term) | nindent 4 }}
{{- else }}
  preferredDuringSchedulingIgnoredDuringExecution:
    {{- toYaml (list (dict "weight" 100 "podAffinityTerm" $term)) | nindent 4 }}
{{- end }}
{{- end -}}
