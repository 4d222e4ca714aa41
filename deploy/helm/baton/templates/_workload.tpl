{{/*
A Baton server's Deployment and, for an engine tier, its headless Service (the router resolves
its name to every ready pod; the ServiceMonitor scrapes through it).
(dict "ctx" $ "component" "decode" "args" (list ...) "engine" true "http" false "frames" true)
Optional: "metrics" false (no metrics port: the encoder tier), "shm" false (no /dev/shm volume;
default: .engine).
*/}}
{{- define "baton.workload" -}}
{{- $ctx := .ctx }}
{{- $v := $ctx.Values }}
{{- $component := .component }}
{{- $t := index $v $component }}
{{- $name := include "baton.componentName" (dict "ctx" $ctx "component" $component) }}
{{- $sel := dict "ctx" $ctx "component" $component }}
{{- $probes := mergeOverwrite (deepCopy $v.probes) (deepCopy ($t.probes | default dict)) }}
{{- $grpcPort := int $v.ports.grpc }}
{{- $rdma := and .engine $v.ucx.rdma.enabled }}
{{- $metrics := ternary .metrics true (hasKey . "metrics") }}
{{- $shm := ternary .shm .engine (hasKey . "shm") }}
{{- /* Resources: the tier's, GPUs (any <vendor>/gpu) counted per rank on engines of more than one
rank, plus the RDMA devices on engines with ucx.rdma.enabled. */}}
{{- $resources := deepCopy ($t.resources | default dict) }}
{{- $ranks := 1 }}{{ if .engine }}{{ $ranks = int (include "baton.tensorParallelSize" $t) }}{{ end }}
{{- if gt $ranks 1 }}
{{- range $kind := list "limits" "requests" }}
{{- $listed := index $resources $kind | default dict }}
{{- range $res, $n := $listed }}
{{- if hasSuffix "/gpu" $res }}{{ $_ := set $listed $res (mul (int $n) $ranks) }}{{ end }}
{{- end }}
{{- end }}
{{- end }}
{{- if $rdma }}
{{- $limits := $resources.limits | default dict }}
{{- $requests := $resources.requests | default dict }}
{{- range $res, $n := $v.ucx.rdma.resources }}
{{- $_ := set $limits $res $n }}
{{- $_ := set $requests $res $n }}
{{- end }}
{{- $_ := set $resources "limits" $limits }}
{{- $_ := set $resources "requests" $requests }}
{{- end }}
{{- $securityContext := deepCopy $v.securityContext }}
{{- if $rdma }}
{{- $caps := $securityContext.capabilities | default dict }}
{{- $_ := set $caps "add" (append ($caps.add | default list) "IPC_LOCK" | uniq) }}
{{- $_ := set $securityContext "capabilities" $caps }}
{{- end }}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ $name }}
  labels:
    {{- include "baton.componentLabels" $sel | nindent 4 }}
spec:
  {{- if not $t.autoscaling.enabled }}
  replicas: {{ int $t.replicas }}
  {{- end }}
  selector:
    matchLabels:
      {{- include "baton.componentSelectorLabels" $sel | nindent 6 }}
  template:
    metadata:
      labels:
        {{- include "baton.componentLabels" $sel | nindent 8 }}
        {{- with $t.podLabels }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- if or $t.podAnnotations (and $metrics $v.metrics.podAnnotations) }}
      annotations:
        {{- if and $metrics $v.metrics.podAnnotations }}
        prometheus.io/scrape: "true"
        prometheus.io/port: {{ $v.metrics.port | int | quote }}
        prometheus.io/path: /metrics
        {{- end }}
        {{- with $t.podAnnotations }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- end }}
    spec:
      serviceAccountName: {{ include "baton.serviceAccountName" $ctx }}
      automountServiceAccountToken: false
      {{- with $v.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $t.priorityClassName }}
      priorityClassName: {{ . }}
      {{- end }}
      terminationGracePeriodSeconds: {{ add (int (ceil $v.gracePeriodSeconds)) 15 }}
      securityContext:
        {{- toYaml $v.podSecurityContext | nindent 8 }}
      {{- if eq (include "baton.modelSource" $ctx) "initImage" }}
      initContainers:
        {{- include "baton.modelInitContainer" $ctx | trim | nindent 8 }}
      {{- end }}
      containers:
        - name: baton
          image: {{ include "baton.image" (dict "ctx" $ctx "override" $t.image) | quote }}
          imagePullPolicy: {{ include "baton.imagePullPolicy" (dict "ctx" $ctx "override" $t.image) }}
          args:
            {{- toYaml .args | nindent 12 }}
            {{- with include "baton.tlsArgs" (dict "ctx" $ctx "serving" true) | trim }}
{{ . | indent 12 }}
{{- end }}
          ports:
            - name: grpc
              containerPort: {{ $grpcPort }}
              protocol: TCP
            {{- if .http }}
            - name: http
              containerPort: {{ int $v.ports.http }}
              protocol: TCP
            {{- end }}
            {{- if .frames }}
            - name: frames
              containerPort: {{ int $v.ports.frames }}
              protocol: TCP
            {{- end }}
            {{- if $metrics }}
            - name: metrics
              containerPort: {{ int $v.metrics.port }}
              protocol: TCP
            {{- end }}
          env:
            {{- include "baton.env" (dict "ctx" $ctx "component" $component "engine" .engine) | trim | nindent 12 }}
            {{- with $t.extraEnv }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          startupProbe:
            {{- include "baton.probe" (dict "p" $probes.startup "port" $grpcPort "tls" $v.tls.enabled "ctx" $ctx) | trim | nindent 12 }}
          readinessProbe:
            {{- include "baton.probe" (dict "p" $probes.readiness "port" $grpcPort "tls" $v.tls.enabled "ctx" $ctx) | trim | nindent 12 }}
          livenessProbe:
            {{- include "baton.probe" (dict "p" $probes.liveness "port" $grpcPort "tls" $v.tls.enabled "ctx" $ctx) | trim | nindent 12 }}
          {{- with $resources }}
          resources:
            {{- toYaml . | nindent 12 }}
          {{- end }}
          securityContext:
            {{- toYaml $securityContext | nindent 12 }}
          volumeMounts:
            {{- include "baton.modelMount" $ctx | trim | nindent 12 }}
            - name: tmp
              mountPath: /tmp
            - name: cache
              mountPath: /home/baton/.cache
            {{- if $shm }}
            - name: shm
              mountPath: /dev/shm
            {{- end }}
            {{- if $v.tls.enabled }}
            - name: tls
              mountPath: /etc/baton/tls
              readOnly: true
            {{- end }}
            {{- with $t.extraVolumeMounts }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
      volumes:
        {{- include "baton.modelVolume" $ctx | trim | nindent 8 }}
        - name: tmp
          emptyDir: {}
        - name: cache
          emptyDir: {}
        {{- if $shm }}
        - name: shm
          emptyDir:
            medium: Memory
            {{- with $t.shmSizeLimit }}
            sizeLimit: {{ . }}
            {{- end }}
        {{- end }}
        {{- if $v.tls.enabled }}
        - name: tls
          secret:
            secretName: {{ $v.tls.secretName }}
            defaultMode: 288  # 0440
        {{- end }}
        {{- with $t.extraVolumes }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- with $t.nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $t.affinity }}
      affinity:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $t.tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $t.topologySpreadConstraints }}
      topologySpreadConstraints:
        {{- toYaml . | nindent 8 }}
      {{- end }}
{{- if .engine }}
---
apiVersion: v1
kind: Service
metadata:
  name: {{ $name }}
  labels:
    {{- include "baton.componentLabels" $sel | nindent 4 }}
    {{- if $metrics }}
    baton.io/metrics: "true"
    {{- end }}
spec:
  clusterIP: None
  publishNotReadyAddresses: false
  selector:
    {{- include "baton.componentSelectorLabels" $sel | nindent 4 }}
  ports:
    - name: grpc
      port: {{ $grpcPort }}
      targetPort: grpc
      protocol: TCP
    {{- if $metrics }}
    - name: metrics
      port: {{ int $v.metrics.port }}
      targetPort: metrics
      protocol: TCP
    {{- end }}
{{- end }}
{{- end }}

{{/* `baton serve` flags of an engine tier: (dict "ctx" $ "tier" "prefill" "role" "prefill"). */}}
{{- define "baton.engineArgs" -}}
{{- $v := .ctx.Values }}
{{- $e := include "baton.engineJson" (dict "ctx" .ctx "tier" .tier) | fromJson }}
{{- $args := list "serve" (printf "--role=%s" .role) "--host=0.0.0.0" (printf "--port=%d" (int $v.ports.grpc)) (printf "--frames-port=%d" (int $v.ports.frames)) "--advertise-host=$(POD_IP)" (printf "--metrics-port=%d" (int $v.metrics.port)) }}
{{- if eq .role "both" }}{{ $args = append $args (printf "--http-port=%d" (int $v.ports.http)) }}{{ end }}
{{- $args = append $args (printf "--model=%s" (include "baton.modelPath" $e)) }}
{{- with $v.model.servedModelName }}{{ $args = append $args (printf "--served-model-name=%s" .) }}{{ end }}
{{- with $e.dtype }}{{ $args = append $args (printf "--dtype=%s" .) }}{{ end }}
{{- with $e.device }}{{ $args = append $args (printf "--device=%s" .) }}{{ end }}
{{- range $key, $flag := dict "maxModelLen" "max-model-len" "blockSize" "block-size" "kvCacheMemoryBytes" "kv-cache-memory-bytes" "numKvBlocks" "num-kv-blocks" "maxNumSeqs" "max-num-seqs" "maxNumBatchedTokens" "max-num-batched-tokens" "maxLoras" "max-loras" "maxLoraRank" "max-lora-rank" }}
{{- if ne (toString (index $e $key | default "")) "" }}{{ $args = append $args (printf "--%s=%d" $flag (int64 (index $e $key))) }}{{ end }}
{{- end }}
{{- if ne (toString ($e.gpuMemoryUtilization | default "")) "" }}{{ $args = append $args (printf "--gpu-memory-utilization=%v" $e.gpuMemoryUtilization) }}{{ end }}
{{- if ne (toString ($e.streamInterval | default "")) "" }}{{ $args = append $args (printf "--stream-interval=%d" (int64 $e.streamInterval)) }}{{ end }}
{{- if ne (toString ($e.kvHoldTimeout | default "")) "" }}{{ $args = append $args (printf "--kv-hold-timeout=%v" $e.kvHoldTimeout) }}{{ end }}
{{- with $e.loraModules }}
{{- $args = append $args "--lora-modules" }}
{{- range $name := keys . | sortAlpha }}{{ $args = append $args (printf "%s=/models/%s" $name (trimAll "/" (index $e.loraModules $name))) }}{{ end }}
{{- end }}
{{- if ne (toString ($e.kvOffloadingSize | default "")) "" }}{{ $args = append $args (printf "--kv-offloading-size=%v" $e.kvOffloadingSize) }}{{ end }}
{{- with $e.preemptionMode }}{{ $args = append $args (printf "--preemption-mode=%s" .) }}{{ end }}
{{- with $e.kvCacheDtype }}{{ $args = append $args (printf "--kv-cache-dtype=%s" .) }}{{ end }}
{{- if $e.calculateKvScales }}{{ $args = append $args "--calculate-kv-scales" }}{{ end }}
{{- with $e.speculativeConfig }}
{{- $spec := deepCopy . }}
{{- with $spec.model }}{{ $_ := set $spec "model" (printf "/models/%s" (trimAll "/" (toString .))) }}{{ end }}
{{- $args = append $args (printf "--speculative-config=%s" (toJson $spec)) }}
{{- end }}
{{- with $e.acceptKvFrom }}
{{- $args = append $args "--accept-kv-from" }}
{{- range . }}{{ $args = append $args (ternary (toString .) (printf "/models/%s" (trimAll "/" (toString .))) (regexMatch "^[0-9a-f]{32}$" (toString .))) }}{{ end }}
{{- end }}
{{- $ranks := int (include "baton.tensorParallelSize" (index $v .tier)) }}
{{- if gt $ranks 1 }}{{ $args = append $args (printf "--tensor-parallel-size=%d" $ranks) }}{{ end }}
{{- $args = append $args (printf "--grace-period=%v" $v.gracePeriodSeconds) }}
{{- range $e.extraArgs }}{{ $args = append $args (toString .) }}{{ end }}
{{- toJson $args }}
{{- end }}

{{/* An engine tier's tensorParallelSize (1 when unset): its engines' ranks, one GPU each. */}}
{{- define "baton.tensorParallelSize" -}}
{{- if kindIs "invalid" .tensorParallelSize }}1{{ else }}{{ int64 .tensorParallelSize }}{{ end }}
{{- end }}
