{{/* Names ------------------------------------------------------------------------------------------------ */}}
{{- define "pdserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "pdserve.fullname" -}}
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

{{/* "<fullname>-<component>"; call with (list $ "router") */}}
{{- define "pdserve.componentName" -}}
{{- $root := index . 0 -}}
{{- printf "%s-%s" (include "pdserve.fullname" $root | trunc 50 | trimSuffix "-") (index . 1) -}}
{{- end -}}

{{- define "pdserve.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Labels; call with (list $ "router") */}}
{{- define "pdserve.selectorLabels" -}}
{{- $root := index . 0 -}}
app.kubernetes.io/name: {{ include "pdserve.name" $root }}
app.kubernetes.io/instance: {{ $root.Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end -}}

{{- define "pdserve.labels" -}}
{{- $root := index . 0 -}}
helm.sh/chart: {{ include "pdserve.chart" $root }}
{{ include "pdserve.selectorLabels" . }}
app.kubernetes.io/version: {{ $root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ $root.Release.Service }}
app.kubernetes.io/part-of: pdserve
{{- end -}}

{{- define "pdserve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "pdserve.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "pdserve.image" -}}
{{- $tag := .Values.image.tag | default .Values.image.flavor -}}
{{- printf "%s:%s" .Values.image.repository $tag -}}
{{- end -}}

{{- define "pdserve.tokenSecretName" -}}
{{- .Values.clusterToken.existingSecret | default (printf "%s-cluster-token" (include "pdserve.fullname" .)) -}}
{{- end -}}

{{/* true when the decode pods are a LeaderWorkerSet */}}
{{- define "pdserve.decodeUsesLWS" -}}
{{- $w := .Values.decode.workload -}}
{{- if eq $w "LeaderWorkerSet" -}}true
{{- else if and (eq $w "auto") (.Capabilities.APIVersions.Has "leaderworkerset.x-k8s.io/v1/LeaderWorkerSet") -}}true
{{- end -}}
{{- end -}}

{{/* "grpc" or "exec" */}}
{{- define "pdserve.probeMode" -}}
{{- if eq .Values.probes.mode "auto" -}}
{{- if .Values.tls.enabled -}}exec{{- else -}}grpc{{- end -}}
{{- else -}}
{{- .Values.probes.mode -}}
{{- end -}}
{{- end -}}

{{/* Probe handler; call with (list $ port) */}}
{{- define "pdserve.probeHandler" -}}
{{- $root := index . 0 -}}
{{- $port := index . 1 -}}
{{- if eq (include "pdserve.probeMode" $root) "exec" -}}
exec:
  command: ["pdserve-healthcheck", "--port", {{ $port | quote }}]
{{- else -}}
grpc:
  port: {{ $port }}
{{- end -}}
{{- end -}}

{{/* The three probes of a serving container; call with (list $ port) */}}
{{- define "pdserve.probes" -}}
{{- $root := index . 0 -}}
{{- $p := $root.Values.probes -}}
startupProbe:
  {{- include "pdserve.probeHandler" . | nindent 2 }}
  periodSeconds: {{ $p.startup.periodSeconds }}
  failureThreshold: {{ $p.startup.failureThreshold }}
  timeoutSeconds: {{ $p.startup.timeoutSeconds }}
readinessProbe:
  {{- include "pdserve.probeHandler" . | nindent 2 }}
  periodSeconds: {{ $p.readiness.periodSeconds }}
  failureThreshold: {{ $p.readiness.failureThreshold }}
  timeoutSeconds: {{ $p.readiness.timeoutSeconds }}
livenessProbe:
  {{- include "pdserve.probeHandler" . | nindent 2 }}
  periodSeconds: {{ $p.liveness.periodSeconds }}
  failureThreshold: {{ $p.liveness.failureThreshold }}
  timeoutSeconds: {{ $p.liveness.timeoutSeconds }}
{{- end -}}

{{/* Environment shared by every container */}}
{{- define "pdserve.env" -}}
- name: PDSERVE_CONFIG
  value: /etc/pdserve/config/pdserve.yaml
- name: PDSERVE_CLUSTER_TOKEN_FILE
  value: /etc/pdserve/token/{{ .Values.clusterToken.key }}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: POD_IP
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
{{- if .Values.tls.enabled }}
- name: PDSERVE_TLS_CERT_FILE
  value: /etc/pdserve/tls/tls.crt
- name: PDSERVE_TLS_KEY_FILE
  value: /etc/pdserve/tls/tls.key
- name: PDSERVE_TLS_CA_FILE
  value: /etc/pdserve/tls/ca.crt
- name: PDSERVE_TLS_SERVER_NAME
  value: {{ .Values.tls.serverName | default "localhost" | quote }}
- name: PDSERVE_TLS_REQUIRE_CLIENT_CERT
  value: {{ ternary "true" "false" (.Values.tls.requireClientCert | default false) | quote }}
{{- end }}
{{- end -}}

{{- define "pdserve.volumeMounts" -}}
- name: config
  mountPath: /etc/pdserve/config
  readOnly: true
- name: cluster-token
  mountPath: /etc/pdserve/token
  readOnly: true
- name: run
  mountPath: /tmp
{{- if .Values.tls.enabled }}
- name: tls
  mountPath: /etc/pdserve/tls
  readOnly: true
{{- end }}
{{- if .Values.model.volume }}
- name: models
  mountPath: {{ .Values.model.mountPath }}
  readOnly: true
{{- end }}
{{- end -}}

{{/* Pod volumes; call with (list $ shmSize) (shmSize "" for none) */}}
{{- define "pdserve.volumes" -}}
{{- $root := index . 0 -}}
{{- $shm := index . 1 -}}
- name: config
  configMap:
    name: {{ include "pdserve.fullname" $root }}-config
- name: cluster-token
  secret:
    secretName: {{ include "pdserve.tokenSecretName" $root }}
    defaultMode: 0440
- name: run
  emptyDir: {}
{{- if $shm }}
- name: dshm
  emptyDir:
    medium: Memory
    sizeLimit: {{ $shm }}
{{- end }}
{{- if $root.Values.tls.enabled }}
- name: tls
  secret:
    secretName: {{ $root.Values.tls.secretName }}
    defaultMode: 0440
{{- end }}
{{- with $root.Values.model.volume }}
- name: models
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* Resources with the GPU count added when gpu.enabled; call with (list $ resources gpus) */}}
{{- define "pdserve.resources" -}}
{{- $root := index . 0 -}}
{{- $res := deepCopy (index . 1 | default dict) -}}
{{- $gpus := index . 2 -}}
{{- if and $root.Values.gpu.enabled (gt (int $gpus) 0) -}}
{{- $limits := $res.limits | default dict -}}
{{- $_ := set $limits $root.Values.gpu.resourceName $gpus -}}
{{- $_ := set $res "limits" $limits -}}
{{- $requests := $res.requests | default dict -}}
{{- $_ := set $requests $root.Values.gpu.resourceName $gpus -}}
{{- $_ := set $res "requests" $requests -}}
{{- end -}}
{{- toYaml $res -}}
{{- end -}}

{{/* Pod template of one role; call with (dict "root" $ "role" "prefill" "values" .Values.prefill "gpus" N) */}}
{{- define "pdserve.podTemplate" -}}
{{- $root := .root -}}
{{- $v := .values -}}
metadata:
  labels:
    {{- include "pdserve.labels" (list $root .role) | nindent 4 }}
  annotations:
    checksum/config: {{ include (print $root.Template.BasePath "/configmap.yaml") $root | sha256sum }}
    {{- with $v.podAnnotations }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
spec:
  serviceAccountName: {{ include "pdserve.serviceAccountName" $root }}
  automountServiceAccountToken: false
  enableServiceLinks: false
  terminationGracePeriodSeconds: {{ $v.terminationGracePeriodSeconds }}
  {{- with $root.Values.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  securityContext:
    {{- toYaml $root.Values.podSecurityContext | nindent 4 }}
  containers:
    - name: {{ .role }}
      image: {{ include "pdserve.image" $root | quote }}
      imagePullPolicy: {{ $root.Values.image.pullPolicy }}
      args: [{{ .role | quote }}]
      env:
        {{- include "pdserve.env" $root | nindent 8 }}
        {{- if ne .role "router" }}
        - name: PDSERVE_ARG_ADVERTISE_HOST
          value: "$(POD_IP)"
        - name: PDSERVE_ARG_POD_ID
          value: "$(POD_NAME)"
        {{- end }}
      ports:
        - name: grpc
          containerPort: {{ $v.port }}
          protocol: TCP
        {{- if $root.Values.metrics.enabled }}
        - name: metrics
          containerPort: {{ $root.Values.metrics.port }}
          protocol: TCP
        {{- end }}
      {{- include "pdserve.probes" (list $root $v.port) | nindent 6 }}
      resources:
        {{- include "pdserve.resources" (list $root $v.resources .gpus) | nindent 8 }}
      securityContext:
        {{- toYaml $root.Values.securityContext | nindent 8 }}
      volumeMounts:
        {{- include "pdserve.volumeMounts" $root | nindent 8 }}
        {{- if $v.shmSize }}
        - name: dshm
          mountPath: /dev/shm
        {{- end }}
  volumes:
    {{- include "pdserve.volumes" (list $root ($v.shmSize | default "")) | nindent 4 }}
  {{- with $v.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $v.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $v.affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end -}}
