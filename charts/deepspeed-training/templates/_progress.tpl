{{/*
The progress sidecar (podruntime/sidecar.py), in every pod of the release when progress.enabled: a native sidecar (an
init container that keeps running), so that a Job's pod still ends with its main container. It runs no program
code, in the platform's image (progress.image), and it is the only container that holds a token: the release's own
ServiceAccount's, from a projected volume of its own (every pod keeps automountServiceAccountToken false, and the
main containers run the tenant's image). With it the sidecar of node rank 0 writes rank 0's progress into the
progress ConfigMap, the ledger's owner's (ssh: the launcher; nossh: worker 0) writes the job's record, and in the
launcher pod of launchMode ssh it scales the workers to 0 after a successful run (launcher.scaleDownWorkers).
Called with (dict "root" $ "component" "worker"|"launcher").
*/}}
{{- define "deepspeed-training.progressName" -}}
{{- printf "%s-progress" (include "deepspeed-training.fullname" .) }}
{{- end }}

{{/* "true" when the sidecar holds the release's token and patches the ConfigMap: only with the release's own
ServiceAccount (serviceAccount.create), since the chart binds its Roles to no other account (rbacSubject). */}}
{{- define "deepspeed-training.progressPublishes" -}}
{{- if and .Values.progress.enabled .Values.serviceAccount.create }}true{{- end }}
{{- end }}

{{/* The most samples one pod's sidecar serves: podruntime/sidecar.py's sample_bound (a fixed part for rank 0's
progress, the goodput and fault splits, the job's record, the uploads and the peer copy, and so many per rank of the
pod), generated into files/generated/protocol.json. */}}
{{- define "deepspeed-training.metricsSampleLimit" -}}
{{- $samples := (include "deepspeed-training.podstate" . | fromJson).metricSamples }}
{{- add (int $samples.fixed) (mul (int $samples.perRank) (int .Values.worker.gpusPerWorker)) }}
{{- end }}

{{/* "true" when the launcher pod's sidecar scales the workers down after success (checked in _validate.tpl). */}}
{{- define "deepspeed-training.scalesDownWorkers" -}}
{{- if and (eq .Values.launchMode "ssh") .Values.launcher.scaleDownWorkers }}true{{- end }}
{{- end }}

{{- define "deepspeed-training.progressSidecar" -}}
{{- $root := .root }}
{{- with $root.Values.progress }}
{{- if .enabled }}
initContainers:
  {{- if $root.Values.checkpoints.objectStore.bucket }}
  {{- include "deepspeed-training.objectStoreRestore" $ | nindent 2 }}
  {{- end }}
  - name: progress
    image: {{ .image | default (include "deepspeed-training.image" $root) | quote }}
    imagePullPolicy: {{ $root.Values.image.pullPolicy | quote }}
    restartPolicy: Always
    # -I: no PYTHONPATH, PYTHONSTARTUP or user site-packages reach the process that holds the token.
    {{- $nossh := eq $root.Values.launchMode "nossh" }}
    command: [{{ include "deepspeed-training.podProgram" (dict "root" $root "program" "sidecar") }},
              {{- if include "deepspeed-training.progressPublishes" $root }}
              "--configmap", {{ include "deepspeed-training.progressName" $root | quote }},
              {{- end }}
              {{- /* Node rank 0 holds rank 0; the ledger is the launcher's (ssh) or worker 0's (nossh). */}}
              {{- if eq $.component "worker" }}
              "--progress",{{ if $nossh }} "--job",{{ end }}
              "--world-size", {{ mul (int $root.Values.worker.replicas) (int $root.Values.worker.gpusPerWorker) | quote }},
              "--ranks-per-pod", {{ $root.Values.worker.gpusPerWorker | int | quote }},
              {{- else }}
              "--job",
              {{- end }}
              {{- if and (eq $.component "launcher") (include "deepspeed-training.scalesDownWorkers" $root) }}
              "--scale-down", {{ include "deepspeed-training.workerName" $root | quote }},
              {{- end }}
              "--metrics-port", {{ .metricsPort | int | quote }}]
    ports:
      - name: metrics
        containerPort: {{ .metricsPort | int }}
        protocol: TCP
    # The pod's main container starts once the sidecar has written the job's identity (podstate.JOB_ID_FILE: the
    # progress ConfigMap's uid, which an upgrade keeps), which keys the job's ledger and goodput records.
    startupProbe:
      exec:
        command: ["test", "-f", "{{ include "deepspeed-training.rankStateDir" $root }}/{{ (include "deepspeed-training.podstate" $root | fromJson).jobIdFile }}"]
      periodSeconds: 1
      failureThreshold: 120
    env:
      - name: DS_RANK_STATE_DIR
        value: {{ include "deepspeed-training.rankStateDir" $root | quote }}
      - name: POD_NAMESPACE
        valueFrom:
          fieldRef:
            fieldPath: metadata.namespace
      {{- if eq $.component "worker" }}
      # The pod's node rank (its index, which its controller labels it with): node rank 0's sidecar holds rank 0.
      - name: DS_NODE_RANK
        valueFrom:
          fieldRef:
            fieldPath: {{ ternary "metadata.labels['batch.kubernetes.io/job-completion-index']" "metadata.labels['apps.kubernetes.io/pod-index']" $nossh | quote }}
      {{- end }}
      - name: PYTHONUNBUFFERED
        value: "1"
      {{- if $root.Values.checkpoints.objectStore.bucket }}
      {{- include "deepspeed-training.objectStoreEnv" $ | nindent 6 }}
      {{- end }}
    {{- /* With an object store it also uploads the checkpoints: its resources are the object store's. */}}
    {{- with ternary $root.Values.checkpoints.objectStore.resources .resources (not (empty $root.Values.checkpoints.objectStore.bucket)) }}
    resources:
      {{- toYaml . | nindent 6 }}
    {{- end }}
    {{- with $root.Values.securityContext }}
    securityContext:
      {{- toYaml . | nindent 6 }}
    {{- end }}
    volumeMounts:
      - name: scripts
        mountPath: {{ include "deepspeed-training.scriptsDir" $root | quote }}
        readOnly: true
      # The pod's /tmp, where the ranks, the watchdog and the ledger write what this container reads (through
      # podstate.StateDir: no link followed), and where it writes the job's identity.
      - name: tmp
        mountPath: /tmp
      {{- if include "deepspeed-training.progressPublishes" $root }}
      - name: progress-token
        mountPath: /var/run/secrets/kubernetes.io/serviceaccount
        readOnly: true
      {{- end }}
      {{- if $root.Values.checkpoints.objectStore.bucket }}
      {{- include "deepspeed-training.objectStoreMounts" (dict "root" $root "component" $.component "readOnly" true) | nindent 6 }}
      {{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/*
The object store (checkpoints.objectStore; podruntime/objectstore.py), in the platform's image beside the progress
sidecar: a restore init container before it, and the sidecar's uploads. Only these containers get the bucket's
credentials (validateObjectStore refuses any reference of the tenant's to the Secret). The worker pods keep the
checkpoints (their volume: read-only for the uploads, writable for the restore); the launcher pod of launchMode ssh
keeps the job's ledger in its /tmp. Called with (dict "root" $ "component" "worker"|"launcher").
*/}}
{{- define "deepspeed-training.objectStoreRestore" -}}
{{- $root := .root }}
- name: restore
  image: {{ $root.Values.progress.image | quote }}
  imagePullPolicy: {{ $root.Values.image.pullPolicy | quote }}
  # Before the ranks: the store answers with these credentials (else one line naming the value, and the pod
  # fails), then the newest committed checkpoint where this pod's volume holds none as new, and the job's records.
  command: [{{ include "deepspeed-training.podProgram" (dict "root" $root "program" "objectstore") }}, "restore"]
  env:
    {{- if eq .component "worker" }}
    - name: DS_NODE_RANK
      valueFrom:
        fieldRef:
          fieldPath: {{ ternary "metadata.labels['batch.kubernetes.io/job-completion-index']" "metadata.labels['apps.kubernetes.io/pod-index']" (eq $root.Values.launchMode "nossh") | quote }}
    {{- end }}
    - name: PYTHONUNBUFFERED
      value: "1"
    {{- include "deepspeed-training.objectStoreEnv" . | nindent 4 }}
  {{- with $root.Values.checkpoints.objectStore.resources }}
  resources:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $root.Values.securityContext }}
  securityContext:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  volumeMounts:
    - name: scripts
      mountPath: {{ include "deepspeed-training.scriptsDir" $root | quote }}
      readOnly: true
    - name: tmp
      mountPath: /tmp
    {{- include "deepspeed-training.objectStoreMounts" (dict "root" $root "component" .component "readOnly" false) | nindent 4 }}
{{- end }}

{{- define "deepspeed-training.objectStoreEnv" -}}
{{- $root := .root }}
{{- with $root.Values.checkpoints.objectStore }}
- name: DS_OBJECT_STORE_BUCKET
  value: {{ .bucket | quote }}
- name: DS_OBJECT_STORE_ENDPOINT
  value: {{ .endpoint | quote }}
- name: DS_OBJECT_STORE_REGION
  value: {{ .region | quote }}
- name: DS_OBJECT_STORE_PATH_STYLE
  value: {{ .pathStyle | toString | quote }}
- name: DS_OBJECT_STORE_KEEP
  value: {{ .keep | int | quote }}
- name: DS_OBJECT_STORE_MAX_PART_BYTES
  value: {{ mul (.maxPartGiB | int64) 1073741824 | quote }}
- name: DS_OBJECT_STORE_CREDENTIALS_SECRET
  value: {{ .credentialsSecret | quote }}
{{- if .caConfigMap }}
- name: DS_OBJECT_STORE_CA_FILE
  value: {{ printf "%s/ca.crt" (include "deepspeed-training.objectStoreCaDir" $root) | quote }}
{{- end }}
- name: AWS_ACCESS_KEY_ID
  valueFrom:
    secretKeyRef:
      name: {{ .credentialsSecret | quote }}
      key: AWS_ACCESS_KEY_ID
- name: AWS_SECRET_ACCESS_KEY
  valueFrom:
    secretKeyRef:
      name: {{ .credentialsSecret | quote }}
      key: AWS_SECRET_ACCESS_KEY
{{- end }}
- name: DS_OBJECT_STORE_ROLE
  value: {{ .component | quote }}
- name: DS_RELEASE
  value: {{ include "deepspeed-training.checkpointSubPath" $root | quote }}
{{- with include "deepspeed-training.ownerEnv" $root }}{{ . | nindent 0 }}{{- end }}
- name: DS_CHECKPOINT_DIR
  value: {{ $root.Values.checkpoints.mountPath | quote }}
- name: DS_CHECKPOINT_STORAGE
  value: {{ include "deepspeed-training.checkpointStorage" $root | quote }}
- name: DS_WORKERS
  value: {{ $root.Values.worker.replicas | int | quote }}
- name: DS_ATTEMPTS_DIR
  value: {{ include "deepspeed-training.attemptsDir" $root | quote }}
- name: DS_WORKER_GRACE_SECONDS
  value: {{ $root.Values.worker.terminationGracePeriodSeconds | int | quote }}
- name: DS_LEDGER_ON_WORKER0
  value: {{ eq $root.Values.launchMode "nossh" | toString | quote }}
{{- end }}

{{- define "deepspeed-training.objectStoreCaDir" -}}/etc/deepspeed/object-store-ca{{- end }}

{{/* The checkpoint volume where the pod has one (workers; the launcher with launcherMountsCheckpoints), and the
store's CA. Called with (dict "root" $ "component" ... "readOnly" bool). */}}
{{- define "deepspeed-training.objectStoreMounts" -}}
{{- $root := .root }}
{{- if or (eq .component "worker") (include "deepspeed-training.launcherMountsCheckpoints" $root) }}
- name: checkpoints
  mountPath: {{ $root.Values.checkpoints.mountPath | quote }}
  {{- if $root.Values.checkpoints.existingClaim }}
  subPath: {{ include "deepspeed-training.checkpointSubPath" $root | quote }}
  {{- end }}
  readOnly: {{ .readOnly }}
{{- end }}
{{- if $root.Values.checkpoints.objectStore.caConfigMap }}
- name: object-store-ca
  mountPath: {{ include "deepspeed-training.objectStoreCaDir" $root | quote }}
  readOnly: true
{{- end }}
{{- end }}

{{- define "deepspeed-training.objectStoreVolumes" -}}
{{- with .Values.checkpoints.objectStore.caConfigMap }}
- name: object-store-ca
  configMap:
    name: {{ . | quote }}
    items:
      - key: ca.crt
        path: ca.crt
{{- end }}
{{- end }}

{{- define "deepspeed-training.progressTokenVolume" -}}
{{- if include "deepspeed-training.progressPublishes" . }}
- name: progress-token
  projected:
    defaultMode: 0440
    sources:
      - serviceAccountToken:
          path: token
          expirationSeconds: 3600
      - configMap:
          name: kube-root-ca.crt
          items:
            - key: ca.crt
              path: ca.crt
      - downwardAPI:
          items:
            - path: namespace
              fieldRef:
                fieldPath: metadata.namespace
{{- end }}
{{- end }}
