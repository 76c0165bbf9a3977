{{/*
The progress sidecar (files/progress.py), in every pod of the release when progress.enabled: a native sidecar
(an init container that keeps running), so that a Job's pod still ends with its main container. It runs no
program code, in the platform's image (progress.image), and it is the only container that holds a token: the
release's own ServiceAccount's, from a projected volume of its own (every pod keeps automountServiceAccountToken
false, and the main containers run the tenant's image). With it the sidecar patches the progress ConfigMap and, in
the launcher pod of launchMode ssh, scales the workers to 0 after a successful run (launcher.scaleDownWorkers).
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

{{/* "true" when the launcher pod's sidecar scales the workers down after success (checked in _validate.tpl). */}}
{{- define "deepspeed-training.scalesDownWorkers" -}}
{{- if and (eq .Values.launchMode "ssh") .Values.launcher.scaleDownWorkers }}true{{- end }}
{{- end }}

{{- define "deepspeed-training.progressSidecar" -}}
{{- $root := .root }}
{{- with $root.Values.progress }}
{{- if .enabled }}
initContainers:
  - name: progress
    image: {{ .image | default (include "deepspeed-training.image" $root) | quote }}
    imagePullPolicy: {{ $root.Values.image.pullPolicy | quote }}
    restartPolicy: Always
    # -I: no PYTHONPATH, PYTHONSTARTUP or user site-packages reach the process that holds the token.
    command: ["python3", "-I", "{{ include "deepspeed-training.scriptsDir" $root }}/progress.py",
              {{- if include "deepspeed-training.progressPublishes" $root }}
              "--configmap", {{ include "deepspeed-training.progressName" $root | quote }},
              {{- end }}
              {{- if and (eq $.component "launcher") (include "deepspeed-training.scalesDownWorkers" $root) }}
              "--scale-down", {{ include "deepspeed-training.workerName" $root | quote }},
              {{- end }}
              "--metrics-port", {{ .metricsPort | int | quote }}]
    ports:
      - name: metrics
        containerPort: {{ .metricsPort | int }}
        protocol: TCP
    env:
      - name: DS_RANK_STATE_DIR
        value: {{ include "deepspeed-training.rankStateDir" $root | quote }}
      - name: DS_RELEASE
        value: {{ include "deepspeed-training.checkpointSubPath" $root | quote }}
      - name: POD_NAMESPACE
        valueFrom:
          fieldRef:
            fieldPath: metadata.namespace
      - name: PYTHONUNBUFFERED
        value: "1"
    {{- with .resources }}
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
      # The pod's /tmp, where the ranks, the watchdog and the ledger write what this container reads.
      - name: tmp
        mountPath: /tmp
        readOnly: true
      {{- if include "deepspeed-training.progressPublishes" $root }}
      - name: progress-token
        mountPath: /var/run/secrets/kubernetes.io/serviceaccount
        readOnly: true
      {{- end }}
{{- end }}
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
