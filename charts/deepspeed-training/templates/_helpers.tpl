{{/* Chart name, truncated to the 63 characters a DNS label allows. */}}
{{- define "deepspeed-training.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Fully qualified app name, cut to 45 characters: the worker StatefulSet adds "-worker", and Kubernetes
keeps StatefulSet names to 52 (its pods get a controller-revision-hash label of name + 11 characters).
*/}}
{{- define "deepspeed-training.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 45 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 45 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 45 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "deepspeed-training.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Common labels; chart and version never go into selectors. */}}
{{- define "deepspeed-training.labels" -}}
helm.sh/chart: {{ include "deepspeed-training.chart" . }}
{{ include "deepspeed-training.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "deepspeed-training.selectorLabels" -}}
app.kubernetes.io/name: {{ include "deepspeed-training.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "deepspeed-training.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "deepspeed-training.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "deepspeed-training.launcherName" -}}
{{- printf "%s-launcher-%d" (include "deepspeed-training.fullname" .) (int .Release.Revision) }}
{{- end }}

{{- define "deepspeed-training.workerName" -}}
{{- printf "%s-worker" (include "deepspeed-training.fullname" .) }}
{{- end }}

{{/* DNS suffix shared by every worker: "<service>.<namespace>.svc.<clusterDomain>". */}}
{{- define "deepspeed-training.workerDomain" -}}
{{- printf "%s.%s.svc.%s" (include "deepspeed-training.workerName" .) .Release.Namespace .Values.clusterDomain }}
{{- end }}

{{/* Host name of worker <index>: the headless Service gives each StatefulSet pod this record. */}}
{{- define "deepspeed-training.workerHost" -}}
{{- printf "%s-%d.%s" (include "deepspeed-training.workerName" .root) (int .index) (include "deepspeed-training.workerDomain" .root) }}
{{- end }}

{{- define "deepspeed-training.sshSecretName" -}}
{{- default (printf "%s-ssh" (include "deepspeed-training.fullname" .)) .Values.ssh.existingSecret }}
{{- end }}

{{- define "deepspeed-training.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* Where the ConfigMaps and the Secret are mounted; files/*.sh read these paths. */}}
{{- define "deepspeed-training.configDir" -}}/etc/deepspeed/config{{- end }}
{{- define "deepspeed-training.scriptsDir" -}}/etc/deepspeed/scripts{{- end }}
{{- define "deepspeed-training.keysDir" -}}/etc/deepspeed/ssh-keys{{- end }}

{{/*
Rank env with plain values. DeepSpeed's pdsh runner pastes each one into the remote shell as
`export NAME="VALUE";`, so characters that shell would interpret are refused here, at render time.
*/}}
{{- define "deepspeed-training.deepspeedEnv" -}}
{{- range $i, $e := .Values.env }}
{{- if hasKey $e "value" }}
{{- if regexMatch "[$`\"\\\\\n\r]" $e.value }}
{{- fail (printf "env[%d] (%s): value %q contains a character the remote shell would interpret ($ ` \" \\ or a newline); DeepSpeed pastes it into `export %s=\"...\"` on every worker. Use valueFrom (a Secret or ConfigMap) for such values." $i $e.name $e.value $e.name) }}
{{- end }}
{{ $e.name }}={{ $e.value }}
{{- end }}
{{- end }}
{{- end }}

{{/* Checksum of the ConfigMaps the pods mount, so a changed ds_config or script rolls them. The Secret is
left out (`helm template` generates new keys each time); rotating ssh.existingSecret needs a restart. */}}
{{- define "deepspeed-training.configChecksum" -}}
{{- $config := include (print $.Template.BasePath "/configmap.yaml") . | fromYaml }}
{{- $scripts := include (print $.Template.BasePath "/configmap-scripts.yaml") . | fromYaml }}
{{- printf "%s%s" (toJson $config.data) (toJson $scripts.data) | sha256sum }}
{{- end }}

{{/* Pod-level fields shared by worker and launcher; `.component` is "worker" or "launcher". */}}
{{- define "deepspeed-training.podSchedulingFields" -}}
{{- $values := index .root.Values .component }}
{{- $global := .root.Values.global }}
{{- with .root.Values.image.pullSecrets }}
imagePullSecrets:
{{- range . }}
  - name: {{ . }}
{{- end }}
{{- end }}
{{- with (.root.Values.scheduling.schedulerName | default (ternary "volcano" "" .root.Values.scheduling.volcano.enabled)) }}
schedulerName: {{ . }}
{{- end }}
{{- with ($values.priorityClassName | default $global.priorityClassName) }}
priorityClassName: {{ . }}
{{- end }}
{{- with ($values.nodeSelector | default $global.nodeSelector) }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with ($values.tolerations | default $global.tolerations) }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with ($values.affinity | default $global.affinity) }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .root.Values.podSecurityContext }}
securityContext:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* Labels and annotations that put a pod into the gang-scheduling group, when one is on. */}}
{{- define "deepspeed-training.gangLabels" -}}
{{- with .Values.scheduling.kueueQueueName }}
kueue.x-k8s.io/queue-name: {{ . }}
{{- end }}
{{- end }}
{{- define "deepspeed-training.gangAnnotations" -}}
{{- if .Values.scheduling.volcano.enabled }}
scheduling.k8s.io/group-name: {{ include "deepspeed-training.fullname" . }}
{{- end }}
{{- end }}

{{/* Volumes every pod mounts: config, scripts, SSH keys, home and /tmp. */}}
{{- define "deepspeed-training.commonVolumes" -}}
- name: config
  configMap:
    name: {{ include "deepspeed-training.fullname" . }}-config
- name: scripts
  configMap:
    name: {{ include "deepspeed-training.fullname" . }}-scripts
    defaultMode: 0555
- name: ssh-keys
  secret:
    secretName: {{ include "deepspeed-training.sshSecretName" . }}
    defaultMode: 0440
- name: home
  emptyDir: {}
- name: tmp
  emptyDir: {}
{{- end }}

{{- define "deepspeed-training.commonVolumeMounts" -}}
- name: config
  mountPath: {{ include "deepspeed-training.configDir" . }}
  readOnly: true
- name: scripts
  mountPath: {{ include "deepspeed-training.scriptsDir" . }}
  readOnly: true
- name: ssh-keys
  mountPath: {{ include "deepspeed-training.keysDir" . }}
  readOnly: true
- name: home
  mountPath: {{ .Values.image.homeDir }}
- name: tmp
  mountPath: /tmp
{{- end }}

{{/* Env both containers get: where things are, for files/*.sh. */}}
{{- define "deepspeed-training.commonEnv" -}}
- name: HOME
  value: {{ .Values.image.homeDir | quote }}
- name: DS_CONFIG_DIR
  value: {{ include "deepspeed-training.configDir" . | quote }}
- name: DS_SSH_KEYS_DIR
  value: {{ include "deepspeed-training.keysDir" . | quote }}
- name: DS_WORKER_DOMAIN
  value: {{ include "deepspeed-training.workerDomain" . | quote }}
- name: DS_SSH_PORT
  value: {{ .Values.ssh.port | quote }}
{{- end }}
