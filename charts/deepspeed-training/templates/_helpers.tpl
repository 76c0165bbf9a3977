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
helm.sh/chart: {{ include "deepspeed-training.chart" . | quote }}
{{ include "deepspeed-training.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service | quote }}
{{- end }}

{{- define "deepspeed-training.selectorLabels" -}}
app.kubernetes.io/name: {{ include "deepspeed-training.name" . | quote }}
app.kubernetes.io/instance: {{ .Release.Name | quote }}
{{- end }}

{{- define "deepspeed-training.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "deepspeed-training.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
The subject of every RoleBinding the chart renders: the release's own ServiceAccount, and no other. A binding to a
shared account (a platform's, `default`) would hand this release's rights to every pod of every release that runs
as it; _validate.tpl refuses the values that would need one, and this fails if a template asks anyway.
*/}}
{{- define "deepspeed-training.rbacSubject" -}}
{{- if not .Values.serviceAccount.create }}
{{- fail "the chart binds its Roles only to the ServiceAccount it creates for the release (serviceAccount.create: true)" }}
{{- end }}
- kind: ServiceAccount
  name: {{ include "deepspeed-training.serviceAccountName" . | quote }}
  namespace: {{ .Release.Namespace | quote }}
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

{{/*
Worker pods are "<prefix>-<index>". ssh: the StatefulSet's pods (its name). nossh: the Indexed Job's pods, whose
host names the Job controller sets to "<job>-<index>"; one Job per Helm revision (a Job's pod template is
immutable), so the revision is part of the name.
*/}}
{{- define "deepspeed-training.workerPodPrefix" -}}
{{- if eq .Values.launchMode "nossh" }}
{{- printf "%s-r%d" (include "deepspeed-training.workerName" .) (int .Release.Revision) }}
{{- else }}
{{- include "deepspeed-training.workerName" . }}
{{- end }}
{{- end }}

{{/* Host name of worker <index>: the headless Service gives each worker pod this record. */}}
{{- define "deepspeed-training.workerHost" -}}
{{- printf "%s-%d.%s" (include "deepspeed-training.workerPodPrefix" .root) (int .index) (include "deepspeed-training.workerDomain" .root) }}
{{- end }}

{{/* The attempt loop's channel (podruntime/channel.py) on the port below the rendezvous (DeepSpeed's autotuner gives
its experiments the ports from the rendezvous's up): nossh, worker 0 serves the hosts' meeting on it; ssh, every
worker's agent, which the launcher connects to. */}}
{{- define "deepspeed-training.channelPort" -}}
{{- sub .Values.deepspeed.masterPort 1 }}
{{- end }}

{{/* Whether the workers keep each other's checkpoint parts (podruntime/peercopy.py): on per-worker storage, with
checkpoints.peerCopy, and with the NetworkPolicy that keeps the copies among the release's pods. */}}
{{- define "deepspeed-training.peerCopy" -}}
{{- if and .Values.checkpoints.peerCopy .Values.networkPolicy.enabled (eq (include "deepspeed-training.checkpointStorage" .) "per-worker") }}true{{ end }}
{{- end }}

{{/* The port each worker's keeper of a peer's checkpoint part listens on. */}}
{{- define "deepspeed-training.peerCopyPort" -}}
{{- sub .Values.deepspeed.masterPort 2 }}
{{- end }}

{{/* Pods that must run together: the workers, and in ssh mode the launcher. */}}
{{- define "deepspeed-training.gangSize" -}}
{{- add .Values.worker.replicas (ternary 1 0 (eq .Values.launchMode "ssh")) }}
{{- end }}

{{/*
The native gang-scheduling API the cluster serves (scheduling.k8s.io Workload), newest first, when
scheduling.gangScheduling is on; empty when off. The "/Workload" form: offline renders list only group/versions.
*/}}
{{- define "deepspeed-training.gangApi" -}}
{{- if .Values.scheduling.gangScheduling }}
{{- $found := "" }}
{{- range list "v1beta1" "v1alpha2" "v1alpha1" }}
{{- if and (not $found) ($.Capabilities.APIVersions.Has (printf "scheduling.k8s.io/%s/Workload" .)) }}
{{- $found = printf "scheduling.k8s.io/%s" . }}
{{- end }}
{{- end }}
{{- if not $found }}
{{- fail "scheduling.gangScheduling: the cluster serves no scheduling.k8s.io Workload API (v1alpha1 on Kubernetes 1.35, v1alpha2 on 1.36, v1beta1 on 1.37, with the GenericWorkload feature gate and the API group enabled); turn it off, or render for such a cluster (helm template --api-versions scheduling.k8s.io/v1alpha2/Workload)" }}
{{- end }}
{{- $found }}
{{- end }}
{{- end }}

{{- define "deepspeed-training.sshSecretName" -}}
{{- default (printf "%s-ssh" (include "deepspeed-training.fullname" .)) .Values.ssh.existingSecret }}
{{- end }}

{{- define "deepspeed-training.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{/* Where the ConfigMaps and the Secret are mounted; files/*.sh read these paths. */}}
{{- define "deepspeed-training.configDir" -}}/etc/deepspeed/config{{- end }}
{{- define "deepspeed-training.scriptsDir" -}}/etc/deepspeed/scripts{{- end }}
{{- define "deepspeed-training.keysDir" -}}/etc/deepspeed/ssh-keys{{- end }}

{{/*
"May this reach a remote shell?": the one rule. DeepSpeed's pdsh runner pastes plain env values into
`export NAME="VALUE";` ("quoted": nothing a double-quoted string would interpret) and the program, its
arguments, the runner flags and host names bare into the shell every worker runs ("bare": a short safe
character set, no quoting needed). Fails naming `.key`; renders nothing.
*/}}
{{- define "deepspeed-training.shellSafe" -}}
{{- $value := toString .value }}
{{- if eq .context "quoted" }}
{{- if regexMatch "[$`\"\\\\[:cntrl:]\\x{85}\\x{2028}\\x{2029}]" $value }}
{{- fail (printf "%s: %q contains a character the remote shell would interpret ($ ` \" \\, a control character or a line break); DeepSpeed pastes it into `export NAME=\"...\"` on every worker. Use valueFrom (a Secret or ConfigMap) for such values." .key $value) }}
{{- end }}
{{- else if not (regexMatch "^[A-Za-z0-9_@%+=:,./-]*$" $value) }}
{{- fail (printf "%s: %q may only contain letters, digits and _@%%+=:,./- ; DeepSpeed's pdsh runner pastes it unquoted into a remote shell on every worker" .key $value) }}
{{- end }}
{{- end }}

{{/* The MPI-style hostfile: one "<host> slots=<GPUs>" line per worker. */}}
{{- define "deepspeed-training.hostfile" -}}
{{- range $i := until (int .Values.worker.replicas) }}
{{ include "deepspeed-training.workerHost" (dict "root" $ "index" $i) }} slots={{ $.Values.worker.gpusPerWorker | int }}
{{- end }}
{{- end }}

{{/* Rank env with plain values, for `.deepspeed_env` (checked by the validate helper). */}}
{{- define "deepspeed-training.deepspeedEnv" -}}
{{- range .Values.env }}
{{- if hasKey . "value" }}
{{ .name }}={{ .value }}
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

{{/* Pod-level fields shared by worker and launcher (pull secrets, scheduling, pod securityContext, the gang);
`.component` is "worker" or "launcher". */}}
{{- define "deepspeed-training.podSpecFields" -}}
{{- include "deepspeed-training.placement" . }}
{{- with .root.Values.podSecurityContext }}
securityContext:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with include "deepspeed-training.gangApi" .root }}
{{- if eq . "scheduling.k8s.io/v1alpha1" }}
workloadRef:
  name: {{ include "deepspeed-training.fullname" $.root | quote }}
  podGroup: gang
{{- else }}
schedulingGroup:
  podGroupName: {{ include "deepspeed-training.fullname" $.root | quote }}
{{- end }}
{{- end }}
{{- end }}

{{/* Where the platform's scheduling puts a pod of `.component` ("worker", "launcher"): pull secrets, scheduler,
PriorityClass, node selector, tolerations and affinity (the component's own, else the global ones). The config
check hook takes the workers': nothing the chart runs is placed outside them. */}}
{{- define "deepspeed-training.placement" -}}
{{- $values := index .root.Values .component }}
{{- $global := .root.Values.global }}
{{- with .root.Values.image.pullSecrets }}
imagePullSecrets:
{{- range . }}
  - name: {{ . | quote }}
{{- end }}
{{- end }}
{{- with (.root.Values.scheduling.schedulerName | default (ternary "volcano" "" .root.Values.scheduling.volcano.enabled)) }}
schedulerName: {{ . | quote }}
{{- end }}
{{- with ($values.priorityClassName | default $global.priorityClassName) }}
priorityClassName: {{ . | quote }}
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
{{- end }}

{{/* The Kueue queue of the config check hook: configCheck.kueueQueueName, else the release's (a check of the
tenant's image is admitted and counted like its workers). */}}
{{- define "deepspeed-training.configCheckQueue" -}}
{{- .Values.configCheck.kueueQueueName | default .Values.scheduling.kueueQueueName }}
{{- end }}

{{/* Labels and annotations that put a pod into the gang-scheduling group, when one is on. */}}
{{- define "deepspeed-training.gangLabels" -}}
{{- with .Values.scheduling.kueueQueueName }}
kueue.x-k8s.io/queue-name: {{ . | quote }}
{{- end }}
{{- end }}
{{/* `.component` is "worker" or "launcher": Kueue's topology request places the workers (in rank order). */}}
{{- define "deepspeed-training.gangAnnotations" -}}
{{- if .root.Values.scheduling.volcano.enabled }}
scheduling.k8s.io/group-name: {{ include "deepspeed-training.fullname" .root | quote }}
{{- end }}
{{- with .root.Values.scheduling.kueueTopology }}
{{- if and .mode (eq $.component "worker") }}
kueue.x-k8s.io/podset-{{ .mode }}-topology: {{ .level | quote }}
{{- end }}
{{- end }}
{{- end }}

{{/* The pod programs: ConfigMap key -> path under files/, which is also their path under scriptsDir (the volume's
items: a key cannot hold a `/`). The scripts directory runs as a program, `python3 -I <scriptsDir> PROGRAM`
(files/__main__.py), and imports the package beside it, files/podruntime/, whole: the pod runtime's source, which
train/ and the glue import too. rank-log.py is DeepSpeed's launcher's script for every rank; the shell files are the
ssh mode's setup and probe. */}}
{{- define "deepspeed-training.podScripts" -}}
{{- $paths := list "__main__.py" "rank-log.py" "rank-hook.py" }}
{{- range $path, $_ := .Files.Glob "files/podruntime/*.py" }}
{{- $paths = append $paths (trimPrefix "files/" $path) }}
{{- end }}
{{- if eq .Values.launchMode "ssh" }}
{{- $paths = concat $paths (list "ssh-setup.sh" "sshd-listening.sh") }}
{{- end }}
{{- $scripts := dict }}
{{- range $paths }}
{{- $_ := set $scripts (replace "/" "." .) . }}
{{- end }}
{{- toJson $scripts }}
{{- end }}

{{/* A pod program's command, the words of a flow sequence: the scripts directory run as a program (`python3 -I`:
no PYTHONPATH, startup file or user site of the image's reaches it), then the program's name. */}}
{{- define "deepspeed-training.podProgram" -}}
"python3", "-I", {{ include "deepspeed-training.scriptsDir" .root | quote }}, {{ .program | quote }}
{{- end }}

{{/* Volumes every pod mounts: config, scripts, SSH keys (ssh mode), home and /tmp. */}}
{{- define "deepspeed-training.commonVolumes" -}}
- name: config
  configMap:
    name: {{ printf "%s-config" (include "deepspeed-training.fullname" .) | quote }}
- name: scripts
  configMap:
    name: {{ printf "%s-scripts" (include "deepspeed-training.fullname" .) | quote }}
    defaultMode: 0555
    items:
      {{- range $key, $path := include "deepspeed-training.podScripts" . | fromJson }}
      - key: {{ $key | quote }}
        path: {{ $path | quote }}
      {{- end }}
{{- if eq .Values.launchMode "ssh" }}
- name: ssh-keys
  secret:
    secretName: {{ include "deepspeed-training.sshSecretName" . | quote }}
    defaultMode: 0440
{{- end }}
- name: home
  emptyDir: {}
- name: tmp
  emptyDir: {}
{{- end }}

{{- define "deepspeed-training.commonVolumeMounts" -}}
- name: config
  mountPath: {{ include "deepspeed-training.configDir" . | quote }}
  readOnly: true
- name: scripts
  mountPath: {{ include "deepspeed-training.scriptsDir" . | quote }}
  readOnly: true
{{- if eq .Values.launchMode "ssh" }}
- name: ssh-keys
  mountPath: {{ include "deepspeed-training.keysDir" . | quote }}
  readOnly: true
{{- end }}
- name: home
  mountPath: {{ .Values.image.homeDir | quote }}
- name: tmp
  mountPath: /tmp
{{- end }}

{{/* Seconds the rank stopper (podruntime/ranks.py) gives ranks to save after SIGTERM: the worker's grace period less the time sshd
and the pod need to stop. */}}
{{- define "deepspeed-training.killGraceSeconds" -}}
{{- sub .Values.worker.terminationGracePeriodSeconds 10 | max 1 }}
{{- end }}

{{/* Env every container gets: where things are, for the pod programs. */}}
{{- define "deepspeed-training.commonEnv" -}}
- name: HOME
  value: {{ .Values.image.homeDir | quote }}
- name: DS_CONFIG_DIR
  value: {{ include "deepspeed-training.configDir" . | quote }}
- name: DS_WORKER_DOMAIN
  value: {{ include "deepspeed-training.workerDomain" . | quote }}
{{- if eq .Values.launchMode "ssh" }}
- name: DS_SSH_KEYS_DIR
  value: {{ include "deepspeed-training.keysDir" . | quote }}
- name: DS_SSH_PORT
  value: {{ .Values.ssh.port | int | quote }}
{{- end }}
- name: DS_RANK_STATE_DIR
  value: {{ include "deepspeed-training.rankStateDir" . | quote }}
{{ include "deepspeed-training.protocolEnv" . }}
# The attempt loop's channel between the hosts and the ledger's owner (podruntime/channel.py).
- name: DS_CHANNEL_PORT
  value: {{ include "deepspeed-training.channelPort" . | quote }}
- name: DS_ATTEMPTS_DIR
  value: {{ include "deepspeed-training.attemptsDir" . | quote }}
{{- if include "deepspeed-training.peerCopy" . }}
# Each worker's checkpoint part is also kept on its ring neighbour's volume (podruntime/peercopy.py): the port.
- name: DS_PEER_COPY_PORT
  value: {{ include "deepspeed-training.peerCopyPort" . | quote }}
{{- end }}
{{- with .Values.hangDetection }}
# The one switch of the watchdog (podruntime/watchdog.py, in every worker pod), and its budgets.
- name: DS_HANG_DETECTION
  value: {{ ternary "on" "off" .enabled | quote }}
{{- if .enabled }}
- name: DS_HANG_STARTUP_SECONDS
  value: {{ .startupSeconds | int | quote }}
- name: DS_HANG_STEP_SECONDS
  value: {{ .stepSeconds | int | quote }}
- name: DS_HANG_CHECKPOINT_SECONDS
  value: {{ .checkpointSeconds | int | quote }}
- name: DS_HANG_SIGNAL_SECONDS
  value: {{ .signalSeconds | int | quote }}
# torch's flight recorder (gloo and NCCL): the last 2,000 collectives of each rank, which the watchdog has a
# hung rank dump (train/rankstate.py serves it).
- name: TORCH_FR_BUFFER_SIZE
  value: "2000"
{{- end }}
{{- end }}
- name: DS_RESUME_ACROSS_WORLD_SIZES
  value: {{ .Values.checkpoints.resumeAcrossWorldSizes | toJson | quote }}
# Who owns the checkpoints: the train package records it in every checkpoint and refuses another release's.
- name: DS_RELEASE
  value: {{ include "deepspeed-training.checkpointSubPath" . | quote }}
{{- with .Values.checkpoints.resumeFrom }}
- name: DS_RESUME_FROM_DIR
  value: {{ include "deepspeed-training.resumeFromDir" $ | quote }}
- name: DS_RESUME_FROM_RELEASE
  value: {{ . | quote }}
{{- end }}
- name: DS_KILL_GRACE_SECONDS
  value: {{ include "deepspeed-training.killGraceSeconds" . | quote }}
- name: DS_WORLD_SIZE
  value: {{ mul (int .Values.worker.replicas) (int .Values.worker.gpusPerWorker) | quote }}
{{- if .Values.worker.gpuResourceName }}
# The GPUs each worker was given: its ranks refuse to start seeing fewer (train/main.py check_devices).
- name: DS_GPUS_PER_WORKER
  value: {{ .Values.worker.gpusPerWorker | int | quote }}
{{- end }}
# The one collective timeout (whole minutes, as DeepSpeed reads it); the huggingface convention also passes it.
- name: DEEPSPEED_TIMEOUT
  value: {{ .Values.deepspeed.collectiveTimeoutMinutes | int | quote }}
{{ include "deepspeed-training.programPathsEnv" . | trim }}
{{- end }}

{{/* The chart's paths in the program's env, and how its checkpoint directory is stored: every rank's, and the
config check's. */}}
{{- define "deepspeed-training.programPathsEnv" -}}
{{- $paths := include "deepspeed-training.programPaths" . | fromJson }}
{{- range $name, $path := dict "DS_CONFIG_PATH" "ds_config" "DS_TRAIN_CONFIG_PATH" "train_config" "DS_CHECKPOINT_DIR" "checkpoint_dir" "DS_DATA_DIR" "data_dir" }}
- name: {{ $name }}
  value: {{ get $paths $path | quote }}
{{- end }}
- name: DS_CHECKPOINT_STORAGE
  value: {{ include "deepspeed-training.checkpointStorage" . | quote }}
{{- if has .Values.train.argsConvention (list "deepspeed" "none") }}
# A plain DeepSpeed program resumes from `latest`, which DeepSpeed writes on global rank 0 only: on per-worker
# volumes every node's local rank 0 marks its own after each save (podruntime/savehook.py).
- name: DS_CHECKPOINT_MARK_LATEST
  value: "node"
{{- end }}
{{- end }}

{{/* The project's identity for the containers that keep its storage (podruntime/ownership.py): each claims its
volume or the bucket's prefix before anything reads it. */}}
{{- define "deepspeed-training.ownerEnv" -}}
{{- if .Values.checkpoints.owner }}
- name: DS_CHECKPOINT_OWNER
  value: {{ .Values.checkpoints.owner | quote }}
- name: DS_CHECKPOINT_ADOPT
  value: {{ .Values.checkpoints.adoptOwner | quote }}
{{- end }}
{{- end }}

{{/* Env of the containers that run `deepspeed` (ssh: the launcher; nossh: every worker). */}}
{{- define "deepspeed-training.launcherEnv" -}}
- name: DS_WAIT_TIMEOUT_SECONDS
  value: {{ .Values.job.waitTimeoutSeconds | int | quote }}
- name: DS_RUN_RETRIES
  value: {{ .Values.job.runRetries | int | quote }}
- name: DS_NO_PROGRESS_ATTEMPTS
  value: {{ .Values.job.noProgressAttempts | int | quote }}
- name: DS_PREEMPTION_RETRIES
  value: {{ .Values.job.preemptionRetries | int | quote }}
# The ledger (podruntime/ledger.py) keys the job's attempts by the Job's uid without the sidecar's job identity.
- name: DS_JOB_UID
  valueFrom:
    fieldRef:
      fieldPath: metadata.labels['batch.kubernetes.io/controller-uid']
- name: PYTHONUNBUFFERED
  value: "1"
{{- end }}

{{/*
Where ranks report their state and heartbeat (train/rankstate.py; podruntime/ranks.py reads it: a rank that has
not finished a step since it started has nothing to save, one that does not acknowledge SIGTERM is stuck in a
collective; podruntime/watchdog.py judges the heartbeats). Inside the pod's /tmp emptyDir.
*/}}
{{- define "deepspeed-training.rankStateDir" -}}/tmp/deepspeed-ranks{{- end }}

{{/*
The job's ledger of attempts and failure budget (podruntime/ledger.py): in the release's checkpoint directory
wherever the attempt's owner has it (ssh: the launcher, which mounts a shared claim; nossh: worker 0), in the folder
the chart keeps there (podstate.JOB_DIR), so a new pod continues the count; else in the pod's /tmp, where each pod
starts its own count.
*/}}
{{- define "deepspeed-training.attemptsDir" -}}
{{- $podstate := include "deepspeed-training.podstate" . | fromJson }}
{{- if or (eq .Values.launchMode "nossh") .Values.checkpoints.existingClaim }}
{{- printf "%s/%s/%s" (clean .Values.checkpoints.mountPath) $podstate.jobDir $podstate.attempts }}
{{- else }}
{{- printf "%s/attempts" (include "deepspeed-training.rankStateDir" .) }}
{{- end }}
{{- end }}

{{/*
The ds_config the pods get, as JSON: deepspeed.config (or files/ds_config.default.json) as given, with
`checkpoint.use_node_local_storage` on per-worker checkpoint volumes, and with launcher.autotuning its
`autotuning` section switched on, writing under the release's checkpoint directory
(the user's search-space keys kept; `overwrite: false` unless set, so a retried tuning keeps the experiments
already done).
*/}}
{{- define "deepspeed-training.dsConfig" -}}
{{- $config := deepCopy (.Values.deepspeed.config | default (.Files.Get "files/ds_config.default.json" | fromJson)) }}
{{- /* A monitor without an output_path writes under the working directory, an emptyDir lost with the pod: its
       files go to the release's checkpoint directory instead (tensorboard --logdir <that>/monitor). */}}
{{- range $section := list "tensorboard" "csv_monitor" }}
{{- $monitor := get $config $section }}
{{- if and (kindIs "map" $monitor) $monitor.enabled (not $monitor.output_path) }}
{{- $_ := set $config $section (merge (dict "output_path" (printf "%s/monitor/" (clean $.Values.checkpoints.mountPath))) $monitor) }}
{{- end }}
{{- end }}
{{- /* Per-worker volumes: each worker's local rank 0 writes the model states too, so every worker holds what its
       ranks load (DeepSpeed's checkpoint.use_node_local_storage; validateDsConfig refuses a value against it). */}}
{{- if eq (include "deepspeed-training.checkpointStorage" .) "per-worker" }}
{{- $_ := set $config "checkpoint" (merge (dict "use_node_local_storage" true) (deepCopy ($config.checkpoint | default dict))) }}
{{- end }}
{{- if .Values.launcher.autotuning }}
{{- $dir := printf "%s/autotuning" (clean .Values.checkpoints.mountPath) }}
{{- /* The chart's keys win: the tuner deletes exps_dir at start with overwrite, so it stays in the release's
       own directory (validateDsConfig refuses these keys in the values). */}}
{{- $pinned := dict "enabled" true "results_dir" (printf "%s/results" $dir) "exps_dir" (printf "%s/exps" $dir) }}
{{- $_ := set $config "autotuning" (merge $pinned (deepCopy ($config.autotuning | default dict)) (dict "overwrite" false)) }}
{{- end }}
{{- toJson $config }}
{{- end }}

{{/*
The release's own directory on a shared checkpoint claim: "<namespace>/<release>". The claim is mounted with
this subPath, so a pod sees its release's checkpoints and nothing else on the claim (NFS-style volumes span
namespaces, so the namespace is part of it). The kubelet creates the directory (with the claim root's mode).
*/}}
{{- define "deepspeed-training.checkpointSubPath" -}}
{{- printf "%s/%s" .Release.Namespace .Release.Name }}
{{- end }}

{{/* Where another release's directory is mounted read-only when checkpoints.resumeFrom names it. */}}
{{- define "deepspeed-training.resumeFromDir" -}}/etc/deepspeed/resume-from{{- end }}

{{/* Whether the launcher mounts the release's checkpoint directory: for the job's ledger of attempts on a
shared claim (attemptsDir), and for the autotuner's experiments. */}}
{{- define "deepspeed-training.launcherMountsCheckpoints" -}}
{{- if or .Values.launcher.autotuning .Values.checkpoints.existingClaim }}true{{ end }}
{{- end }}

{{/* How the ranks' checkpoint directory is stored (DS_CHECKPOINT_STORAGE; train/checkpoint.py storage_for owns
the rule): "per-worker" when several workers have no shared claim, each worker's ranks writing to their pod's own
volume, else "shared". */}}
{{- define "deepspeed-training.checkpointStorage" -}}
{{- if and (gt (int .Values.worker.replicas) 1) (not .Values.checkpoints.existingClaim) }}per-worker{{ else }}shared{{ end }}
{{- end }}

{{/* The checkpoint volumes of a pod (workers; the launcher, see launcherMountsCheckpoints). A per-worker PVC
(checkpoints.volumeClaimSpec) comes from the StatefulSet's volumeClaimTemplates in launchMode ssh, and is a
generic ephemeral volume of each worker pod in launchMode nossh. */}}
{{- define "deepspeed-training.checkpointVolumes" -}}
{{- if .Values.checkpoints.existingClaim }}
- name: checkpoints
  persistentVolumeClaim:
    claimName: {{ .Values.checkpoints.existingClaim | quote }}
{{- else if not .Values.checkpoints.volumeClaimSpec }}
- name: checkpoints
  emptyDir: {}
{{- else if eq .Values.launchMode "nossh" }}
- name: checkpoints
  ephemeral:
    volumeClaimTemplate:
      spec:
        {{- toYaml .Values.checkpoints.volumeClaimSpec | nindent 8 }}
{{- end }}
{{- end }}

{{- define "deepspeed-training.checkpointVolumeMounts" -}}
- name: checkpoints
  mountPath: {{ .Values.checkpoints.mountPath | quote }}
  {{- if .Values.checkpoints.existingClaim }}
  subPath: {{ include "deepspeed-training.checkpointSubPath" . | quote }}
  {{- end }}
{{- with .Values.checkpoints.resumeFrom }}
- name: checkpoints
  mountPath: {{ include "deepspeed-training.resumeFromDir" $ | quote }}
  subPath: {{ . | quote }}
  readOnly: true
{{- end }}
{{- end }}

{{/* Paths the chart gives the program: placeholders in `train.args`, and env on every rank (commonEnv). */}}
{{- define "deepspeed-training.programPaths" -}}
{{- $configDir := include "deepspeed-training.configDir" . }}
{{- dict "ds_config" (printf "%s/ds_config.json" $configDir) "train_config" (printf "%s/train_config.json" $configDir) "checkpoint_dir" .Values.checkpoints.mountPath "data_dir" .Values.data.mountPath | toJson }}
{{- end }}

{{/* The program's files of the config ConfigMap (ConfigMap data lines, quoted scalars), also the config check's
(templates/config-check.yaml): the hook checks the very bytes the ranks read. */}}
{{- define "deepspeed-training.programFiles" -}}
ds_config.json: {{ printf "%s\n" (include "deepspeed-training.dsConfig" . | fromJson | toPrettyJson) | quote }}
train_config.json: {{ printf "%s\n" (.Values.train.config | toPrettyJson) | quote }}
{{- end }}

{{/* "true" when the ranks run this repository's train package (its config and arguments are train/'s to check). */}}
{{- define "deepspeed-training.runsTrainPackage" -}}
{{- if and (not .Values.train.script) (eq .Values.train.module "train") }}true{{ end }}
{{- end }}

{{/*
The arguments that give the program the chart's paths (and, to a Trainer, the collective timeout), in its
convention (train.argsConvention), as a JSON list: files/generated/conventions.json, generated from
train/conventions.py, which owns each convention. They come after train.args (programCommand), so that argparse's
last-occurrence rule keeps the chart's values whatever spelling train.args used; validateProgram also refuses those
spellings there.
*/}}
{{- define "deepspeed-training.conventionArgs" -}}
{{- $values := include "deepspeed-training.programPaths" . | fromJson }}
{{- $_ := set $values "collective_timeout_s" (mul (int .Values.deepspeed.collectiveTimeoutMinutes) 60 | toString) }}
{{- $_ := set $values "per_worker_storage" (eq (include "deepspeed-training.checkpointStorage" .) "per-worker" | toString) }}
{{- $convention := get (include "deepspeed-training.conventions" . | fromJson) .Values.train.argsConvention }}
{{- $args := list }}
{{- range $convention.passes }}
{{- $option := index . 0 }}
{{- $value := index . 1 }}
{{- if not $value }}
{{- $args = append $args $option }}
{{- else if eq (index . 2) "=" }}
{{- $args = append $args (printf "%s=%s" $option (get $values $value)) }}
{{- else }}
{{- $args = concat $args (list $option (get $values $value)) }}
{{- end }}
{{- end }}
{{- toJson $args }}
{{- end }}

{{- define "deepspeed-training.conventions" -}}
{{- (.Files.Get "files/generated/conventions.json" | fromJson).conventions | toJson }}
{{- end }}

{{/*
The program every rank runs and its arguments, as a JSON list, as Python takes them: the module (`-m M`) or script,
train.args with the placeholders {ds_config} {train_config} {checkpoint_dir} {data_dir} replaced, then the chart's
paths in the program's convention (last: argparse keeps the last occurrence). All of it reaches the remote shell.
*/}}
{{- define "deepspeed-training.programCommand" -}}
{{- $paths := include "deepspeed-training.programPaths" . | fromJson }}
{{- $train := .Values.train }}
{{- $command := ternary (list $train.script) (list "-m" $train.module) (ne $train.script "") }}
{{- range $train.args }}
{{- $arg := . }}
{{- range $name, $path := $paths }}
{{- $arg = replace (printf "{%s}" $name) $path $arg }}
{{- end }}
{{- $command = append $command $arg }}
{{- end }}
{{- $command = concat $command (include "deepspeed-training.conventionArgs" . | fromJsonArray) }}
{{- toJson $command }}
{{- end }}

{{/*
The `deepspeed` command. ssh (the launcher): pdsh over SSH to the hostfile's workers. nossh (every worker):
this node only; the worker's attempt loop (podruntime/nosshmode.py) adds `--node_rank=<the Job completion index>`. Then the program, which
DeepSpeed's launcher starts through files/rank-log.py: every line a rank writes carries its rank and attempt.
*/}}
{{- define "deepspeed-training.launchCommand" -}}
{{- $command := list "deepspeed" (printf "--hostfile=%s/hostfile" (include "deepspeed-training.configDir" .)) }}
{{- if eq .Values.launchMode "ssh" }}
{{- /* --no_ssh_check: the launcher's meeting (podruntime/sshmode.py) has checked SSH to every worker.
       --force_multi: always over pdsh, also with one worker: never run ranks in the launcher pod. */}}
{{- $command = concat $command (list "--launcher=pdsh" (printf "--ssh_port=%d" (int .Values.ssh.port)) "--no_ssh_check" "--force_multi") }}
{{- with .Values.launcher.autotuning }}
{{- $command = append $command (printf "--autotuning=%s" .) }}
{{- end }}
{{- else }}
{{- /* --no_ssh needs --master_addr: without it DeepSpeed still runs `ssh <host0> hostname -I`. */}}
{{- $command = append $command "--no_ssh" }}
{{- end }}
{{- $command = concat $command (list
  (printf "--master_addr=%s" (include "deepspeed-training.workerHost" (dict "root" . "index" 0)))
  (printf "--master_port=%d" (int .Values.deepspeed.masterPort))) }}
{{- $rankLog := printf "%s/rank-log.py" (include "deepspeed-training.scriptsDir" .) }}
{{- toJson (concat $command .Values.deepspeed.runnerArgs (list $rankLog) (include "deepspeed-training.programCommand" . | fromJsonArray)) }}
{{- end }}

{{/* The run-state protocol's constants the templates need: files/generated/protocol.json, generated from
podruntime/protocol.py. */}}
{{- define "deepspeed-training.podstate" -}}
{{- .Files.Get "files/generated/protocol.json" }}
{{- end }}

{{/* The run-state protocol version the chart's pod scripts speak: the ranks and the config check refuse another. */}}
{{- define "deepspeed-training.protocolEnv" -}}
{{- $podstate := include "deepspeed-training.podstate" . | fromJson }}
- name: {{ $podstate.protocolEnv }}
  value: {{ $podstate.version | int | quote }}
{{- end }}

{{/* Job settings shared by the launcher Job (ssh) and the workers' Job (nossh). */}}
{{- define "deepspeed-training.jobPolicy" -}}
{{- $podstate := include "deepspeed-training.podstate" .root | fromJson }}
backoffLimit: {{ .root.Values.job.backoffLimit | int }}
# A new pod starts only once the failed one is gone, so its clean-up cannot hit the next attempt's ranks.
podReplacementPolicy: Failed
podFailurePolicy:
  rules:
    # Evictions and preemptions do not count against backoffLimit: the next pod resumes from a checkpoint.
    - action: Ignore
      onPodConditions:
        - type: DisruptionTarget
          status: "True"
    # Exit status 2 is a configuration error (bad arguments or input files): a retry would fail the same way.
    # 3: the ledger stopped the job (podruntime/ledger.py: the budget spent across pods, a stop rule).
    # Both exit-code rules name the main container: a native sidecar's exit codes would match them too.
    - action: FailJob
      onExitCodes:
        containerName: {{ .container | quote }}
        operator: In
        values: [{{ $podstate.exitConfigError | int }}, {{ $podstate.exitNotRetried | int }}]
    # 143: the pod stopped on SIGTERM (a deletion, an upgrade, a preemption without a DisruptionTarget): the
    # pod scripts marked its attempt a preemption, and neither budget is spent.
    - action: Ignore
      onExitCodes:
        containerName: {{ .container | quote }}
        operator: In
        values: [{{ $podstate.exitStopped | int }}]
{{- with .root.Values.job.activeDeadlineSeconds }}
activeDeadlineSeconds: {{ . | int }}
{{- end }}
{{- if not (kindIs "invalid" .root.Values.job.ttlSecondsAfterFinished) }}
ttlSecondsAfterFinished: {{ .root.Values.job.ttlSecondsAfterFinished | int }}
{{- end }}
{{- end }}
