{{/*
Checks values.schema.json cannot express; each failure names the values involved.
*/}}
{{- define "baton.validate" -}}
{{- $v := .Values }}
{{- if not (has $v.mode (list "disaggregated" "colocated")) }}
{{- fail (printf "mode: %q is not one of disaggregated, colocated" (toString $v.mode)) }}
{{- end }}
{{- /* Exactly one model source. */}}
{{- $sources := splitList " " (include "baton.modelSources" .) | compact }}
{{- if ne (len $sources) 1 }}
{{- $named := list }}{{ range $sources }}{{ $named = append $named (printf "model.%s" .) }}{{ end }}
{{- fail (printf "model: set exactly one of model.pvc, model.hostPath, model.image, model.initImage (set: %s); model.pvc is the default, empty model.pvc.claimName to use another source" (default "none" (join ", " $named))) }}
{{- end }}
{{- /* The router. */}}
{{- if and (eq $v.mode "disaggregated") (not $v.router.enabled) }}
{{- fail "router.enabled: false needs mode: colocated (in disaggregated mode the router joins prefill and decode)" }}
{{- end }}
{{- /* The encoder tier: the router sends images through it. */}}
{{- $encoderReplicas := (($v.encoder | default dict).replicas | default 0) }}
{{- if lt (int $encoderReplicas) 0 }}
{{- fail (printf "encoder.replicas: must be 0 (no encoder tier) or more (got %v)" $encoderReplicas) }}
{{- end }}
{{- if and (include "baton.encoderEnabled" .) (not (include "baton.routerEnabled" .)) }}
{{- fail "encoder.replicas: an encoder tier needs the router (router.enabled: true), which sends chats' images through it" }}
{{- end }}
{{- /* Replicas of the tiers that run. */}}
{{- $tiers := splitList " " (include "baton.runningTiers" .) }}
{{- range $tier := $tiers }}
{{- $t := index $v $tier }}
{{- if and $t.autoscaling $t.autoscaling.enabled }}
{{- if lt (int $t.autoscaling.minReplicas) 1 }}
{{- fail (printf "%s.autoscaling.minReplicas: must be at least 1 for the %s tier (got %v)" $tier $tier $t.autoscaling.minReplicas) }}
{{- end }}
{{- if gt (int $t.autoscaling.minReplicas) (int $t.autoscaling.maxReplicas) }}
{{- fail (printf "%s.autoscaling.minReplicas (%v) is above %s.autoscaling.maxReplicas (%v)" $tier $t.autoscaling.minReplicas $tier $t.autoscaling.maxReplicas) }}
{{- end }}
{{- else if lt (int $t.replicas) 1 }}
{{- fail (printf "%s.replicas: must be at least 1 for the %s tier in mode %s (got %v)" $tier $tier $v.mode $t.replicas) }}
{{- end }}
{{- end }}
{{- /* Tensor parallel sizes: at least one rank; prefill and decode pass KV between their ranks
only when one size divides the other. */}}
{{- range $tier := splitList " " (include "baton.engineTiers" .) }}
{{- if lt (int (include "baton.tensorParallelSize" (index $v $tier))) 1 }}
{{- fail (printf "%s.tensorParallelSize: must be at least 1 (got %v)" $tier (index $v $tier).tensorParallelSize) }}
{{- end }}
{{- end }}
{{- if eq $v.mode "disaggregated" }}
{{- $ptp := int (include "baton.tensorParallelSize" $v.prefill) }}
{{- $dtp := int (include "baton.tensorParallelSize" $v.decode) }}
{{- if mod (max $ptp $dtp) (min $ptp $dtp) }}
{{- fail (printf "prefill.tensorParallelSize (%d) and decode.tensorParallelSize (%d): KV blocks move from prefill to decode ranks only when one size divides the other (e.g. 1 and 2, 2 and 4)" $ptp $dtp) }}
{{- end }}
{{- end }}
{{- /* prefill and decode exchange KV blocks: same model, dtype and block size. */}}
{{- if eq $v.mode "disaggregated" }}
{{- $p := include "baton.engineJson" (dict "ctx" . "tier" "prefill") | fromJson }}
{{- $d := include "baton.engineJson" (dict "ctx" . "tier" "decode") | fromJson }}
{{- range $key := list "model" "dtype" "blockSize" }}
{{- $pv := toString (index $p $key | default "") }}
{{- $dv := toString (index $d $key | default "") }}
{{- $accepts := list }}
{{- range concat ($p.acceptKvFrom | default list) ($d.acceptKvFrom | default list) }}{{ $accepts = append $accepts (trimAll "/" (toString .)) }}{{ end }}
{{- $accepted := and (eq $key "model") (or (has (trimAll "/" $pv) $accepts) (has (trimAll "/" $dv) $accepts)) }}
{{- if and (ne $pv $dv) (not $accepted) }}
{{- fail (printf "prefill.engine.%s (%q) and decode.engine.%s (%q) must agree: decodes load the KV blocks prefills computed (set engine.%s once, or both the same; two quantizations of one model: name the other in acceptKvFrom)" $key $pv $key $dv $key) }}
{{- end }}
{{- end }}
{{- /* A draft model's or head's KV goes with the prompt's: the same one on both tiers. */}}
{{- $ps := $p.speculativeConfig | default dict }}
{{- $ds := $d.speculativeConfig | default dict }}
{{- $heads := list "draft_model" "eagle" "eagle3" "mtp" }}
{{- if or (has (toString ($ps.method | default "")) $heads) (has (toString ($ds.method | default "")) $heads) }}
{{- range $key := list "method" "model" }}
{{- $pv := toString (index $ps $key | default "") }}
{{- $dv := toString (index $ds $key | default "") }}
{{- if ne $pv $dv }}
{{- fail (printf "prefill.engine.speculativeConfig.%s (%q) and decode.engine.speculativeConfig.%s (%q) must agree: a draft model's, EAGLE head's or MTP layer's KV goes from prefill to decode with the prompt's (set engine.speculativeConfig once)" $key $pv $key $dv) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- /* TLS. */}}
{{- if $v.tls.enabled }}
{{- if not $v.tls.secretName }}
{{- fail "tls.secretName: required with tls.enabled (a kubernetes.io/tls Secret: tls.crt, tls.key, ca.crt)" }}
{{- end }}
{{- if not $v.tls.serverName }}
{{- fail "tls.serverName: required with tls.enabled (a DNS name in the certificate; peers are called by pod IP)" }}
{{- end }}
{{- end }}
{{- with $v.ucx.tcpPortRange }}
{{- $range := splitList "-" . }}
{{- if or (ne (len $range) 2) (lt (int (index $range 0)) 1) (gt (int (index $range 1)) 65535) (gt (int (index $range 0)) (int (index $range 1))) }}
{{- fail (printf "ucx.tcpPortRange: %q is not FIRST-LAST with 1 <= FIRST <= LAST <= 65535" .) }}
{{- end }}
{{- end }}
{{- if and $v.serviceMonitor.enabled $v.podMonitor.enabled }}
{{- fail "serviceMonitor.enabled and podMonitor.enabled: choose one (both would scrape every pod twice)" }}
{{- end }}
{{- end }}
