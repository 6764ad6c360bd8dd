{{/* Names ------------------------------------------------------------------------------------ */}}

{{- define "agentrun.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "agentrun.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Checked here, where every render passes: the longest name derived from the fullname is a
     Service's, "<fullname>-operator-metrics" (17 more), and a Service name is at most 63
     characters. Longer, helm template rendered it and the install failed at the API server,
     half made. */}}
{{- define "agentrun.operatorName" -}}
{{- $full := include "agentrun.fullname" . -}}
{{- if gt (len $full) 46 -}}
{{- fail (printf "the release's full name %q is %d characters; the chart names a Service %q, longer than the 63 Kubernetes allows: use a release name of at most 46 characters, or set fullnameOverride" $full (len $full) (printf "%s-operator-metrics" $full)) -}}
{{- end -}}
{{- printf "%s-operator" $full -}}
{{- end -}}

{{- define "agentrun.workerSAName" -}}
{{- printf "%s-worker" (include "agentrun.fullname" .) -}}
{{- end -}}

{{/* The ServiceAccount a pool's pods run as (input: the pool's effective settings and root):
     serviceAccount.name (one you made), else one of the pool's own when it carries annotations
     (pod identity: IRSA's eks.amazonaws.com/role-arn, GKE's iam.gke.io/gcp-service-account),
     else the workers' shared one. */}}
{{- define "agentrun.poolSAName" -}}
{{- $sa := default dict .pool.serviceAccount -}}
{{- if $sa.name -}}
{{- $sa.name -}}
{{- else if $sa.annotations -}}
{{- .pool.deployment -}}
{{- else -}}
{{- include "agentrun.workerSAName" .root -}}
{{- end -}}
{{- end -}}

{{- define "agentrun.postgresqlName" -}}
{{- printf "%s-postgresql" (include "agentrun.fullname" .) -}}
{{- end -}}

{{/* The Deployment of a pool; the operator finds it by this name in pools.yaml. */}}
{{- define "agentrun.workerDeployment" -}}
{{- $name := printf "%s-worker-%s" (include "agentrun.fullname" .root) .pool -}}
{{- if gt (len $name) 63 -}}
{{- fail (printf "worker Deployment name %q is longer than 63 characters: shorten the pool name or set fullnameOverride" $name) -}}
{{- end -}}
{{- $name -}}
{{- end -}}

{{/* Labels ----------------------------------------------------------------------------------- */}}

{{- define "agentrun.selectorLabels" -}}
app.kubernetes.io/name: {{ include "agentrun.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "agentrun.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "agentrun.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: agentrun
{{- end -}}

{{/* Image ------------------------------------------------------------------------------------ */}}

{{- define "agentrun.image" -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}
{{- end -}}

{{/* Secrets: only ever references to existing Secrets (or the bundled server's own). -------- */}}

{{- define "agentrun.databaseSecretName" -}}
{{- if .Values.postgresql.enabled -}}
{{- if .Values.database.existingSecret -}}
{{- fail "set either postgresql.enabled or database.existingSecret, not both" -}}
{{- end -}}
{{- include "agentrun.postgresqlName" . -}}
{{- else -}}
{{- required "database.existingSecret is required: the name of a Secret holding the PostgreSQL URL" .Values.database.existingSecret -}}
{{- end -}}
{{- end -}}

{{- define "agentrun.databaseSecretKey" -}}
{{- if .Values.postgresql.enabled -}}url{{- else -}}{{ .Values.database.secretKey }}{{- end -}}
{{- end -}}

{{- define "agentrun.databaseUrlEnv" -}}
- name: AGENTRUN_DATABASE_URL
  valueFrom:
    secretKeyRef:
      name: {{ include "agentrun.databaseSecretName" . }}
      key: {{ include "agentrun.databaseSecretKey" . }}
{{- end -}}

{{/* Security contexts: non-root, read-only root, no capabilities, RuntimeDefault seccomp. ---- */}}

{{- /* The image's user is 10001; the bundled PostgreSQL passes (dict "uid" 999), the postgres
       image's own user. */ -}}
{{- define "agentrun.podSecurityContext" -}}
{{- $uid := default 10001 .uid -}}
runAsNonRoot: true
runAsUser: {{ $uid }}
runAsGroup: {{ $uid }}
fsGroup: {{ $uid }}
fsGroupChangePolicy: OnRootMismatch
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "agentrun.containerSecurityContext" -}}
{{- $uid := default 10001 .uid -}}
runAsNonRoot: true
runAsUser: {{ $uid }}
runAsGroup: {{ $uid }}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
privileged: false
capabilities:
  drop: ["ALL"]
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{/* A pool's effective settings: workers.poolDefaults, then the pool's own keys (autoscaling merged
     key by key). `set` rather than mergeOverwrite, which cannot override with false or 0. */}}
{{- define "agentrun.pool" -}}
{{- $pool := deepCopy .root.Values.workers.poolDefaults -}}
{{- range $k, $v := .pool -}}
{{- if ne $k "autoscaling" -}}
{{- $_ := set $pool $k $v -}}
{{- end -}}
{{- end -}}
{{- $as := deepCopy (default dict $pool.autoscaling) -}}
{{- range $k, $v := (default dict .pool.autoscaling) -}}
{{- $_ := set $as $k $v -}}
{{- end -}}
{{- /* runsPerWorker follows the pool's concurrency unless the pool sets it: a pool of
       concurrency 2 kept the default 4, so the operator asked for half the workers its runs
       needed and the rest stayed pending, "steady". */ -}}
{{- if not (hasKey (default dict .pool.autoscaling) "runsPerWorker") -}}
{{- $_ := set $as "runsPerWorker" (min (int $as.runsPerWorker) (int $pool.concurrency)) -}}
{{- end -}}
{{- if gt (int $as.runsPerWorker) (int $pool.concurrency) -}}
{{- fail (printf "workers.pools[%s].autoscaling.runsPerWorker (%v) must not exceed the pool's concurrency (%v): a worker holds no more runs than that; lower runsPerWorker or raise concurrency" $pool.name $as.runsPerWorker $pool.concurrency) -}}
{{- end -}}
{{- $_ := set $pool "autoscaling" $as -}}
{{- if gt (int $as.minReplicas) (int $as.maxReplicas) -}}
{{- fail (printf "workers.pools[%s].autoscaling: minReplicas (%v) must not exceed maxReplicas (%v)" $pool.name $as.minReplicas $as.maxReplicas) -}}
{{- end -}}
{{- /* A pool's own resources replace poolDefaults' as a whole: name the values actually used. */ -}}
{{- $where := ternary (printf "workers.pools[%s].resources" $pool.name) "workers.poolDefaults.resources" (hasKey .pool "resources") -}}
{{- include "agentrun.checkResources" (dict "resources" (default dict $pool.resources) "where" $where "what" (printf "pool %q" $pool.name)) -}}
{{- $_ := set $pool "deployment" (include "agentrun.workerDeployment" (dict "root" .root "pool" $pool.name)) -}}
{{- toYaml $pool -}}
{{- end -}}

{{/* The operator's tenancy file: each pool's admitted namespaces, and the quotas. */}}
{{- define "agentrun.tenancy" -}}
{{- $pools := list -}}
{{- range .Values.workers.pools -}}
{{- $p := include "agentrun.pool" (dict "root" $ "pool" .) | fromYaml -}}
{{- $entry := dict "name" $p.name -}}
{{- with $p.namespaces }}{{- $_ := set $entry "namespaces" . -}}{{- end -}}
{{- with $p.namespaceSelector }}{{- $_ := set $entry "namespaceSelector" . -}}{{- end -}}
{{- $pools = append $pools $entry -}}
{{- end -}}
{{- dict "pools" $pools "quotas" (default dict .Values.quotas) | toYaml -}}
{{- end -}}

{{/* Whether a pool admits namespaces by label: the operator then reads Namespace objects. */}}
{{- define "agentrun.anyNamespaceSelector" -}}
{{- range .Values.workers.pools -}}
{{- $p := include "agentrun.pool" (dict "root" $ "pool" .) | fromYaml -}}
{{- if $p.namespaceSelector }}true{{ end -}}
{{- end -}}
{{- end -}}

{{/* Fail on two pools with one name (two Deployments would fight over one queue name). */}}
{{- define "agentrun.checkPools" -}}
{{- $seen := dict -}}
{{- range .Values.workers.pools -}}
{{- if hasKey $seen .name -}}
{{- fail (printf "workers.pools: pool %q is listed twice" .name) -}}
{{- end -}}
{{- $_ := set $seen .name true -}}
{{- end -}}
{{- end -}}

{{/* Resource quantities --------------------------------------------------------------------- */}}

{{- /* A Kubernetes quantity (512Mi, 1G, 500m, 1.5, 2e9, or a plain number) in base units (bytes,
       cores), as a float for comparisons: Helm has no quantity type. Input: (dict "q" VALUE
       "where" "the value's path, for the error"). */ -}}
{{- define "agentrun.quantity" -}}
{{- $q := toString .q | trim -}}
{{- $units := dict "Ki" 1024.0 "Mi" 1048576.0 "Gi" 1073741824.0 "Ti" 1099511627776.0 "Pi" 1125899906842624.0 "Ei" 1152921504606846976.0 "n" 0.000000001 "u" 0.000001 "m" 0.001 "" 1.0 "k" 1000.0 "M" 1000000.0 "G" 1000000000.0 "T" 1000000000000.0 "P" 1000000000000000.0 "E" 1000000000000000000.0 -}}
{{- $num := regexFind "^[+]?([0-9]+[.]?[0-9]*|[.][0-9]+)" $q -}}
{{- $suffix := trimPrefix $num $q -}}
{{- $value := 0.0 -}}
{{- if and $num (hasKey $units $suffix) -}}
{{- $value = mulf (float64 (trimPrefix "+" $num)) (get $units $suffix) -}}
{{- else if and $num (regexMatch "^[eE][0-9]+$" $suffix) -}}
{{- $value = float64 (trimPrefix "+" $num) -}}
{{- range until (int (substr 1 -1 $suffix | trimPrefix "e" | trimPrefix "E")) -}}
{{- $value = mulf $value 10.0 -}}
{{- end -}}
{{- else -}}
{{- fail (printf "%s: %q is not a Kubernetes quantity (e.g. 512Mi, 1Gi, 500m, 2)" .where $q) -}}
{{- end -}}
{{- $value -}}
{{- end -}}

{{- /* Fail when a limit is below its request (the API server refuses such a pod, with a message
       about the Deployment's pod template). Input: (dict "resources" R "where" "their values path"
       "what" "the pool or component, for the message"). */ -}}
{{- define "agentrun.checkResources" -}}
{{- $requests := default dict .resources.requests -}}
{{- $limits := default dict .resources.limits -}}
{{- range $name := list "cpu" "memory" "ephemeral-storage" -}}
{{- if and (hasKey $requests $name) (hasKey $limits $name) -}}
{{- $req := index $requests $name -}}
{{- $lim := index $limits $name -}}
{{- $r := include "agentrun.quantity" (dict "q" $req "where" (printf "%s.requests.%s" $.where $name)) | float64 -}}
{{- $l := include "agentrun.quantity" (dict "q" $lim "where" (printf "%s.limits.%s" $.where $name)) | float64 -}}
{{- if lt $l $r -}}
{{- fail (printf "%s.limits.%s (%v) is below %s.requests.%s (%v) for %s, which Kubernetes refuses: raise the limit, or lower the request with it" $.where $name $lim $.where $name $req $.what) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/*
The price table as the worker reads it (docs/worker.md#prices). default: the first model unless
pricing.default names one.
*/}}
{{- define "agentrun.pricesJson" -}}
{{- $p := .Values.pricing -}}
{{- $out := dict "models" $p.models -}}
{{- with $p.default }}{{- $_ := set $out "default" . -}}{{- end -}}
{{- toJson $out -}}
{{- end }}
