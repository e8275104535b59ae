{{/*
The alert rule groups of files/alerts.rules.tpl.yaml rendered with this release's values:
Prometheus' own [[ ... ]] actions turned back into double braces, rules named in alerts.disabled
left out, and every rule given the routing labels (team = alerts.owner, then alerts.labels; a
rule's own labels win) and a runbook_url pointing at its section of docs/runbooks.md (GitHub's
anchor of a heading is the heading in lower case). Output: YAML {groups: [...]}.
*/}}
{{- define "tessera.alertGroups" -}}
{{- $alerts := .Values.alerts -}}
{{- $text := tpl (.Files.Get "files/alerts.rules.tpl.yaml") . | replace "[[" "{{" | replace "]]" "}}" -}}
{{- $parsed := fromYaml $text -}}
{{- if hasKey $parsed "Error" -}}
{{- fail (printf "files/alerts.rules.tpl.yaml does not render to YAML: %s" $parsed.Error) -}}
{{- end -}}
{{- $names := list -}}
{{- range $parsed.groups -}}{{- range .rules -}}{{- $names = append $names .alert -}}{{- end -}}{{- end -}}
{{- range ($alerts.disabled | default list) -}}
{{- if not (has . $names) -}}
{{- fail (printf "alerts.disabled: no alert is named %q (the alerts: %s)" . (join ", " $names)) -}}
{{- end -}}
{{- end -}}
{{- $groups := list -}}
{{- range $parsed.groups -}}
{{- $rules := list -}}
{{- range .rules -}}
{{- if not (has .alert ($alerts.disabled | default list)) -}}
{{- $labels := merge (dict) (.labels | default dict) $alerts.labels (dict "team" $alerts.owner) -}}
{{- $annotations := merge (dict "runbook_url" (printf "%s#%s" $alerts.runbookBaseUrl (lower .alert))) (.annotations | default dict) -}}
{{- $rules = append $rules (merge (dict "labels" $labels "annotations" $annotations) .) -}}
{{- end -}}
{{- end -}}
{{- if $rules -}}
{{- $groups = append $groups (dict "name" .name "rules" $rules) -}}
{{- end -}}
{{- end -}}
{{- toYaml (dict "groups" $groups) -}}
{{- end -}}
