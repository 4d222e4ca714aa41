{{/*
Names, as `helm create` charts make them: DNS labels, at most 63 characters, no trailing "-".
*/}}
{{- define "baton.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "baton.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/*
The name of one component's objects: the full name cut so that "-<component>" fits in 63.
Called with (dict "ctx" $ "component" "prefill").
*/}}
{{- define "baton.componentName" -}}
{{- $full := include "baton.fullname" .ctx }}
{{- $room := int (sub 62 (len .component)) }}
{{- printf "%s-%s" ($full | trunc $room | trimSuffix "-") .component }}
{{- end }}

{{- define "baton.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "baton.selectorLabels" -}}
app.kubernetes.io/name: {{ include "baton.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "baton.labels" -}}
helm.sh/chart: {{ include "baton.chart" . }}
{{ include "baton.selectorLabels" . }}
{{- if .Chart.AppVersion }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- end }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: baton
{{- end }}

{{/* (dict "ctx" $ "component" "decode") */}}
{{- define "baton.componentSelectorLabels" -}}
{{ include "baton.selectorLabels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "baton.componentLabels" -}}
{{ include "baton.labels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "baton.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "baton.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "baton.tokenSecretName" -}}
{{- if .Values.internalToken.existingSecret }}
{{- .Values.internalToken.existingSecret }}
{{- else }}
{{- include "baton.componentName" (dict "ctx" . "component" "internal-token") }}
{{- end }}
{{- end }}

{{/* "true" when the router runs (always in disaggregated mode), else "". */}}
{{- define "baton.routerEnabled" -}}
{{- if or (eq .Values.mode "disaggregated") .Values.router.enabled }}true{{ end }}
{{- end }}

{{/* The engine tiers of the mode, space-separated. */}}
{{- define "baton.engineTiers" -}}
{{- if eq .Values.mode "colocated" }}colocated{{ else }}prefill decode{{ end }}
{{- end }}

{{/* "true" when the encoder tier (E/P/D) runs: encoder.replicas above 0, or its autoscaling on. */}}
{{- define "baton.encoderEnabled" -}}
{{- $e := .Values.encoder | default dict }}
{{- if or (gt (int ($e.replicas | default 0)) 0) (and $e.autoscaling $e.autoscaling.enabled) }}true{{ end }}
{{- end }}

{{/* The tiers that run, space-separated: the router (where it runs), the engine tiers of the
mode, the encoder tier (where it runs). */}}
{{- define "baton.runningTiers" -}}
{{- $tiers := splitList " " (include "baton.engineTiers" .) }}
{{- if include "baton.routerEnabled" . }}{{ $tiers = prepend $tiers "router" }}{{ end }}
{{- if include "baton.encoderEnabled" . }}{{ $tiers = append $tiers "encoder" }}{{ end }}
{{- join " " $tiers }}
{{- end }}

{{/* The component the public Service selects. */}}
{{- define "baton.publicComponent" -}}
{{- if include "baton.routerEnabled" . }}router{{ else }}colocated{{ end }}
{{- end }}

{{- define "baton.image" -}}
{{- $img := mergeOverwrite (deepCopy .ctx.Values.image) (deepCopy (.override | default dict)) }}
{{- printf "%s:%s" $img.repository (toString (default .ctx.Chart.AppVersion $img.tag)) }}
{{- end }}

{{- define "baton.imagePullPolicy" -}}
{{- $img := mergeOverwrite (deepCopy .ctx.Values.image) (deepCopy (.override | default dict)) }}
{{- $img.pullPolicy }}
{{- end }}

{{/*
A tier's engine settings: `engine` overridden by <tier>.engine, key by key, as JSON.
*/}}
{{- define "baton.engineJson" -}}
{{- $tier := index .ctx.Values .tier }}
{{- mergeOverwrite (deepCopy .ctx.Values.engine) (deepCopy ($tier.engine | default dict)) | toJson }}
{{- end }}

{{/* The checkpoint directory the engines load, e.g. /models or /models/smollm2. */}}
{{- define "baton.modelPath" -}}
{{- $dir := trimAll "/" (toString (.model | default "")) }}
{{- if $dir }}/models/{{ $dir }}{{ else }}/models{{ end }}
{{- end }}

{{/*
One probe. (dict "p" <probe values> "port" <grpc port> "tls" <bool>). A grpc probe becomes a
tcpSocket probe with TLS on: Kubernetes' gRPC probes cannot speak TLS.
*/}}
{{- define "baton.probe" -}}
{{- $type := .p.type | default "grpc" }}
{{- if and (eq $type "grpc") .tls }}
{{- /* Kubernetes' gRPC probes cannot speak TLS: the health check, over TLS, from inside. */}}
exec:
  command:
    - baton
    - health
    - --target=127.0.0.1:{{ .port }}
    {{- with .p.service }}
    - --service={{ . }}
    {{- end }}
    {{- include "baton.tlsArgs" (dict "ctx" .ctx "serving" false) | trim | nindent 4 }}
{{- else if eq $type "grpc" }}
grpc:
  port: {{ .port }}
  {{- with .p.service }}
  service: {{ . }}
  {{- end }}
{{- else }}
tcpSocket:
  port: {{ .port }}
{{- end }}
{{- with .p.initialDelaySeconds }}
initialDelaySeconds: {{ int . }}
{{- end }}
periodSeconds: {{ int (.p.periodSeconds | default 10) }}
timeoutSeconds: {{ int (.p.timeoutSeconds | default 5) }}
failureThreshold: {{ int (.p.failureThreshold | default 3) }}
{{- end }}

{{/*
The model sources that are set (their first field is not empty), space-separated, in the order
pvc, hostPath, image, initImage; baton.validate requires exactly one.
*/}}
{{- define "baton.modelSources" -}}
{{- $m := .Values.model }}
{{- $ids := dict "pvc" "claimName" "hostPath" "path" "image" "reference" "initImage" "image" }}
{{- $set := list }}
{{- range $key := list "pvc" "hostPath" "image" "initImage" }}
{{- $source := index $m $key }}
{{- if and $source (index $source (index $ids $key)) }}{{ $set = append $set $key }}{{ end }}
{{- end }}
{{- join " " $set }}
{{- end }}

{{- define "baton.modelSource" -}}
{{- first (splitList " " (include "baton.modelSources" .)) }}
{{- end }}

{{/* The model volume (validated by baton.validate). */}}
{{- define "baton.modelVolume" -}}
{{- $source := include "baton.modelSource" . }}
{{- $m := .Values.model }}
- name: model
{{- if eq $source "pvc" }}
  persistentVolumeClaim:
    claimName: {{ $m.pvc.claimName }}
    readOnly: true
{{- else if eq $source "hostPath" }}
  hostPath:
    path: {{ $m.hostPath.path }}
    type: {{ $m.hostPath.type | default "Directory" }}
{{- else if eq $source "image" }}
  image:
    reference: {{ $m.image.reference }}
    pullPolicy: {{ $m.image.pullPolicy | default "IfNotPresent" }}
{{- else if eq $source "initImage" }}
  emptyDir:
    {{- with $m.initImage.sizeLimit }}
    sizeLimit: {{ . }}
    {{- else }} {}
    {{- end }}
{{- end }}
{{- end }}

{{- define "baton.modelMount" -}}
- name: model
  mountPath: /models
  readOnly: true
{{- if eq (include "baton.modelSource" .) "pvc" }}
{{- with .Values.model.pvc.subPath }}
  subPath: {{ . }}
{{- end }}
{{- end }}
{{- end }}

{{/* The init container that copies model.initImage's model into the emptyDir. */}}
{{- define "baton.modelInitContainer" -}}
{{- $i := .Values.model.initImage }}
- name: copy-model
  image: {{ $i.image }}
  imagePullPolicy: {{ $i.pullPolicy | default "IfNotPresent" }}
  {{- if $i.command }}
  command:
    {{- toYaml $i.command | nindent 4 }}
  {{- else }}
  command: ["cp", "-a", {{ printf "%s/." (trimSuffix "/" ($i.sourcePath | default "/models")) | quote }}, "/model-copy/"]
  {{- end }}
  securityContext:
    {{- toYaml .Values.securityContext | nindent 4 }}
  {{- with $i.resources }}
  resources:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  volumeMounts:
    # Not at /models: that would hide the image's own /models.
    - name: model
      mountPath: /model-copy
{{- end }}

{{/* TLS flags of the servers (serving=true) or of a client (the test hook). */}}
{{- define "baton.tlsArgs" -}}
{{- $t := .ctx.Values.tls }}
{{- if $t.enabled }}
{{- if or .serving $t.mtls }}
- --tls-cert-file=/etc/baton/tls/tls.crt
- --tls-key-file=/etc/baton/tls/tls.key
{{- end }}
{{- if $t.mtls }}
- --tls-ca-file=/etc/baton/tls/ca.crt
{{- end }}
- --tls-server-name={{ $t.serverName }}
{{- end }}
{{- end }}

{{/* Env every Baton container gets (dict "ctx" $ "component" "decode" "engine" bool). */}}
{{- define "baton.env" -}}
{{- $v := .ctx.Values }}
{{- if and $v.tls.enabled (not $v.tls.mtls) $v.tls.trustSecretCA }}
# Without mTLS no --tls-ca-file is passed: gRPC verifies peers against this CA instead.
- name: GRPC_DEFAULT_SSL_ROOTS_FILE_PATH
  value: /etc/baton/tls/ca.crt
{{- end }}
{{- if ne .component "test" }}
- name: POD_IP
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: POD_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
- name: NODE_NAME
  valueFrom:
    fieldRef:
      fieldPath: spec.nodeName
- name: BATON_INTERNAL_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "baton.tokenSecretName" .ctx }}
      key: {{ $v.internalToken.key }}
{{- with $v.tracing }}
{{- if .otlpEndpoint }}
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ .otlpEndpoint | quote }}
{{- with .sampler }}
- name: OTEL_TRACES_SAMPLER
  value: {{ . | quote }}
{{- end }}
{{- if ne (toString .samplerArg) "" }}
- name: OTEL_TRACES_SAMPLER_ARG
  value: {{ toString .samplerArg | quote }}
{{- end }}
{{- with .serviceName }}
- name: OTEL_SERVICE_NAME
  value: {{ . | quote }}
{{- end }}
- name: OTEL_RESOURCE_ATTRIBUTES
  value: {{ printf "k8s.pod.name=$(POD_NAME),k8s.namespace.name=$(POD_NAMESPACE),k8s.node.name=$(NODE_NAME),k8s.deployment.name=%s" (include "baton.componentName" (dict "ctx" $.ctx "component" $.component)) | quote }}
{{- end }}
{{- end }}
{{- end }}
{{- if .engine }}
{{- with $v.ucx.tls }}
- name: UCX_TLS
  value: {{ . | quote }}
{{- end }}
{{- with $v.ucx.netDevices }}
- name: UCX_NET_DEVICES
  value: {{ . | quote }}
{{- end }}
{{- with $v.ucx.tcpPortRange }}
- name: UCX_TCP_PORT_RANGE
  value: {{ . | quote }}
{{- end }}
{{- end }}
{{- end }}
