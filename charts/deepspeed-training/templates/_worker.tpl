{{/*
The worker pod template (metadata and spec), one definition for both launch modes: the StatefulSet's pods (ssh:
sshd, the launcher starts the ranks) and the Indexed Job's pods (nossh: each runs DeepSpeed's launcher for its
own node rank). In ssh mode it carries the placeholder `workerTemplateHash` replaces: the launcher starts only
once every worker reports the hash of the current template (podruntime/sshmode.py, the launcher's meeting).
*/}}
{{- define "deepspeed-training.workerPodTemplate" -}}
{{- $nossh := eq .Values.launchMode "nossh" -}}
metadata:
  labels:
    {{- include "deepspeed-training.labels" . | nindent 4 }}
    app.kubernetes.io/component: worker
    {{- with include "deepspeed-training.gangLabels" . }}{{ . | nindent 4 }}{{- end }}
    {{- with .Values.worker.podLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  annotations:
    checksum/config: {{ include "deepspeed-training.configChecksum" . | quote }}
    {{- with include "deepspeed-training.securityRelaxations" . | trim }}
    deepspeed-training/security-relaxations: {{ splitList "\n" . | join "; " | quote }}
    {{- end }}
    {{- with include "deepspeed-training.gangAnnotations" (dict "root" . "component" "worker") }}{{ . | nindent 4 }}{{- end }}
    {{- with .Values.worker.podAnnotations }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
spec:
  {{- if $nossh }}
  # A failed run is retried inside the pods (job.runRetries), then by a new pod (backoffLimit).
  restartPolicy: Never
  # With the headless Service: "<pod>.<service>" records for the hostfile and --master_addr.
  subdomain: {{ include "deepspeed-training.workerName" . | quote }}
  {{- end }}
  serviceAccountName: {{ include "deepspeed-training.serviceAccountName" . | quote }}
  automountServiceAccountToken: false
  enableServiceLinks: false
  terminationGracePeriodSeconds: {{ .Values.worker.terminationGracePeriodSeconds | int }}
  {{- include "deepspeed-training.podSpecFields" (dict "root" . "component" "worker") | trim | nindent 2 }}
  {{- with .Values.worker.topologySpreadConstraints }}
  topologySpreadConstraints:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with include "deepspeed-training.progressSidecar" (dict "root" . "component" "worker") }}{{ . | nindent 2 }}{{- end }}
  containers:
    - name: worker
      image: {{ include "deepspeed-training.image" . | quote }}
      imagePullPolicy: {{ .Values.image.pullPolicy | quote }}
      # A failed pod says why in `kubectl get pod` / `describe`: the end of its log (what failed, a hang's report).
      terminationMessagePolicy: FallbackToLogsOnError
      {{- if $nossh }}
      command: [{{ include "deepspeed-training.podProgram" (dict "root" . "program" "nossh-worker") }}]
      args:
        {{- range include "deepspeed-training.launchCommand" . | fromJsonArray }}
        - {{ . | quote }}
        {{- end }}
      {{- else }}
      command: [{{ include "deepspeed-training.podProgram" (dict "root" . "program" "ssh-worker") }}]
      {{- end }}
      workingDir: {{ .Values.image.homeDir | quote }}
      ports:
        {{- if not $nossh }}
        - name: ssh
          containerPort: {{ .Values.ssh.port | int }}
          protocol: TCP
        {{- end }}
        - name: rendezvous
          containerPort: {{ .Values.deepspeed.masterPort | int }}
          protocol: TCP
        - name: channel
          containerPort: {{ include "deepspeed-training.channelPort" . | int }}
          protocol: TCP
        {{- if include "deepspeed-training.peerCopy" . }}
        - name: peer-copy
          containerPort: {{ include "deepspeed-training.peerCopyPort" . | int }}
          protocol: TCP
        {{- end }}
      env:
        {{- include "deepspeed-training.commonEnv" . | nindent 8 }}
        {{- with include "deepspeed-training.ownerEnv" . }}{{ . | nindent 8 }}{{- end }}
        {{- if $nossh }}
        {{- include "deepspeed-training.launcherEnv" . | nindent 8 }}
        {{- else }}
        - name: DS_WORKER_TEMPLATE
          value: {{ include "deepspeed-training.workerTemplatePlaceholder" . | quote }}
        {{- end }}
        {{- range .Values.env }}
        {{- if hasKey . "valueFrom" }}
        - name: {{ .name | quote }}
          valueFrom:
            {{- toYaml .valueFrom | nindent 12 }}
        {{- else if $nossh }}
        {{- /* ssh mode: plain values reach the ranks through .deepspeed_env instead. */}}
        - name: {{ .name | quote }}
          value: {{ .value | quote }}
        {{- end }}
        {{- end }}
        {{- with .Values.worker.extraEnv }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- with .Values.worker.extraEnvFrom }}
      envFrom:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- if not $nossh }}
      # Probes read the kernel's socket table instead of connecting: sshd logs every connection.
      readinessProbe:
        exec:
          command: ["bash", "{{ include "deepspeed-training.scriptsDir" . }}/sshd-listening.sh"]
        periodSeconds: 5
        failureThreshold: 3
      # Generous: restarting a worker kills its ranks; only a dead sshd should trigger it.
      livenessProbe:
        exec:
          command: ["bash", "{{ include "deepspeed-training.scriptsDir" . }}/sshd-listening.sh"]
        initialDelaySeconds: 30
        periodSeconds: 20
        timeoutSeconds: 5
        failureThreshold: 6
      {{- end }}
      resources:
        {{- $resources := deepCopy (.Values.worker.resources | default dict) }}
        {{- with .Values.worker.gpuResourceName }}
        {{- $limits := $resources.limits | default dict }}
        {{- $_ := set $limits . $.Values.worker.gpusPerWorker }}
        {{- $_ := set $resources "limits" $limits }}
        {{- end }}
        {{- toYaml $resources | nindent 8 }}
      {{- with .Values.securityContext }}
      securityContext:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      volumeMounts:
        {{- include "deepspeed-training.commonVolumeMounts" . | nindent 8 }}
        - name: dshm
          mountPath: /dev/shm
        {{- include "deepspeed-training.checkpointVolumeMounts" . | nindent 8 }}
        {{- if .Values.data.existingClaim }}
        - name: data
          mountPath: {{ .Values.data.mountPath | quote }}
          readOnly: true
        {{- end }}
        {{- with .Values.worker.extraVolumeMounts }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
  volumes:
    {{- include "deepspeed-training.commonVolumes" . | nindent 4 }}
    - name: dshm
      emptyDir:
        medium: Memory
        sizeLimit: {{ .Values.worker.shmSize | quote }}
    {{- with .Values.data.existingClaim }}
    - name: data
      persistentVolumeClaim:
        claimName: {{ . | quote }}
        readOnly: true
    {{- end }}
    {{- with include "deepspeed-training.checkpointVolumes" . }}{{ . | nindent 4 }}{{- end }}
    {{- with include "deepspeed-training.progressTokenVolume" . }}{{ . | nindent 4 }}{{- end }}
    {{- with include "deepspeed-training.objectStoreVolumes" . }}{{ . | nindent 4 }}{{- end }}
    {{- with .Values.worker.extraVolumes }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
{{- end }}

{{- define "deepspeed-training.workerTemplatePlaceholder" -}}@@worker-template@@{{- end }}

{{/* Identifies the worker pod template of this render (ssh mode): its text, before the hash goes in. */}}
{{- define "deepspeed-training.workerTemplateHash" -}}
{{- include "deepspeed-training.workerPodTemplate" . | sha256sum | trunc 16 }}
{{- end }}
