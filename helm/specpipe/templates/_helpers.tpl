{{/* Names ------------------------------------------------------------------------------ */}}

{{/* Chart name, short enough to leave room for "-<version>-stage-<k>-<ordinal>". */}}
{{- define "specpipe.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 24 | trimSuffix "-" -}}
{{- end -}}

{{- define "specpipe.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 24 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 24 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 24 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "specpipe.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Workload names; argument: dict "root" $ "model" $m and "stage" k, or "pool" (a
stage pool's name: <release>-<version>-<pool>). */}}
{{- define "specpipe.stageName" -}}
{{- if .pool -}}
{{- printf "%s-%s-%s" (include "specpipe.fullname" .root) .model.version .pool -}}
{{- else -}}
{{- printf "%s-%s-stage-%d" (include "specpipe.fullname" .root) .model.version (int .stage) -}}
{{- end -}}
{{- end -}}

{{- define "specpipe.draftName" -}}
{{- printf "%s-%s-draft" (include "specpipe.fullname" .root) .model.version -}}
{{- end -}}

{{- define "specpipe.routerName" -}}
{{- printf "%s-router" (include "specpipe.fullname" .) -}}
{{- end -}}

{{/* The router's ServiceAccount: router.serviceAccount.name, the chart's own with
rbac.create, else the namespace's default. */}}
{{- define "specpipe.routerServiceAccount" -}}
{{- if .Values.router.serviceAccount.name -}}
{{- .Values.router.serviceAccount.name -}}
{{- else if .Values.rbac.create -}}
{{- include "specpipe.routerName" . -}}
{{- else -}}
default
{{- end -}}
{{- end -}}

{{/* Label selector of the EndpointSlices a router watches: the release's stage and
draft Services of every model version (Kubernetes copies a Service's labels onto its
EndpointSlices). */}}
{{- define "specpipe.discoverySelector" -}}
{{- printf "app.kubernetes.io/name=%s,app.kubernetes.io/instance=%s,app.kubernetes.io/component in (stage,draft)" (include "specpipe.name" .) .Release.Name -}}
{{- end -}}

{{- define "specpipe.modelCacheClaim" -}}
{{- .Values.modelCache.persistentVolumeClaim.existingClaim | default (printf "%s-model-cache" (include "specpipe.fullname" .)) -}}
{{- end -}}

{{/* Labels ----------------------------------------------------------------------------- */}}

{{- define "specpipe.selectorLabels" -}}
app.kubernetes.io/name: {{ include "specpipe.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* Labels that are never part of a selector. */}}
{{- define "specpipe.metaLabels" -}}
helm.sh/chart: {{ include "specpipe.chart" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: specpipe
{{- end -}}

{{- define "specpipe.labels" -}}
{{ include "specpipe.metaLabels" . }}
{{ include "specpipe.selectorLabels" . }}
{{- end -}}

{{/* Selector of one stage workload's pods; argument: dict "root" "model" and "stage"
(its index, without stage pools) or "pool" (the stage pool's name). */}}
{{- define "specpipe.stageSelector" -}}
{{ include "specpipe.selectorLabels" .root }}
app.kubernetes.io/component: stage
specpipe.dev/model-version: {{ .model.version | quote }}
{{- if .pool }}
specpipe.dev/pool: {{ .pool | quote }}
{{- else }}
specpipe.dev/stage: {{ .stage | quote }}
{{- end }}
{{- end -}}

{{- define "specpipe.draftSelector" -}}
{{ include "specpipe.selectorLabels" .root }}
app.kubernetes.io/component: draft
specpipe.dev/model-version: {{ .model.version | quote }}
{{- end -}}

{{- define "specpipe.routerSelector" -}}
{{ include "specpipe.selectorLabels" . }}
app.kubernetes.io/component: router
{{- end -}}

{{/* Pod annotations naming the model version; argument: dict "model" $m. */}}
{{- define "specpipe.modelAnnotations" -}}
specpipe.dev/target-model: {{ .model.target | quote }}
specpipe.dev/target-weight-hash: {{ .model.targetWeightHash | default "" | quote }}
specpipe.dev/draft-model: {{ .model.draft | default "" | quote }}
specpipe.dev/draft-weight-hash: {{ .model.draftWeightHash | default "" | quote }}
{{- end -}}

{{/* Model versions ---------------------------------------------------------------------- */}}

{{/* Every served model version, current first, validated; JSON list. The current
version's stage pools are the top-level `stagePools` (put in its entry here); an earlier
version's are its own entry's `stagePools`. */}}
{{- define "specpipe.models" -}}
{{- if hasKey .Values.model "stagePools" -}}
{{- fail "model.stagePools: the current version's stage pools are the top-level stagePools (previousModels entries keep their own)" -}}
{{- end -}}
{{- $current := deepCopy .Values.model -}}
{{- $_ := set $current "stagePools" (.Values.stagePools | default list) -}}
{{- $models := concat (list $current) (.Values.previousModels | default list) -}}
{{- $seen := dict -}}
{{- range $models -}}
{{- $v := toString .version -}}
{{- if not (regexMatch "^[a-z0-9]([-a-z0-9]{0,18}[a-z0-9])?$" $v) -}}
{{- fail (printf "model version %q must be a DNS label of at most 20 characters (lowercase letters, digits, '-')" $v) -}}
{{- end -}}
{{- if hasKey $seen $v -}}
{{- fail (printf "model version %q is listed twice (model and previousModels must differ)" $v) -}}
{{- end -}}
{{- $_ := set $seen $v true -}}
{{- if not .target -}}
{{- fail (printf "model %q: target is required" $v) -}}
{{- end -}}
{{- end -}}
{{- toJson $models -}}
{{- end -}}

{{/* Decoder layers of a model's target; argument: the model dict. */}}
{{- define "specpipe.numLayers" -}}
{{- $known := dict "qwen2.5-coder-1.5b-instruct" 28 "qwen2.5-coder-0.5b-instruct" 24 "smollm2-135m-instruct" 30 -}}
{{- if .numLayers -}}
{{- int .numLayers -}}
{{- else if hasKey $known (lower (toString .target)) -}}
{{- get $known (lower (toString .target)) -}}
{{- else -}}
{{- fail (printf "model %q: set numLayers (decoder layers of %s); it is only known for %s" (toString .version) (toString .target) (keys $known | sortAlpha | join ", ")) -}}
{{- end -}}
{{- end -}}

{{/*
Layer ranges [[a, b], ...] of a model's stages, as JSON; argument: the model dict.
The even split is `split_layers` of specpipe.common.model.partition: boundary i is
round((i + 1) * L / S) with Python's round-half-to-even, kept at least one layer from
its neighbours.
*/}}
{{- define "specpipe.layerRanges" -}}
{{- $m := . -}}
{{- $L := int (include "specpipe.numLayers" $m) -}}
{{- $S := int $m.stages -}}
{{- if or (lt $S 1) (gt $S $L) -}}
{{- fail (printf "model %q: stages must be in [1, %d], got %d" (toString $m.version) $L $S) -}}
{{- end -}}
{{- $ranges := list -}}
{{- if $m.layers -}}
{{- $end := 0 -}}
{{- range $m.layers -}}
{{- $r := toString . -}}
{{- if not (regexMatch "^[0-9]+:[0-9]+$" $r) -}}
{{- fail (printf "model %q: layer range %q must look like START:END" (toString $m.version) $r) -}}
{{- end -}}
{{- $a := atoi (first (splitList ":" $r)) -}}
{{- $b := atoi (last (splitList ":" $r)) -}}
{{- if ne $a $end -}}
{{- fail (printf "model %q: layer range %s must start at %d (ranges are contiguous from 0)" (toString $m.version) $r $end) -}}
{{- end -}}
{{- if le $b $a -}}
{{- fail (printf "model %q: layer range %s is empty" (toString $m.version) $r) -}}
{{- end -}}
{{- $ranges = append $ranges (list $a $b) -}}
{{- $end = $b -}}
{{- end -}}
{{- if ne $end $L -}}
{{- fail (printf "model %q: layer ranges end at %d, the target has %d layers" (toString $m.version) $end $L) -}}
{{- end -}}
{{- if ne (len $ranges) $S -}}
{{- fail (printf "model %q: layers lists %d ranges, stages is %d" (toString $m.version) (len $ranges) $S) -}}
{{- end -}}
{{- else -}}
{{- $prev := 0 -}}
{{- range $i := until (sub $S 1 | int) -}}
{{- $num := mul (add $i 1) $L -}}
{{- $q := div $num $S -}}
{{- $twice := mul 2 (mod $num $S) -}}
{{- if or (gt $twice $S) (and (eq $twice $S) (eq (mod $q 2) 1)) -}}
{{- $q = add $q 1 -}}
{{- end -}}
{{- $q = max $q (add $prev 1) -}}
{{- $q = min $q (sub $L (sub $S (add $i 1))) -}}
{{- $ranges = append $ranges (list $prev $q) -}}
{{- $prev = $q -}}
{{- end -}}
{{- $ranges = append $ranges (list $prev $L) -}}
{{- end -}}
{{- toJson $ranges -}}
{{- end -}}

{{/*
The stage workloads of one model version, as JSON; argument: dict "root" "model". Each is
{"name", "layers": "A:B", "stage": k or -1, "pool": its name or "", "index": its place in
stagePools or -1, "replicas": the pods a static router lists}. Without stage pools: one
per stage of model.stages / model.layers, with the stage values (replicas from
stage.replicasPerStage or stage.replicas). With stage pools: one per pool; the layer
ranges of the pools must chain from layer 0 to the last (several pools may serve the
same range: the router picks among all their replicas).
*/}}
{{- define "specpipe.stageWorkloads" -}}
{{- $root := .root -}}
{{- $m := .model -}}
{{- $v := toString $m.version -}}
{{- $out := list -}}
{{- if $m.stagePools -}}
{{- if $m.layers -}}
{{- fail (printf "model %q: give the layer ranges in stagePools or in model.layers, not both" $v) -}}
{{- end -}}
{{- $L := int (include "specpipe.numLayers" $m) -}}
{{- $seen := dict -}}
{{- $starts := dict -}}
{{- $ends := dict -}}
{{- range $i, $p := $m.stagePools -}}
{{- $pool := toString ($p.name | default "") -}}
{{- if not (regexMatch "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$" $pool) -}}
{{- fail (printf "model %q: stage pool name %q must be a DNS label (lowercase letters, digits, '-')" $v $pool) -}}
{{- end -}}
{{- if eq $pool "draft" -}}
{{- fail (printf "model %q: a stage pool may not be named \"draft\" (the draft's workload has that name)" $v) -}}
{{- end -}}
{{- if hasKey $seen $pool -}}
{{- fail (printf "model %q: stage pool %q is listed twice" $v $pool) -}}
{{- end -}}
{{- $_ := set $seen $pool true -}}
{{- $name := include "specpipe.stageName" (dict "root" $root "model" $m "pool" $pool) -}}
{{- if gt (len $name) 52 -}}
{{- fail (printf "model %q: stage pool %q makes the workload name %s (%d characters; at most 52, the pods' revision label must fit 63): shorten the pool name, the model version or the release name" $v $pool $name (len $name)) -}}
{{- end -}}
{{- $r := toString ($p.layers | default "") -}}
{{- if not (regexMatch "^[0-9]+:[0-9]+$" $r) -}}
{{- fail (printf "model %q: stage pool %q: layers %q must look like START:END" $v $pool $r) -}}
{{- end -}}
{{- $a := atoi (first (splitList ":" $r)) -}}
{{- $b := atoi (last (splitList ":" $r)) -}}
{{- if or (ge $a $b) (gt $b $L) -}}
{{- fail (printf "model %q: stage pool %q: layers %s must be a non-empty range within the target's %d layers" $v $pool $r $L) -}}
{{- end -}}
{{- $_ := set $starts (toString $a) true -}}
{{- $_ := set $ends (toString $b) true -}}
{{- $values := include "specpipe.poolValues" (dict "root" $root "pool" $p) | fromJson -}}
{{- $svc := $values.svc -}}
{{- $replicas := ternary (int $svc.autoscaling.minReplicas) (int $svc.replicas) (not (not $svc.autoscaling.enabled)) -}}
{{- $out = append $out (dict "name" $name "layers" (printf "%d:%d" $a $b) "stage" -1 "pool" $pool "index" $i "replicas" $replicas) -}}
{{- end -}}
{{- range $w := $out -}}
{{- $a := first (splitList ":" $w.layers) -}}
{{- $b := last (splitList ":" $w.layers) -}}
{{- if and (ne $a "0") (not (hasKey $ends $a)) -}}
{{- fail (printf "model %q: stage pool %q starts at layer %s, where no pool's layers end (the pools' ranges must chain from layer 0 to %d)" $v $w.pool $a $L) -}}
{{- end -}}
{{- if and (ne (int $b) $L) (not (hasKey $starts $b)) -}}
{{- fail (printf "model %q: stage pool %q ends at layer %s, where no pool's layers start (the pools' ranges must chain from layer 0 to %d)" $v $w.pool $b $L) -}}
{{- end -}}
{{- end -}}
{{- else -}}
{{- range $k, $r := include "specpipe.layerRanges" $m | fromJsonArray -}}
{{- $name := include "specpipe.stageName" (dict "root" $root "model" $m "stage" $k) -}}
{{- $replicas := include "specpipe.stageReplicas" (dict "stage" $root.Values.stage "k" $k) | int -}}
{{- $out = append $out (dict "name" $name "layers" (printf "%d:%d" (int (index $r 0)) (int (index $r 1))) "stage" $k "pool" "" "index" -1 "replicas" $replicas) -}}
{{- end -}}
{{- end -}}
{{- toJson $out -}}
{{- end -}}

{{/*
A stage pool's settings, as JSON {"svc": the stage values with the pool's own over
them, "gpu": whether its pods get GPUs}; argument: dict "root" "pool". The pool's
resources, nodeSelector, affinity, tolerations, replicas, device, threads and
maxCacheGiB replace the stage values' (not merged: a pool's resources are all of its
resources); each key of its autoscaling replaces stage.autoscaling's; gpu defaults to
gpu.enabled.
*/}}
{{- define "specpipe.poolValues" -}}
{{- $p := .pool -}}
{{- $stage := .root.Values.stage -}}
{{- $svc := deepCopy $stage -}}
{{- range $key := list "replicas" "resources" "nodeSelector" "affinity" "tolerations" "device" "threads" "maxCacheGiB" -}}
{{- if hasKey $p $key -}}
{{- $_ := set $svc $key (get $p $key) -}}
{{- end -}}
{{- end -}}
{{- range $key, $value := ($p.autoscaling | default dict) -}}
{{- $_ := set $svc.autoscaling $key $value -}}
{{- end -}}
{{- $gpu := .root.Values.gpu.enabled -}}
{{- if and (hasKey $p "gpu") (not (kindIs "invalid" $p.gpu)) -}}
{{- $gpu = $p.gpu -}}
{{- end -}}
{{- toJson (dict "svc" $svc "gpu" $gpu) -}}
{{- end -}}

{{/* float32 without GPUs, bfloat16 with them, unless the model says. */}}
{{- define "specpipe.dtype" -}}
{{- if .model.dtype -}}
{{- .model.dtype -}}
{{- else if .root.Values.gpu.enabled -}}
bfloat16
{{- else -}}
float32
{{- end -}}
{{- end -}}

{{/*
--device of a stage or draft; argument: dict "root" "svc" (values block) "what" (its
name, for messages), and optionally "gpu" (whether the pod gets GPUs; default
gpu.enabled). The service's `device`, or cuda with GPUs and cpu without.
cuda:N must name one of the gpu.count GPUs the pod sees (they are numbered from 0).
*/}}
{{- define "specpipe.device" -}}
{{- $gpu := .root.Values.gpu -}}
{{- $enabled := ternary .gpu $gpu.enabled (hasKey . "gpu") -}}
{{- $device := .svc.device | default "" | toString | lower -}}
{{- if and (not $device) $enabled -}}
{{- $device = "cuda" -}}
{{- else if not $device -}}
{{- $device = "cpu" -}}
{{- end -}}
{{- if not (regexMatch "^(cpu|auto|cuda|cuda:[0-9]+)$" $device) -}}
{{- fail (printf "%s.device %q: choose cpu, cuda, cuda:N or auto" .what $device) -}}
{{- end -}}
{{- if and $enabled (hasPrefix "cuda:" $device) -}}
{{- $n := atoi (trimPrefix "cuda:" $device) -}}
{{- if ge $n (int $gpu.count) -}}
{{- fail (printf "%s.device %q: a pod sees gpu.count=%d GPU(s), cuda:0 to cuda:%d" .what $device (int $gpu.count) (sub (int $gpu.count) 1)) -}}
{{- end -}}
{{- end -}}
{{- $device -}}
{{- end -}}

{{/* Pod parts ---------------------------------------------------------------------------- */}}

{{- define "specpipe.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}

{{/* Environment shared by every container; argument: root. */}}
{{- define "specpipe.env" -}}
- name: SPECPIPE_MODEL_CACHE
  value: {{ .Values.modelCache.mountPath | quote }}
- name: SPECPIPE_LOG_LEVEL
  value: {{ .Values.logLevel | quote }}
- name: HOME
  value: /tmp
- name: PIP_NO_CACHE_DIR
  value: "1"
{{- end -}}

{{/*
A pod's initContainers block, or nothing; argument: dict "root" "names" (list). Models
given as absolute paths, other than .gguf files, are model directories already in a
volume: nothing to pull (`specpipe models pull` takes store names and .gguf files only).
*/}}
{{- define "specpipe.initContainers" -}}
{{- $pull := list -}}
{{- range .names -}}
{{- $n := toString . -}}
{{- if or (not (hasPrefix "/" $n)) (hasSuffix ".gguf" (lower $n)) -}}
{{- $pull = append $pull $n -}}
{{- end -}}
{{- end -}}
{{- if $pull -}}
initContainers:
  {{- include "specpipe.pullInit" (dict "root" .root "names" $pull) | nindent 2 }}
{{- end -}}
{{- end -}}

{{/* The init container that pulls models; argument: dict "root" "names" (list). */}}
{{- define "specpipe.pullInit" -}}
- name: pull-models
  image: {{ include "specpipe.image" .root }}
  imagePullPolicy: {{ .root.Values.image.pullPolicy }}
  args:
    - models
    - pull
    {{- range .names }}
    - {{ . | quote }}
    {{- end }}
  env:
    {{- include "specpipe.env" .root | nindent 4 }}
    {{- with .root.Values.modelPull.env }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  resources:
    {{- toYaml .root.Values.modelPull.resources | nindent 4 }}
  securityContext:
    {{- toYaml .root.Values.containerSecurityContext | nindent 4 }}
  volumeMounts:
    {{- include "specpipe.volumeMounts" .root | nindent 4 }}
{{- end -}}

{{- define "specpipe.volumeMounts" -}}
- name: model-cache
  mountPath: {{ .Values.modelCache.mountPath }}
- name: tmp
  mountPath: /tmp
{{- end -}}

{{/* Volumes; argument: dict "root" "shm" (size or ""). */}}
{{- define "specpipe.volumes" -}}
- name: model-cache
{{- if .root.Values.modelCache.persistentVolumeClaim.enabled }}
  persistentVolumeClaim:
    claimName: {{ include "specpipe.modelCacheClaim" .root }}
{{- else }}
  emptyDir:
    {{- with .root.Values.modelCache.emptyDir.sizeLimit }}
    sizeLimit: {{ . }}
    {{- end }}
{{- end }}
- name: tmp
  emptyDir: {}
{{- if .shm }}
- name: shm
  emptyDir:
    medium: Memory
    sizeLimit: {{ .shm }}
{{- end }}
{{- end -}}

{{/* Security (docs/architecture.md, "9. Security") --------------------------------------- */}}

{{/* The Secret with the deployment's ca.crt, tls.crt, tls.key (and data.key). */}}
{{- define "specpipe.tlsSecret" -}}
{{- .Values.security.tls.existingSecret | default (printf "%s-internal-tls" (include "specpipe.fullname" .)) -}}
{{- end -}}

{{/* Every service's security arguments (the services want --secure or an explicit
--insecure); argument: root. */}}
{{- define "specpipe.secureArgs" -}}
{{- if .Values.security.enabled }}
- --secure
- --tls-dir
- /etc/specpipe/tls
- --tls-server-name
- {{ .Values.security.serverName | quote }}
- --health-port
- {{ .Values.ports.health | int | toString | quote }}
{{- else }}
- --insecure
{{- end }}
{{- end -}}

{{/* The Secret of the router's API keys: router.apiKeys.existingSecret, or the one the
chart makes with router.apiKeys.generate; "" when API keys are off. */}}
{{- define "specpipe.apiKeySecret" -}}
{{- $keys := .Values.router.apiKeys | default dict -}}
{{- if $keys.existingSecret -}}
{{- $keys.existingSecret -}}
{{- else if $keys.generate -}}
{{- printf "%s-api-keys" (include "specpipe.fullname" .) -}}
{{- end -}}
{{- end -}}

{{/* Stages and draft: the lease of a request's state (security.leaseSeconds). */}}
{{- define "specpipe.leaseArgs" -}}
{{- with .Values.security.leaseSeconds }}
- --lease-seconds
- {{ . | toString | quote }}
{{- end }}
{{- end -}}

{{- define "specpipe.tlsMount" -}}
{{- if .Values.security.enabled }}
- name: internal-tls
  mountPath: /etc/specpipe/tls
  readOnly: true
{{- end }}
{{- end -}}

{{- define "specpipe.tlsVolume" -}}
{{- if .Values.security.enabled }}
- name: internal-tls
  secret:
    secretName: {{ include "specpipe.tlsSecret" . }}
    defaultMode: 0440
{{- end }}
{{- end -}}

{{/* The port gRPC probes use: the plaintext health port with security.enabled (the
kubelet's gRPC probes speak no TLS), else the service's own; argument: dict "root" "port". */}}
{{- define "specpipe.probePort" -}}
{{- if .root.Values.security.enabled -}}
{{- .root.Values.ports.health -}}
{{- else -}}
{{- .port -}}
{{- end -}}
{{- end -}}

{{/* Resources, plus the GPU when `gpu` is true; argument: dict "root" "resources" "gpu". */}}
{{- define "specpipe.resources" -}}
{{- $res := deepCopy (.resources | default dict) -}}
{{- if .gpu -}}
{{- $g := .root.Values.gpu -}}
{{- $limits := deepCopy (get $res "limits" | default dict) -}}
{{- $requests := deepCopy (get $res "requests" | default dict) -}}
{{- $_ := set $limits $g.resourceName (int $g.count) -}}
{{- $_ := set $requests $g.resourceName (int $g.count) -}}
{{- $_ := set $res "limits" $limits -}}
{{- $_ := set $res "requests" $requests -}}
{{- end -}}
{{- toYaml $res -}}
{{- end -}}

{{/* Scheduling and pod-level settings; argument: dict "root" "svc" (values block) "gpu",
and optionally "serviceAccount" (the pod then gets its token: the router's discovery). */}}
{{- define "specpipe.podSpecCommon" -}}
{{- $root := .root -}}
{{- if .serviceAccount -}}
serviceAccountName: {{ .serviceAccount }}
automountServiceAccountToken: true
{{- else -}}
automountServiceAccountToken: false
{{- end }}
enableServiceLinks: false
{{- with $root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
securityContext:
  {{- toYaml $root.Values.podSecurityContext | nindent 2 }}
terminationGracePeriodSeconds: {{ include "specpipe.terminationGrace" .svc }}
{{- if and .gpu $root.Values.gpu.runtimeClassName }}
runtimeClassName: {{ $root.Values.gpu.runtimeClassName }}
{{- end }}
{{- $nodeSelector := deepCopy (.svc.nodeSelector | default dict) -}}
{{- if .gpu }}
{{- $nodeSelector = merge $nodeSelector (deepCopy ($root.Values.gpu.nodeSelector | default dict)) -}}
{{- end }}
{{- with $nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- $tolerations := .svc.tolerations | default list -}}
{{- if .gpu }}
{{- $tolerations = concat $tolerations ($root.Values.gpu.tolerations | default list) | uniq -}}
{{- end }}
{{- with $tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .svc.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/*
Stopping a pod; argument: the service's values block. Kubernetes removes the pod from
Service endpoints and runs preStop at the same time; the sleep keeps the pod serving
normally while that reaches every node and load balancer (preStopSeconds). Then SIGTERM:
the service drains by itself (--drain-seconds: health NOT_SERVING, new requests refused
UNAVAILABLE, open ones finish for up to drainSeconds, then it exits 0). The grace period
counts from the start of preStop, so it must cover both plus the service's stop (closing
its server and data plane; 15 s of margin) before the kubelet sends SIGKILL:
  terminationGracePeriodSeconds = preStopSeconds + drainSeconds + 15
*/}}
{{- define "specpipe.terminationGrace" -}}
{{- add (int .preStopSeconds) (int .drainSeconds) 15 -}}
{{- end -}}

{{/* The preStop sleep (callers skip it when preStopSeconds is 0). */}}
{{- define "specpipe.lifecycle" -}}
lifecycle:
  preStop:
    exec:
      command: ["sleep", {{ .preStopSeconds | int | toString | quote }}]
{{- end -}}

{{/* gRPC probes on the service's health port; argument: dict "port" "startupSeconds" "live" ("grpc"|"tcp"), and optionally "httpReady" (a container port name: readiness is GET /health there instead) and "https" (it serves TLS). */}}
{{- define "specpipe.probes" -}}
startupProbe:
  {{- if eq .live "tcp" }}
  tcpSocket:
    port: grpc
  {{- else }}
  grpc:
    port: {{ .port }}
  {{- end }}
  periodSeconds: 5
  timeoutSeconds: 5
  failureThreshold: {{ div (int .startupSeconds) 5 | max 1 }}
readinessProbe:
  {{- if .httpReady }}
  httpGet:
    path: /health
    port: {{ .httpReady }}
    {{- if .https }}
    scheme: HTTPS
    {{- end }}
  {{- else }}
  grpc:
    port: {{ .port }}
  {{- end }}
  periodSeconds: 5
  timeoutSeconds: 5
  failureThreshold: 2
livenessProbe:
  {{- if eq .live "tcp" }}
  tcpSocket:
    port: grpc
  {{- else }}
  grpc:
    port: {{ .port }}
  {{- end }}
  periodSeconds: 20
  timeoutSeconds: 10
  failureThreshold: 6
{{- end -}}

{{/* PodDisruptionBudget; argument: dict "root" "name" "component" "selector" (YAML) "pdb". */}}
{{- define "specpipe.pdb" -}}
{{- if .pdb.enabled }}
---
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ .name }}
  labels:
    {{- include "specpipe.labels" .root | nindent 4 }}
    app.kubernetes.io/component: {{ .component }}
spec:
  {{- if hasKey .pdb "maxUnavailable" }}
  maxUnavailable: {{ .pdb.maxUnavailable }}
  {{- else }}
  minAvailable: {{ .pdb.minAvailable }}
  {{- end }}
  selector:
    matchLabels:
      {{- .selector | nindent 6 }}
{{- end }}
{{- end -}}

{{/* Metrics of a service: its --metrics-port argument, container port and the
prometheus.io annotations; argument: root. */}}
{{- define "specpipe.metricsArgs" -}}
{{- if .Values.metrics.enabled -}}
- --metrics-port
- {{ .Values.ports.metrics | int | toString | quote }}
{{- end -}}
{{- end -}}

{{- define "specpipe.metricsPort" -}}
{{- if .Values.metrics.enabled -}}
- name: metrics
  containerPort: {{ .Values.ports.metrics }}
{{- end -}}
{{- end -}}

{{- define "specpipe.metricsAnnotations" -}}
{{- if .Values.metrics.enabled -}}
prometheus.io/scrape: "true"
prometheus.io/port: {{ .Values.ports.metrics | quote }}
prometheus.io/path: /metrics
{{- end -}}
{{- end -}}

{{/*
Autoscaling of one workload; argument: dict "root" "name" "kind" "component" "hpa" and
"podPattern" (a regex of its pods' names). An autoscaling/v2 HPA on the values'
metrics, or with keda.enabled a KEDA ScaledObject whose Prometheus trigger sums the
component's serving metric over its pods.
*/}}
{{- define "specpipe.hpa" -}}
{{- if and .hpa.enabled .root.Values.keda.enabled }}
{{- $k := .root.Values.keda -}}
{{- $sel := printf "namespace=\"%s\",pod=~\"%s\"" .root.Release.Namespace .podPattern -}}
{{- $query := "" -}}
{{- if eq .component "router" -}}
{{- $query = printf "sum(specpipe:num_requests_running{%s}) + sum(specpipe:num_requests_waiting{%s})" $sel $sel -}}
{{- else -}}
{{- $query = printf "sum(specpipe:%s_busy_ratio{%s})" .component $sel -}}
{{- end }}
---
apiVersion: keda.sh/v1alpha1
kind: ScaledObject
metadata:
  name: {{ .name }}
  labels:
    {{- include "specpipe.labels" .root | nindent 4 }}
    app.kubernetes.io/component: {{ .component }}
spec:
  scaleTargetRef:
    apiVersion: apps/v1
    kind: {{ .kind }}
    name: {{ .name }}
  minReplicaCount: {{ .hpa.minReplicas }}
  maxReplicaCount: {{ .hpa.maxReplicas }}
  pollingInterval: {{ $k.pollingInterval }}
  cooldownPeriod: {{ $k.cooldownPeriod }}
  triggers:
    - type: prometheus
      metadata:
        serverAddress: {{ $k.serverAddress | quote }}
        query: {{ $query | quote }}
        threshold: {{ get $k.thresholds .component | toString | quote }}
{{- else if .hpa.enabled }}
---
apiVersion: autoscaling/v2
kind: HorizontalPodAutoscaler
metadata:
  name: {{ .name }}
  labels:
    {{- include "specpipe.labels" .root | nindent 4 }}
    app.kubernetes.io/component: {{ .component }}
spec:
  scaleTargetRef:
    apiVersion: apps/v1
    kind: {{ .kind }}
    name: {{ .name }}
  minReplicas: {{ .hpa.minReplicas }}
  maxReplicas: {{ .hpa.maxReplicas }}
  metrics:
    {{- toYaml .hpa.metrics | nindent 4 }}
  behavior:
    # Model pods start slowly (model pull and load): scale down carefully.
    scaleDown:
      stabilizationWindowSeconds: 600
      policies:
        - type: Pods
          value: 1
          periodSeconds: 300
{{- end }}
{{- end -}}

{{/* Replicas of stage k: the HPA's minimum when autoscaled, else replicasPerStage[k]
or replicas; argument: dict "stage" (values block) "k". */}}
{{- define "specpipe.stageReplicas" -}}
{{- $s := .stage -}}
{{- if $s.autoscaling.enabled -}}
{{- $s.autoscaling.minReplicas | int -}}
{{- else if lt (int .k) (len ($s.replicasPerStage | default list)) -}}
{{- index $s.replicasPerStage (int .k) | int -}}
{{- else -}}
{{- $s.replicas | int -}}
{{- end -}}
{{- end -}}

{{/* "true" when the router tunes a tree setting ("auto"): the stages and the draft then
measure their cost curves at start (--measure-costs) for it to price steps with. */}}
{{- define "specpipe.measureCosts" -}}
{{- $t := .Values.router.treeDefaults | default dict -}}
{{- if or (eq (toString $t.width) "auto") (eq (toString $t.layersPerStep) "auto") (eq (toString $t.tokenSource) "auto") -}}true{{- end -}}
{{- end -}}

{{/* "true" when the stages measure their cost curves at start (--measure-costs):
stage.measureCosts, or when it is null, whenever the router tunes a tree setting
("auto") or the model version has stage pools (node kinds of different speeds: the
router prefers the faster replica by its published curve); argument: dict "root"
"model". */}}
{{- define "specpipe.stageMeasureCosts" -}}
{{- $v := .root.Values.stage.measureCosts -}}
{{- if kindIs "invalid" $v -}}
{{- if or (include "specpipe.measureCosts" .root) .model.stagePools -}}true{{- end -}}
{{- else if $v -}}true{{- end -}}
{{- end -}}

{{/* The router's defaults for requests' tree settings and its late-draft wait. */}}
{{- define "specpipe.treeArgs" -}}
{{- $r := .Values.router -}}
{{- $t := $r.treeDefaults | default dict -}}
{{- range $flag, $key := dict "--width" "width" "--layers-per-step" "layersPerStep" "--token-source" "tokenSource" }}
{{- $v := index $t $key -}}
{{- if and $v (ne (toString $v) "") }}
- {{ $flag }}
- {{ $v | toString | quote }}
{{- end }}
{{- end }}
{{- if $r.lateDraftWaitMs }}
- --late-draft-wait-ms
- {{ $r.lateDraftWaitMs | toString | quote }}
{{- end }}
{{- end -}}
