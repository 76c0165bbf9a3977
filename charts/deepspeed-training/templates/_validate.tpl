{{/*
Checks that values.schema.json cannot express, run by templates/validate.yaml before anything renders.
Each `fail` names the key and says what was expected: a mistake stops at `helm template`/`install`,
never at the API server or on a rank after the GPUs are allocated.
*/}}
{{- define "deepspeed-training.validate" -}}
{{- include "deepspeed-training.validateNames" . }}
{{- include "deepspeed-training.validateEnv" . }}
{{- include "deepspeed-training.validateMounts" . }}
{{- include "deepspeed-training.validateLabels" . }}
{{- include "deepspeed-training.validateProgram" . }}
{{- include "deepspeed-training.validateDsConfig" . }}
{{- include "deepspeed-training.validateCheckpointStorage" . }}
{{- include "deepspeed-training.validateObjectStore" . }}
{{- include "deepspeed-training.validateLaunchMode" . }}
{{- include "deepspeed-training.validateResources" . }}
{{- with .Values.scheduling }}
{{- if and .volcano.enabled .schedulerName (ne .schedulerName "volcano") }}
{{- fail (printf "scheduling.volcano.enabled puts the pods in a Volcano PodGroup, but scheduling.schedulerName is %q: only the volcano scheduler honours it (leave schedulerName empty or set it to volcano)" .schedulerName) }}
{{- end }}
{{- if and .volcano.enabled .gangScheduling }}
{{- fail "scheduling.gangScheduling and scheduling.volcano.enabled are two gang schedulers for the same pods; choose one" }}
{{- end }}
{{- if ne (empty .kueueTopology.mode) (empty .kueueTopology.level) }}
{{- fail (printf "scheduling.kueueTopology: mode %q and level %q go together: set both (mode required or preferred, level a node label such as cloud.provider.com/topology-rack) or neither" .kueueTopology.mode .kueueTopology.level) }}
{{- end }}
{{- if and .kueueTopology.mode (not .kueueQueueName) }}
{{- fail "scheduling.kueueTopology needs scheduling.kueueQueueName: only Kueue reads the topology request" }}
{{- end }}
{{- end }}
{{- if include "deepspeed-training.scalesDownWorkers" . }}
{{- if not .Values.serviceAccount.create }}
{{- fail (printf "launcher.scaleDownWorkers needs the release's own ServiceAccount (serviceAccount.create: true): the chart binds its Roles to no other account, since every pod that runs as a shared one (%q) would get the right to scale this release's workers to 0; set launcher.scaleDownWorkers: false (the workers then stay up after success until helm uninstall)" (.Values.serviceAccount.name | default "default")) }}
{{- else if not .Values.progress.enabled }}
{{- fail "launcher.scaleDownWorkers: the progress sidecar scales the workers down (the only container with a token: the launcher runs the tenant's image); set progress.enabled: true, or launcher.scaleDownWorkers: false" }}
{{- end }}
{{- end }}
{{- $config := include (print $.Template.BasePath "/configmap.yaml") . | fromYaml }}
{{- if gt (len (toJson $config.data)) 1000000 }}
{{- fail (printf "the config ConfigMap (ds_config, train config, hostfile of %d workers) would be %d bytes; Kubernetes stores at most 1 MiB: use fewer workers or move large settings into a file on the data volume" (int .Values.worker.replicas) (len (toJson $config.data))) }}
{{- end }}
{{- $relaxations := include "deepspeed-training.securityRelaxations" . | trim }}
{{- if and $relaxations (not .Values.allowSecurityRelaxations) }}
{{- fail (printf "these values relax the chart's security defaults (restricted Pod Security, NetworkPolicy): %s. Set allowSecurityRelaxations: true to accept them; `make plan` and the dry run then list them as warnings" (splitList "\n" $relaxations | join "; ")) }}
{{- end }}
{{- end }}

{{/* What each launch mode needs of the other values. */}}
{{- define "deepspeed-training.validateLaunchMode" -}}
{{- if le (int .Values.deepspeed.masterPort) 1024 }}
{{- fail (printf "deepspeed.masterPort: %d leaves no unprivileged port for the attempt loop's channel (the port below it); use a port above 1024" (int .Values.deepspeed.masterPort)) }}
{{- end }}
{{- $taken := dict (toString (int .Values.deepspeed.masterPort)) "deepspeed.masterPort" }}
{{- $_ := set $taken (include "deepspeed-training.channelPort" .) "the attempt loop's channel port (deepspeed.masterPort - 1)" }}
{{- if include "deepspeed-training.peerCopy" . }}
{{- if le (int (include "deepspeed-training.peerCopyPort" .)) 1024 }}
{{- fail (printf "deepspeed.masterPort: %d leaves no unprivileged port for the peer copy of checkpoints (deepspeed.masterPort - 2, on per-worker volumes); use a port above 1026, or checkpoints.peerCopy: false" (int .Values.deepspeed.masterPort)) }}
{{- end }}
{{- $_ := set $taken (include "deepspeed-training.peerCopyPort" .) "the peer copy's port (deepspeed.masterPort - 2)" }}
{{- end }}
{{- if eq .Values.launchMode "ssh" }}
{{- with get $taken (toString (int .Values.ssh.port)) }}
{{- fail (printf "ssh.port: %d is also %s: every worker listens on both; use another port" (int $.Values.ssh.port) .) }}
{{- end }}
{{- $_ := set $taken (toString (int .Values.ssh.port)) "ssh.port" }}
{{- end }}
{{- if .Values.progress.enabled }}
{{- with get $taken (toString (int .Values.progress.metricsPort)) }}
{{- fail (printf "progress.metricsPort: %d is also %s: the pods listen on both; use another port" (int $.Values.progress.metricsPort) .) }}
{{- end }}
{{- end }}
{{- if eq .Values.launchMode "ssh" }}
{{- $fanOut := (.Files.Get "files/generated/deepspeed.json" | fromJson).pdshMaxFanOut | int }}
{{- if gt (int .Values.worker.replicas) $fanOut }}
{{- fail (printf "worker.replicas: %d workers in launchMode ssh; DeepSpeed's pdsh runner starts at most %d hosts at once and each host's session lasts the whole run, so the rest would never start (use launchMode nossh, which has no such limit)" (int .Values.worker.replicas) $fanOut) }}
{{- end }}
{{- with .Values.launcher.autotuning }}
{{- if not (has $.Values.train.argsConvention (list "deepspeed" "huggingface")) }}
{{- fail (printf "launcher.autotuning: DeepSpeed's autotuner finds the ds_config after --deepspeed_config or --deepspeed and hands every experiment its own copy there; train.argsConvention %q passes it otherwise (use deepspeed or huggingface, with a program that reads it from there)" $.Values.train.argsConvention) }}
{{- end }}
{{- if not $.Values.train.script }}
{{- fail "launcher.autotuning: DeepSpeed's autotuner drops --module from its experiments; set train.script to the program's file" }}
{{- end }}
{{- end }}
{{- else }}
{{- if .Values.launcher.autotuning }}
{{- fail "launcher.autotuning needs launchMode ssh: DeepSpeed's autotuner starts every experiment over SSH (pdsh)" }}
{{- end }}
{{- $lastHost := printf "%s-%d" (include "deepspeed-training.workerPodPrefix" .) (sub (int .Values.worker.replicas) 1) }}
{{- if gt (len $lastHost) 63 }}
{{- fail (printf "launchMode nossh: worker host name %q (the Job's name, revision and index) is longer than the 63 characters of a DNS label; shorten the release name or set fullnameOverride" $lastHost) }}
{{- end }}
{{- end }}
{{- end }}

{{/* Resource names: the headless Service needs a DNS-1035 label; host names reach the remote shell. */}}
{{- define "deepspeed-training.validateNames" -}}
{{- $fullname := include "deepspeed-training.fullname" . }}
{{- if not (regexMatch "^[a-z]([-a-z0-9]*[a-z0-9])?$" $fullname) }}
{{- fail (printf "release name %q with nameOverride/fullnameOverride gives resource names %q: they must start with a lower-case letter and hold only lower-case letters, digits and '-' (the headless Service's name is a DNS-1035 label)" .Release.Name $fullname) }}
{{- end }}
{{- if not (regexMatch "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$" .Release.Namespace) }}
{{- fail (printf "namespace %q: expected a DNS-1123 label (lower-case letters, digits and '-')" .Release.Namespace) }}
{{- end }}
{{- include "deepspeed-training.shellSafe" (dict "key" "deepspeed.masterAddr (from the release, namespace and clusterDomain)" "value" (include "deepspeed-training.workerHost" (dict "root" . "index" 0)) "context" "bare") }}
{{- end }}

{{/*
Env names the chart, its pod scripts or DeepSpeed's launcher set (a user value would override them silently, or
be overridden by them), and those that make the ranks' shells run code or parse commands differently: the
chart's in files/reserved-env.json, DeepSpeed's generated from train/deepspeed_mirror.py.
*/}}
{{- define "deepspeed-training.reservedEnvNames" -}}
{{- $names := dict }}
{{- range (.Files.Get "files/generated/deepspeed.json" | fromJson).launcherEnv }}
{{- $_ := set $names . "set by DeepSpeed's launcher" }}
{{- end }}
{{- range $who, $list := omit (.Files.Get "files/reserved-env.json" | fromJson) "why" }}
{{- range $list }}
{{- $_ := set $names . $who }}
{{- end }}
{{- end }}
{{- $names | toJson }}
{{- end }}

{{- define "deepspeed-training.validateEnv" -}}
{{- $reserved := include "deepspeed-training.reservedEnvNames" . | fromJson }}
{{- /* envFrom's keys are unknown here: its prefix must keep every name it makes off the reserved ones. */}}
{{- range $i, $e := .Values.worker.extraEnvFrom }}
{{- $prefix := toString ($e.prefix | default "") }}
{{- range $name, $who := $reserved }}
{{- if hasPrefix $prefix $name }}
{{- fail (printf "worker.extraEnvFrom[%d].prefix %q: with it a key of the ConfigMap or Secret could form %s, which is %s; use a prefix no such name starts with (e.g. APP_)" $i $prefix $name $who) }}
{{- end }}
{{- end }}
{{- end }}
{{- $seen := dict }}
{{- range $key, $entries := dict "env" .Values.env "worker.extraEnv" .Values.worker.extraEnv }}
{{- range $i, $e := $entries }}
{{- $where := printf "%s[%d] (%s)" $key $i $e.name }}
{{- if hasKey $reserved (toString $e.name) }}
{{- fail (printf "%s: %s is %s; choose another name" $where $e.name (get $reserved (toString $e.name))) }}
{{- end }}
{{- if hasKey $seen $e.name }}
{{- fail (printf "%s: %s is already set by %s; each env name once" $where $e.name (get $seen $e.name)) }}
{{- end }}
{{- $_ := set $seen $e.name $where }}
{{- if and (hasKey $e "value") (hasKey $e "valueFrom") }}
{{- fail (printf "%s: set value or valueFrom, not both" $where) }}
{{- end }}
{{- if hasKey $e "value" }}
{{- if regexMatch "(?i)(^|_)(TOKEN|SECRET|PASSWORD|PASSWD|PASSPHRASE|APIKEY|CREDENTIALS?)(_|$)|(^|_)(API|ACCESS|PRIVATE|SECRET)_KEY(_|$)" $e.name }}
{{- fail (printf "%s: a plain value for a secret-looking name lands in a ConfigMap and in DeepSpeed's logged command line; use valueFrom.secretKeyRef" $where) }}
{{- end }}
{{- if eq $key "env" }}
{{- include "deepspeed-training.shellSafe" (dict "key" (printf "%s: value" $where) "value" $e.value "context" "quoted") }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/* Volumes and mounts: one volume per name, one mount per path, every mount names a volume. */}}
{{- define "deepspeed-training.validateMounts" -}}
{{- $volumes := dict "config" "(chart)" "scripts" "(chart)" "ssh-keys" "(chart)" "home" "(chart)" "tmp" "(chart)" "dshm" "(chart)" "checkpoints" "(chart)" "data" "(chart)" "progress-token" "(chart)" }}
{{- range $i, $v := .Values.worker.extraVolumes }}
{{- if hasKey $volumes $v.name }}
{{- fail (printf "worker.extraVolumes[%d]: volume name %q is taken (the chart's volumes: config, scripts, ssh-keys, home, tmp, dshm, checkpoints, data, progress-token; or an earlier extraVolume)" $i $v.name) }}
{{- end }}
{{- $_ := set $volumes $v.name (printf "worker.extraVolumes[%d]" $i) }}
{{- end }}
{{- $mounts := dict }}
{{- $paths := list (list "(chart) config" (include "deepspeed-training.configDir" .)) (list "(chart) scripts" (include "deepspeed-training.scriptsDir" .)) (list "(chart) ssh keys" (include "deepspeed-training.keysDir" .)) (list "image.homeDir" .Values.image.homeDir) (list "(chart) /tmp" "/tmp") (list "(chart) /dev/shm" "/dev/shm") (list "checkpoints.mountPath" .Values.checkpoints.mountPath) }}
{{- if .Values.data.existingClaim }}
{{- $paths = append $paths (list "data.mountPath" .Values.data.mountPath) }}
{{- end }}
{{- range $i, $m := .Values.worker.extraVolumeMounts }}
{{- $paths = append $paths (list (printf "worker.extraVolumeMounts[%d].mountPath" $i) $m.mountPath) }}
{{- if not (hasKey $volumes $m.name) }}
{{- fail (printf "worker.extraVolumeMounts[%d]: no volume named %q (add it to worker.extraVolumes)" $i $m.name) }}
{{- end }}
{{- if eq (get $volumes $m.name) "(chart)" }}
{{- fail (printf "worker.extraVolumeMounts[%d]: %q is a volume the chart mounts itself (a second mount of checkpoints would show the whole claim, not the release's own directory); mount only worker.extraVolumes" $i $m.name) }}
{{- end }}
{{- end }}
{{- include "deepspeed-training.validateCheckpointClaim" . }}
{{- range $paths }}
{{- $path := clean (index . 1) }}
{{- if and (not (hasPrefix "(chart)" (index . 0))) (regexMatch "^/(etc|usr|bin|sbin|lib|lib32|lib64|libx32|proc|sys|dev|run|var/run|boot|opt/venv)(/|$)|^/(opt|var)$" $path) }}
{{- fail (printf "%s: %s would hide a system directory of the image (/etc, /usr, /bin, /lib, /proc, /sys, /dev, /run, /opt/venv ...) and break every pod; choose another path" (index . 0) $path) }}
{{- end }}
{{- if hasKey $mounts $path }}
{{- fail (printf "%s and %s both mount at %s; each mount needs its own path" (get $mounts $path) (index . 0) $path) }}
{{- end }}
{{- $_ := set $mounts $path (index . 0) }}
{{- end }}
{{- end }}

{{/*
The checkpoint claim is shared by releases: it is mounted only at the release's own directory (subPath), so no
other value may mount it, and another release's directory only read-only through checkpoints.resumeFrom.
*/}}
{{- define "deepspeed-training.validateCheckpointClaim" -}}
{{- $claim := .Values.checkpoints.existingClaim }}
{{- if and $claim (eq .Values.data.existingClaim $claim) }}
{{- fail (printf "data.existingClaim: %q is the checkpoint claim (checkpoints.existingClaim), which releases share: a pod mounts only its release's directory of it" $claim) }}
{{- end }}
{{- range $i, $v := .Values.worker.extraVolumes }}
{{- if and $claim $v.persistentVolumeClaim (eq (toString $v.persistentVolumeClaim.claimName) $claim) }}
{{- fail (printf "worker.extraVolumes[%d] (%s): %q is the checkpoint claim (checkpoints.existingClaim), which releases share: a pod mounts only its release's directory of it" $i $v.name $claim) }}
{{- end }}
{{- end }}
{{- with .Values.checkpoints.resumeFrom }}
{{- if not $claim }}
{{- fail (printf "checkpoints.resumeFrom %q names a release's directory on the checkpoint claim: set checkpoints.existingClaim (the claim both releases use)" .) }}
{{- end }}
{{- if eq . (include "deepspeed-training.checkpointSubPath" $) }}
{{- fail (printf "checkpoints.resumeFrom %q is this release's own directory, which it resumes anyway; leave it empty" .) }}
{{- end }}
{{- end }}
{{- if and .Values.launcher.autotuning (not $claim) }}
{{- fail "launcher.autotuning: the autotuner in the launcher pod reads the results that the ranks write on the workers; set checkpoints.existingClaim (a ReadWriteMany PVC the launcher mounts too)" }}
{{- end }}
{{- end }}

{{/*
Labels and annotations the chart sets or that decide isolation, scheduling or security: values may not set
them (a later duplicate key would win and move a pod out of its release or into another's).
*/}}
{{- define "deepspeed-training.validateLabels" -}}
{{- $maps := dict "global.nodeSelector" .Values.global.nodeSelector "worker.nodeSelector" .Values.worker.nodeSelector "launcher.nodeSelector" .Values.launcher.nodeSelector "worker.podLabels" .Values.worker.podLabels "launcher.podLabels" .Values.launcher.podLabels "worker.podAnnotations" .Values.worker.podAnnotations "launcher.podAnnotations" .Values.launcher.podAnnotations "serviceAccount.annotations" .Values.serviceAccount.annotations }}
{{- range $i, $peer := .Values.progress.metricsFrom }}
{{- range $selector, $value := $peer }}
{{- $_ := set $maps (printf "progress.metricsFrom[%d].%s.matchLabels" $i $selector) $value.matchLabels }}
{{- end }}
{{- end }}
{{- range $where, $map := $maps }}
{{- range $key, $_ := $map }}
{{- if or (gt (len $key) 316) (not (regexMatch "^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$" $key)) }}
{{- fail (printf "%s: key %q is not a Kubernetes label/annotation name ([prefix/]name of letters, digits and -_.)" $where $key) }}
{{- end }}
{{- end }}
{{- end }}
{{- range $component := list "worker" "launcher" }}
{{- $values := index $.Values $component }}
{{- range $key, $_ := $values.podLabels }}
{{- if or (regexMatch "^(app\\.kubernetes\\.io|helm\\.sh|kueue\\.x-k8s\\.io|scheduling\\.k8s\\.io|volcano\\.sh)/" $key) (regexMatch "(^|\\.)(kubernetes|k8s)\\.io/" $key) (has $key (list "controller-revision-hash" "job-name" "controller-uid")) }}
{{- fail (printf "%s.podLabels: %q is reserved (the chart's selector and isolation labels, Kubernetes' and the schedulers' own)" $component $key) }}
{{- end }}
{{- end }}
{{- range $key, $_ := $values.podAnnotations }}
{{- if or (regexMatch "^(checksum|deepspeed-training|kueue\\.x-k8s\\.io|scheduling\\.k8s\\.io|volcano\\.sh)/" $key) (regexMatch "(^|\\.)security\\.(alpha|beta)\\.kubernetes\\.io/" $key) }}
{{- fail (printf "%s.podAnnotations: %q is reserved (the chart's checksums, gang scheduling and pod security annotations)" $component $key) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/*
The program and the runner flags reach the remote shell (see shellSafe). Which ds_config runs, where checkpoints go,
the collective timeout and each rank's device are the chart's: train.args may not name what the program's parser
takes for them, in any spelling or abbreviation (files/generated/conventions.json, generated from the parsers by
train/conventions.py; the chart's own options come last anyway), nor end the options with `--` (the chart's would
become positional arguments), nor may the train config name its own paths.
*/}}
{{- define "deepspeed-training.validateProgram" -}}
{{- $owned := (get (include "deepspeed-training.conventions" . | fromJson) .Values.train.argsConvention).owned }}
{{- range $i, $arg := .Values.train.args }}
{{- include "deepspeed-training.shellSafe" (dict "key" (printf "train.args[%d]" $i) "value" (regexReplaceAll "\\{(ds_config|train_config|checkpoint_dir|data_dir)\\}" $arg "") "context" "bare") }}
{{- if eq $arg "--" }}
{{- fail (printf "train.args[%d]: \"--\" ends the program's options: the chart's own (its ds_config, checkpoint dir and timeout, passed after train.args) would become positional arguments; remove it" $i) }}
{{- end }}
{{- $name := regexReplaceAll "=.*$" $arg "" }}
{{- if and (hasPrefix "--" $name) (gt (len $name) 2) }}
{{- range $owned }}
{{- if hasPrefix $name . }}
{{- fail (printf "train.args[%d]: %q sets %s, which the chart owns for train.argsConvention %q (the program's parser takes it in this spelling or abbreviation): the ds_config is deepspeed.config, the checkpoint dir is the release's own (checkpoints.mountPath), the collective timeout is deepspeed.collectiveTimeoutMinutes and --local_rank is DeepSpeed's launcher's; remove it" $i $arg . $.Values.train.argsConvention) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- $train := .Values.train }}
{{- $package := include "deepspeed-training.runsTrainPackage" . }}
{{- if and $package (ne $train.argsConvention "train") }}
{{- fail (printf "train.argsConvention %q: the train package (train.module train) takes its paths only as --ds-config, --config and --checkpoint-dir (argsConvention train); set train.script or train.module to the program that takes the %s arguments" $train.argsConvention $train.argsConvention) }}
{{- end }}
{{- if and $package $train.fillsDsConfigAuto }}
{{- fail "train.fillsDsConfigAuto: the train package never fills \"auto\" in the ds_config; give its values (only Hugging Face Trainer or Accelerate programs fill them)" }}
{{- end }}
{{- if not .Values.data.existingClaim }}
{{- $data := printf "%s/" (clean .Values.data.mountPath) }}
{{- $dataPath := "" }}
{{- if and (eq $train.argsConvention "train") (kindIs "map" $train.config) (kindIs "map" $train.config.data) }}
{{- $dataPath = toString ($train.config.data.path | default "") }}
{{- end }}
{{- range $where, $path := dict "train.script" $train.script "train.config.data.path" $dataPath }}
{{- if hasPrefix $data (toString $path) }}
{{- fail (printf "%s %q is under data.mountPath %s, but data.existingClaim is empty, so nothing is mounted there: set data.existingClaim" $where $path (clean $.Values.data.mountPath)) }}
{{- end }}
{{- end }}
{{- range $i, $arg := $train.args }}
{{- if contains "{data_dir}" $arg }}
{{- fail (printf "train.args[%d] %q names {data_dir}, but data.existingClaim is empty, so nothing is mounted there: set data.existingClaim" $i $arg) }}
{{- end }}
{{- end }}
{{- end }}
{{- if and (eq .Values.train.argsConvention "train") (kindIs "map" .Values.train.config) }}
{{- range $key := list "checkpoint_dir" "ds_config" }}
{{- if hasKey $.Values.train.config $key }}
{{- fail (printf "train.config.%s: set by the chart (--%s=%s, which would override it): the ds_config is deepspeed.config and the checkpoint dir is the release's own (checkpoints.mountPath); remove the key" $key (replace "_" "-" $key) (get (include "deepspeed-training.programPaths" $ | fromJson) $key)) }}
{{- end }}
{{- end }}
{{- end }}
{{- include "deepspeed-training.shellSafe" (dict "key" "train.script" "value" .Values.train.script "context" "bare") }}
{{- $allowed := include "deepspeed-training.userRunnerFlags" . | fromJson }}
{{- range $i, $arg := .Values.deepspeed.runnerArgs }}
{{- $flag := regexReplaceAll "=.*$" $arg "" }}
{{- if not (hasKey $allowed $flag) }}
{{- fail (printf "deepspeed.runnerArgs[%d]: %q is not a runner flag values may set; allowed: %s (the chart sets the hostfile, launcher, ports, master address and program itself)" $i $arg (keys $allowed | sortAlpha | join ", ")) }}
{{- end }}
{{- if not (regexMatch (get $allowed $flag) $arg) }}
{{- fail (printf "deepspeed.runnerArgs[%d]: %q: expected the form %s" $i $arg (get $allowed $flag)) }}
{{- end }}
{{- include "deepspeed-training.shellSafe" (dict "key" (printf "deepspeed.runnerArgs[%d]" $i) "value" $arg "context" "bare") }}
{{- if and (hasPrefix "--bind_core_list" $arg) (not (has "--bind_cores_to_rank" $.Values.deepspeed.runnerArgs)) }}
{{- fail (printf "deepspeed.runnerArgs[%d]: %s takes effect only with --bind_cores_to_rank, which is not set (DeepSpeed ignores it otherwise)" $i $arg) }}
{{- end }}
{{- end }}
{{- end }}

{{/*
`deepspeed` runner flags values may pass, each with the pattern its whole argument must match (what DeepSpeed's
parser accepts). Left out on purpose: what the chart
sets (--hostfile, --launcher, --ssh_port, --master_addr, --master_port, --module, --no_ssh*), what would run
on fewer ranks than workers x gpusPerWorker (--include, --exclude, --num_nodes, --num_gpus) and what DeepSpeed
pastes into the remote shell as code (--launcher_args, --venv_script).
*/}}
{{- define "deepspeed-training.userRunnerFlags" -}}
{{- dict "--bind_cores_to_rank" "^--bind_cores_to_rank$" "--bind_core_list" "^--bind_core_list=[0-9][0-9,-]*$" "--enable_each_rank_log" "^--enable_each_rank_log=(/[A-Za-z0-9_-][A-Za-z0-9._-]*)+$" "--no_local_rank" "^--no_local_rank$" "--save_pid" "^--save_pid$" "--log_level" "^--log_level=(debug|info|warning|error|critical)$" "--quiet" "^--quiet$" "--force_multi" "^--force_multi$" | toJson }}
{{- end }}

{{/*
What the chart owns of the ds_config: that it renders as JSON, and the autotuner's paths. Its top-level keys are
refused here too, from a copy generated from train/deepspeed_mirror.py (files/generated/deepspeed.json), so that
`helm template` catches the commonest silent mistake. Every other ds_config rule (batch over data-parallel ranks,
"auto", pipeline stages, optimizer and scheduler) is train/'s: the glue runs it before deploying, the config check
hook (templates/config-check.yaml) before `helm install` creates anything else, and every rank at start.
*/}}
{{- define "deepspeed-training.validateDsConfig" -}}
{{- $config := .Values.deepspeed.config }}
{{- if $config }}
{{- if not (toJson $config) }}
{{- fail "deepspeed.config: cannot be written as JSON (NaN or Infinity?): use plain numbers" }}
{{- end }}
{{- with $config.autotuning }}
{{- range $key := list "enabled" "results_dir" "exps_dir" "metric_path" "model_info_path" }}
{{- if and (kindIs "map" $.Values.deepspeed.config.autotuning) (hasKey $.Values.deepspeed.config.autotuning $key) }}
{{- fail (printf "deepspeed.config.autotuning.%s: set by the chart (launcher.autotuning switches the tuner on; its files stay in the release's checkpoint directory, since it deletes exps_dir at start with overwrite); remove the key" $key) }}
{{- end }}
{{- end }}
{{- end }}
{{- $known := (.Files.Get "files/generated/deepspeed.json" | fromJson).topLevelKeys }}
{{- range $key, $_ := $config }}
{{- if not (has $key $known) }}
{{- fail (printf "deepspeed.config: unknown top-level key %q; DeepSpeed would silently ignore it. Known keys: %s" $key (join ", " $known)) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/* What per-worker checkpoint volumes (several workers, no shared claim: checkpointStorage) need of the program and
its ds_config; train/checkpoint.py check_storage checks the parallel layout. */}}
{{- define "deepspeed-training.validateCheckpointStorage" -}}
{{- $config := .Values.deepspeed.config | default dict }}
{{- if and (kindIs "map" $config.checkpoint) (hasKey $config.checkpoint "use_node_local_storage") }}
{{- $local := $config.checkpoint.use_node_local_storage }}
{{- if and (eq (include "deepspeed-training.checkpointStorage" .) "per-worker") (not $local) }}
{{- fail (printf "deepspeed.config.checkpoint.use_node_local_storage: %v, but each worker keeps its checkpoints on its own volume (worker.replicas %d, no checkpoints.existingClaim): every worker must write the model states its ranks load; remove the key, the chart sets it" $local (int .Values.worker.replicas)) }}
{{- end }}
{{- if and .Values.checkpoints.existingClaim (gt (int .Values.worker.replicas) 1) $local }}
{{- fail (printf "deepspeed.config.checkpoint.use_node_local_storage: %v with a shared claim (checkpoints.existingClaim): every worker would write the same model-state files into one directory; remove the key" $local) }}
{{- end }}
{{- end }}
{{- end }}

{{/* The object store (checkpoints.objectStore): its credentials reach only the platform's containers, so it needs
the progress sidecar in the platform's image, and nothing of the tenant's may name its Secret. */}}
{{- define "deepspeed-training.validateObjectStore" -}}
{{- with .Values.checkpoints.objectStore }}
{{- if .bucket }}
{{- if not .endpoint }}
{{- fail (printf "checkpoints.objectStore.endpoint: empty, but bucket %q is set: give the store's URL (https://host[:port])" .bucket) }}
{{- end }}
{{- if not .credentialsSecret }}
{{- fail "checkpoints.objectStore.credentialsSecret: empty: name the Secret with AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY" }}
{{- end }}
{{- if or (not $.Values.progress.enabled) (not $.Values.progress.image) }}
{{- fail "checkpoints.objectStore needs progress.enabled and progress.image: the uploads and restores run in the platform's sidecar image, the only one that gets the bucket's credentials" }}
{{- end }}
{{- $secret := .credentialsSecret }}
{{- $named := list }}
{{- range $key, $entries := dict "env" $.Values.env "worker.extraEnv" $.Values.worker.extraEnv }}
{{- range $i, $e := $entries }}
{{- if and (kindIs "map" $e.valueFrom) (kindIs "map" $e.valueFrom.secretKeyRef) (eq (toString $e.valueFrom.secretKeyRef.name) $secret) }}
{{- $named = append $named (printf "%s[%d].valueFrom.secretKeyRef" $key $i) }}
{{- end }}
{{- end }}
{{- end }}
{{- range $i, $e := $.Values.worker.extraEnvFrom }}
{{- if and (kindIs "map" $e.secretRef) (eq (toString $e.secretRef.name) $secret) }}
{{- $named = append $named (printf "worker.extraEnvFrom[%d].secretRef" $i) }}
{{- end }}
{{- end }}
{{- range $i, $v := $.Values.worker.extraVolumes }}
{{- if and (kindIs "map" $v.secret) (eq (toString $v.secret.secretName) $secret) }}
{{- $named = append $named (printf "worker.extraVolumes[%d].secret" $i) }}
{{- end }}
{{- range $j, $source := ((($v.projected | default dict).sources) | default list) }}
{{- if and (kindIs "map" $source.secret) (eq (toString $source.secret.name) $secret) }}
{{- $named = append $named (printf "worker.extraVolumes[%d].projected.sources[%d].secret" $i $j) }}
{{- end }}
{{- end }}
{{- end }}
{{- if eq (toString $.Values.ssh.existingSecret) $secret }}
{{- $named = append $named "ssh.existingSecret" }}
{{- end }}
{{- with $named }}
{{- fail (printf "%s: names the object store's Secret %q (checkpoints.objectStore.credentialsSecret), whose keys only the platform's containers may hold" (first .) $secret) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/*
Every way these values relax the chart's security defaults, one line each naming the key. Empty for the
defaults. templates/validate.yaml refuses a non-empty list unless allowSecurityRelaxations is true; then
the pods carry it in an annotation and NOTES.txt, `make plan` and the dry run print it.
*/}}
{{- define "deepspeed-training.securityRelaxations" -}}
{{- $pod := .Values.podSecurityContext | default dict }}
{{- $container := .Values.securityContext | default dict }}
{{- if not .Values.networkPolicy.enabled }}
networkPolicy.enabled: false (any pod in the cluster may reach sshd and the rendezvous)
{{- end }}
{{- if ne (toString $pod.runAsNonRoot) "true" }}
podSecurityContext.runAsNonRoot is not true
{{- end }}
{{- if eq (toString $container.runAsNonRoot) "false" }}
securityContext.runAsNonRoot: false (the container may run as the image's user, root included)
{{- end }}
{{- range $key, $ctx := dict "podSecurityContext" $pod "securityContext" $container }}
{{- if and (hasKey $ctx "runAsUser") (eq (toString $ctx.runAsUser) "0") }}
{{ $key }}.runAsUser: 0 (root)
{{- end }}
{{- with $ctx.seccompProfile }}
{{- if not (has (toString .type) (list "RuntimeDefault" "Localhost")) }}
{{ $key }}.seccompProfile.type: {{ .type }}
{{- end }}
{{- end }}
{{- with $ctx.appArmorProfile }}
{{- if eq (toString .type) "Unconfined" }}
{{ $key }}.appArmorProfile.type: Unconfined
{{- end }}
{{- end }}
{{- with $ctx.seLinuxOptions }}
{{- if or .user .role (not (has (toString (.type | default "")) (list "" "container_t" "container_init_t" "container_kvm_t" "container_engine_t"))) }}
{{ $key }}.seLinuxOptions: custom user, role or type
{{- end }}
{{- end }}
{{- with $ctx.windowsOptions }}
{{- if .hostProcess }}
{{ $key }}.windowsOptions.hostProcess: true
{{- end }}
{{- end }}
{{- end }}
{{- if not (or $pod.seccompProfile $container.seccompProfile) }}
no seccompProfile (podSecurityContext.seccompProfile.type: RuntimeDefault)
{{- end }}
{{- with $pod.sysctls }}
podSecurityContext.sysctls: set
{{- end }}
{{- if $container.privileged }}
securityContext.privileged: true
{{- end }}
{{- if ne (toString $container.allowPrivilegeEscalation) "false" }}
securityContext.allowPrivilegeEscalation is not false
{{- end }}
{{- if ne (toString $container.readOnlyRootFilesystem) "true" }}
securityContext.readOnlyRootFilesystem is not true
{{- end }}
{{- if eq (toString $container.procMount) "Unmasked" }}
securityContext.procMount: Unmasked
{{- end }}
{{- $caps := $container.capabilities | default dict }}
{{- if not (has "ALL" ($caps.drop | default list)) }}
securityContext.capabilities.drop does not hold ALL
{{- end }}
{{- range $caps.add }}
{{- if ne . "NET_BIND_SERVICE" }}
securityContext.capabilities.add: {{ . }}
{{- end }}
{{- end }}
{{- /* A per-worker checkpoint claim is the release's own new volume: one that binds an existing volume or starts as
       a copy of another claim or snapshot reads data the release does not own. */}}
{{- range $key := list "selector" "dataSource" "dataSourceRef" }}
{{- if hasKey ($.Values.checkpoints.volumeClaimSpec | default dict) $key }}
checkpoints.volumeClaimSpec.{{ $key }}: a checkpoint volume made from storage the release does not own
{{- end }}
{{- end }}
{{- range $i, $v := .Values.worker.extraVolumes }}
{{- /* Projected sources are an allow-list of plain data: a service-account token, a pod certificate (a client
       certificate the API server takes as the pod's account) or any source a later Kubernetes adds is a credential. */}}
{{- range ((($v.projected | default dict).sources) | default list) }}
{{- range $source, $_ := . }}
{{- if eq $source "serviceAccountToken" }}
worker.extraVolumes[{{ $i }}] ({{ $v.name }}): a projected service-account token
{{- else if not (has $source (list "configMap" "secret" "downwardAPI" "clusterTrustBundle")) }}
worker.extraVolumes[{{ $i }}] ({{ $v.name }}): a projected {{ $source }} (a credential or a source the chart does not know: only configMap, secret, downwardAPI and clusterTrustBundle are plain data)
{{- end }}
{{- end }}
{{- end }}
{{- range $type, $_ := omit $v "name" }}
{{- if has $type (list "csi" "ephemeral" "persistentVolumeClaim") }}
worker.extraVolumes[{{ $i }}] ({{ $v.name }}): {{ $type }} volume (storage the chart does not scope to the release)
{{- else if not (has $type (list "configMap" "downwardAPI" "emptyDir" "projected" "secret")) }}
worker.extraVolumes[{{ $i }}] ({{ $v.name }}): {{ $type }} volume
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/*
Every resources map of the chart names only resources Kubernetes knows: a container's standard ones (cpu, memory,
ephemeral-storage, hugepages-<size>), on the ranks' containers also an extended resource (<domain>/<name>, outside
kubernetes.io: GPUs), and a volume claim's storage. A typo (`memroy`) would render and be refused by the API server
mid-install; a made-up bare name too; the sidecar runs no accelerator code.
*/}}
{{- define "deepspeed-training.validateResources" -}}
{{- $standard := "^(cpu|memory|ephemeral-storage|hugepages-[0-9]+(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?)$" }}
{{- $extended := "^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$" }}
{{- $maps := list (list "worker.resources" .Values.worker.resources true) (list "launcher.resources" .Values.launcher.resources true) (list "progress.resources" .Values.progress.resources false) }}
{{- range $map := $maps }}
{{- $where := index $map 0 }}
{{- $resources := index $map 1 | default dict }}
{{- range $kind := list "requests" "limits" }}
{{- range $name, $_ := (get $resources $kind) | default dict }}
{{- $isExtended := and (regexMatch $extended $name) (not (contains "kubernetes.io/" $name)) }}
{{- if not (or (regexMatch $standard $name) (and (index $map 2) $isExtended)) }}
{{- if index $map 2 }}
{{- fail (printf "%s.%s: %q is not a container resource Kubernetes knows: expected cpu, memory, ephemeral-storage, hugepages-<size> or an extended resource <domain>/<name> (e.g. nvidia.com/gpu)" $where $kind $name) }}
{{- else }}
{{- fail (printf "%s.%s: %q: the progress sidecar runs no accelerator code; expected cpu, memory or ephemeral-storage" $where $kind $name) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- $claim := (.Values.checkpoints.volumeClaimSpec | default dict).resources | default dict }}
{{- range $kind := list "requests" "limits" }}
{{- range $name, $_ := (get $claim $kind) | default dict }}
{{- if ne $name "storage" }}
{{- fail (printf "checkpoints.volumeClaimSpec.resources.%s: %q: a volume claim asks only for storage" $kind $name) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
