"""Runs the pods of a RENDERED chart as hosts on this machine, so the real chart is tested without a cluster.

Each pod the chart would create (every worker of the StatefulSet or of the Indexed Job, and the launcher)
becomes a "host":
- its own network namespace, with a veth into a private bridge that lives in a namespace of its own (nothing
  is added to the machine's own network), and addresses in 10.231.<n>.0/24, used only inside them;
- its own UTS and PID namespaces (the pod's hostname; `pkill` sees only the pod's processes), and a hosts
  file (/etc/netns/<ns>/hosts) that resolves `<pod>.<service>` and
  `<pod>.<service>.<namespace>.svc.<clusterDomain>` for every worker as cluster DNS does;
- its own mount namespace in which the pod's ConfigMap and Secret volumes appear at their mountPaths (files
  written from the rendered objects, honouring items and defaultMode), emptyDirs as fresh directories, and
  PersistentVolumeClaims as one shared directory per claim (the checkpoint PVC);
- the container's env, workingDir, command and args exactly as rendered, run as the pod's runAsUser.

The local Python environment stands in for the image: the chart's pods need nothing from the image but
PATH-resolvable programs (bash, sshd, ssh, ssh-keygen, pdsh, python, deepspeed) and take their scripts from
the ConfigMap, so the harness puts the venv first on PATH (and keeps this checkout visible in the pods, also
when it lies under a path the pod mounts over, such as /tmp). Not emulated: resource limits, probes,
readOnlyRootFilesystem (the image test covers it), NetworkPolicy. Needs root; cleans up every namespace,
mount point, file and process it made, also when a test fails.
"""

import base64
import fcntl
import functools
import json
import os
import pwd
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from podruntime.ranks import is_launcher

ROOT = Path(__file__).resolve().parents[2]
VENV_BIN = ROOT / ".venv" / "bin"


@functools.cache
def namespaces_available() -> str | None:
    """None when the harness can run here, else the reason it cannot."""
    if os.geteuid() != 0:
        return "needs root (network, UTS and mount namespaces)"
    for tool in ("ip", "unshare", "setpriv", "sshd", "pdsh"):
        if not shutil.which(tool) and not Path(f"/usr/sbin/{tool}").exists():
            return f"{tool} is not installed (make setup)"
    probe = subprocess.run(["unshare", "--net", "--uts", "--mount", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"namespaces are not permitted here: {probe.stderr.strip()}"
    probe = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", str(VENV_BIN / "python"),
                            "-c", "import deepspeed"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"the venv's python cannot run as an unprivileged user (pods run non-root): {probe.stderr[-300:]}"
    return None


def prebuilt_ops_for_pods(uid: int) -> Path:
    """The DeepSpeed ops `make setup` built, opened to the pods' unprivileged user (loading an op takes a lock
    file in its build dir; a copy elsewhere would be rebuilt, since the path is part of its hash)."""
    extensions = ROOT / ".build" / "torch_extensions"
    if not any(extensions.glob("*/deepspeed_shm_comm*.so")):
        raise RuntimeError(f"{extensions} has no prebuilt deepspeed_shm_comm op: run `make setup`")
    subprocess.run(["chmod", "-R", "a+rwX", str(extensions)], check=True)
    for parent in (extensions, extensions.parent):
        parent.chmod(parent.stat().st_mode | 0o755)
    return extensions


@dataclass
class Pod:
    name: str
    component: str
    hostname: str
    container: dict
    volumes: list[dict]
    uid: int
    gid: int
    fqdn: str = ""
    ip: str = ""
    netns: str = ""
    process: subprocess.Popen | None = None
    log_path: Path | None = None
    mounts: dict[str, Path] = field(default_factory=dict)
    attempt: int = 0
    controller_env: dict[str, str] = field(default_factory=dict)  # what the Job controller adds
    labels: dict[str, str] = field(default_factory=dict)  # the pod's, with those its controller adds

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path and self.log_path.exists() else ""


def pods_from_render(docs: list[dict]) -> list[Pod]:
    """The pods Kubernetes would create for the rendered StatefulSet and Jobs. An Indexed Job's pods get what
    its controller gives them: host name `<job>-<index>`, JOB_COMPLETION_INDEX, a record under `subdomain`."""
    pods = []
    for doc in docs:
        if doc["kind"] not in ("StatefulSet", "Job"):
            continue
        spec = doc["spec"]["template"]["spec"]
        security = spec.get("securityContext", {})
        uid, gid = security.get("runAsUser", 0), security.get("runAsGroup", security.get("runAsUser", 0))
        base, namespace = doc["metadata"]["name"], doc["metadata"]["namespace"]
        labels = dict(doc["spec"]["template"]["metadata"].get("labels", {}))
        if doc["kind"] == "Job":  # the Job controller's label: one uid per Job, also on its replacement pods
            labels["batch.kubernetes.io/controller-uid"] = str(uuid.uuid4())
        if doc["kind"] == "StatefulSet":
            for ordinal in range(doc["spec"]["replicas"]):
                name = f"{base}-{ordinal}"
                fqdn = f"{name}.{doc['spec']['serviceName']}.{namespace}.svc.cluster.local"
                pods.append(Pod(name, "worker", name, spec["containers"][0], spec["volumes"], uid, gid, fqdn,
                                labels={**labels, "apps.kubernetes.io/pod-index": str(ordinal)}))
        elif doc["spec"].get("completionMode") == "Indexed":
            component = doc["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]
            for index in range(doc["spec"]["completions"]):
                name = f"{base}-{index}"
                fqdn = f"{name}.{spec['subdomain']}.{namespace}.svc.cluster.local"
                pods.append(Pod(name, component, name, spec["containers"][0], spec["volumes"], uid, gid, fqdn,
                                controller_env={"JOB_COMPLETION_INDEX": str(index)},
                                labels={**labels, "batch.kubernetes.io/job-completion-index": str(index)}))
        else:  # the launcher, or the config check (a hook Job, which Helm runs before the others)
            name = f"{base}-{uuid.uuid4().hex[:5]}"
            component = labels.get("app.kubernetes.io/component", "launcher")
            pods.append(Pod(name, component, name, spec["containers"][0], spec["volumes"], uid, gid, labels=labels))
    return pods


def ensure_user(uid: int, home: str) -> str:
    """A local user with this uid whose passwd home is `home` (sshd reads ~/.ssh/environment from there)."""
    try:
        entry = pwd.getpwuid(uid)
    except KeyError:
        name = f"ds{uid}"
        added = subprocess.run(["useradd", "--uid", str(uid), "--user-group", "--no-create-home", "--home-dir",
                                home, "--shell", "/bin/bash", name], capture_output=True, text=True)
        try:  # a failed useradd is fine where another test process (pytest -n) added the user just now
            entry = pwd.getpwuid(uid)
        except KeyError:
            raise RuntimeError(f"useradd {name}: {added.stderr.strip()}") from None
        # Also where the other process added it: it may not have unlocked it yet ('!' is locked to sshd).
        subprocess.run(["usermod", "-p", "*", entry.pw_name], check=True)
    if entry.pw_dir != home:
        raise RuntimeError(f"uid {uid} ({entry.pw_name}) has home {entry.pw_dir}, the chart expects {home}")
    return entry.pw_name


def find_object(docs: list[dict], kind: str, name: str) -> dict:
    for doc in docs:
        if doc["kind"] == kind and doc["metadata"]["name"] == name:
            return doc
    raise RuntimeError(f"{kind} {name} is not in the render (add it to the docs, as a cluster would have it)")


class Claims:
    """One shared directory per PersistentVolumeClaim under `root`, as a ReadWriteMany volume: call with a claim
    name (and a mount's subPath) for its directory (mode 0777, since fsGroup does not apply to such volumes; a
    subPath directory gets the mode of the claim's root, as the kubelet makes it). Several clusters given one
    Claims share the claims, as releases on one cluster do."""

    def __init__(self, root: Path):
        self.root = root

    def __call__(self, claim: str, sub_path: str = "") -> Path:
        path = self.root / "claims" / claim
        for part in [Path(), *Path(sub_path).parts]:
            path = path / part
            if not path.is_dir():
                path.mkdir(parents=True)
                path.chmod(0o777)
        return path


def write_projected(target: Path, files: list[tuple[str, str | bytes, int]], gid: int) -> None:
    """A ConfigMap or Secret volume laid out as the kubelet's AtomicWriter lays it out: the files in a timestamped
    `..<version>` directory, `..data` a link to it, and each top-level name a link through `..data`, so that pod
    programs meet the same links there as on a cluster."""
    if (target / "..data").is_symlink():
        return  # the volume is mounted twice: written once
    # The kubelet names the version by the time and a random number: another pod's mount, another name.
    version = target / time.strftime(f"..%Y_%m_%d_%H_%M_%S.{secrets.randbelow(10**10)}")
    version.mkdir(parents=True, exist_ok=True)
    for relpath, value, mode in files:
        path = version / relpath
        path.parent.mkdir(parents=True, exist_ok=True)  # an item's path may name a subdirectory
        path.write_bytes(value if isinstance(value, bytes) else value.encode())
        os.chown(path, 0, gid)
        os.chmod(path, mode)
    (target / "..data").symlink_to(version.name)
    for top in sorted({relpath.split("/")[0] for relpath, _, _ in files}):
        (target / top).symlink_to(f"..data/{top}")


def materialize_volumes(docs: list[dict], pod: Pod, root: Path, claim_dir) -> dict[str, Path]:
    """mountPath -> directory on this machine holding what the pod sees there: ConfigMap and Secret files
    (items, defaultMode, group fsGroup as the kubelet does), emptyDirs (mode 0777), claims via claim_dir()."""
    by_name = {v["name"]: v for v in pod.volumes}
    mounts = {}
    for mount in pod.container.get("volumeMounts", []):
        volume = by_name[mount["name"]]
        target = root / mount["name"]
        if "configMap" in volume or "secret" in volume:
            source = volume.get("configMap") or volume["secret"]
            kind = "ConfigMap" if "configMap" in volume else "Secret"
            name = source["name"] if kind == "ConfigMap" else source["secretName"]
            data = find_object(docs, kind, name).get("data", {})
            if kind == "Secret":
                data = {k: base64.b64decode(v) for k, v in data.items()}
            items = source.get("items") or [{"key": k, "path": k} for k in data]
            write_projected(target, [(item["path"], data[item["key"]],
                                      item.get("mode", source.get("defaultMode", 0o644))) for item in items], pod.gid)
        elif "emptyDir" in volume:
            target.mkdir(parents=True, exist_ok=True)
            os.chmod(target, 0o777)
        elif "persistentVolumeClaim" in volume:
            target = claim_dir(volume["persistentVolumeClaim"]["claimName"], mount.get("subPath", ""))
        else:
            raise RuntimeError(f"{pod.name}: volume {mount['name']}: type not emulated")
        mounts[mount["mountPath"]] = target
    return mounts


def container_env(docs: list[dict], pod: Pod) -> dict[str, str]:
    """The container's env as the kubelet resolves it: values, the namespace and label fieldRefs, secretKeyRefs."""
    env = dict(pod.controller_env)
    for item in pod.container.get("env", []):
        if "value" in item:
            env[item["name"]] = item["value"]
        elif "fieldRef" in item.get("valueFrom", {}):
            path = item["valueFrom"]["fieldRef"]["fieldPath"]
            label = re.fullmatch(r"metadata\.labels\['([^']+)'\]", path)
            env[item["name"]] = pod.labels.get(label[1], "") if label else {"metadata.namespace": "default"}[path]
        elif "secretKeyRef" in item.get("valueFrom", {}):
            ref = item["valueFrom"]["secretKeyRef"]
            secret = find_object(docs, "Secret", ref["name"])
            env[item["name"]] = base64.b64decode(secret["data"][ref["key"]]).decode()
    return env


class MountPoints:
    """The directories made on this machine for pods to mount over (/etc/deepspeed/config, /checkpoints, ...),
    shared by every Cluster alive in any process (pytest -n): removing one while another cluster's pod is bound
    to it would detach that pod's volume (rmdir lazily unmounts it in other mount namespaces). Each cluster
    holds a shared lock while it lives; the last one out (the exclusive lock) removes what all of them made."""

    LOCK, REGISTRY = Path("/run/ds-e2e-mountpoints.lock"), Path("/run/ds-e2e-mountpoints")

    def __init__(self):
        self.lock = open(self.LOCK, "a")
        fcntl.flock(self.lock, fcntl.LOCK_SH)

    def ensure(self, path: str) -> None:
        p, missing = Path(path), []
        while not p.exists():
            missing.append(p)
            p = p.parent
        if missing:
            with open(self.REGISTRY, "a") as registry:
                registry.write("".join(f"{d}\n" for d in missing))
            for d in reversed(missing):
                d.mkdir(exist_ok=True)

    def release(self) -> None:
        try:
            fcntl.flock(self.lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # another cluster still lives: the last one out removes them
            self.lock.close()
            return
        made = self.REGISTRY.read_text().split() if self.REGISTRY.exists() else []
        for d in sorted(set(made), key=lambda d: -d.count("/")):  # deepest first
            try:
                Path(d).rmdir()
            except OSError:
                pass
        self.REGISTRY.unlink(missing_ok=True)
        self.lock.close()


class Cluster:
    """Hosts for the pods of one render. Use as a context manager; everything is removed on exit."""

    def __init__(self, docs: list[dict], subnet: int = 231, claims: Claims | None = None):
        self.docs = docs
        self.id = uuid.uuid4().hex[:6]
        self.subnet = subnet
        self.tmp = Path(tempfile.mkdtemp(prefix=f"ds-e2e-{self.id}-"))
        os.chmod(self.tmp, 0o755)
        self.pods = pods_from_render(docs)
        self.switch = f"ds{self.id}sw"
        self.claim_dir = claims or Claims(self.tmp)
        self.mount_points = MountPoints()
        for i, pod in enumerate(self.pods):
            pod.ip, pod.netns = f"10.{subnet}.0.{10 + i}", f"ds{self.id}p{i}"

    # ---- lifecycle
    def __enter__(self):
        try:
            self._run("ip", "netns", "add", self.switch)
            self._ns(self.switch, "ip", "link", "add", "br0", "type", "bridge")
            self._ns(self.switch, "ip", "link", "set", "br0", "up")
            for i, pod in enumerate(self.pods):
                self._add_host(i, pod)
        except BaseException:
            self.__exit__(None, None, None)  # nothing ran yet: no logs to keep
            raise
        return self

    def __exit__(self, exc_type, *exc):
        for pod in self.pods:
            self.kill(pod)
        if exc_type is not None:  # a failed test: every pod's whole log outlives the hosts (its message has a tail)
            kept = Path(tempfile.gettempdir()) / "ds-e2e-failed" / self.tmp.name
            try:
                shutil.copytree(self.tmp, kept, ignore=lambda _, names: [n for n in names if not n.endswith(".log")],
                                dirs_exist_ok=True)
                print(f"e2e: the pods' logs of this failed test are kept in {kept}")
            except OSError as err:  # never at the cost of the clean-up below, nor of the test's own error
                print(f"e2e: could not keep the pods' logs in {kept}: {err}")
        for pod in self.pods:
            subprocess.run(["ip", "netns", "del", pod.netns], capture_output=True)
            shutil.rmtree(f"/etc/netns/{pod.netns}", ignore_errors=True)
        subprocess.run(["ip", "netns", "del", self.switch], capture_output=True)
        self.mount_points.release()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def _run(self, *cmd):
        subprocess.run(cmd, check=True, capture_output=True, text=True)

    def _ns(self, ns, *cmd):
        self._run("ip", "netns", "exec", ns, *cmd)

    def _add_host(self, i: int, pod: Pod):
        self._run("ip", "netns", "add", pod.netns)
        outside, inside = f"ds{self.id}v{i}", "eth0"
        self._run("ip", "link", "add", outside, "netns", self.switch, "type", "veth", "peer", inside,
                  "netns", pod.netns)
        self._ns(self.switch, "ip", "link", "set", outside, "master", "br0", "up")
        self._ns(pod.netns, "ip", "addr", "add", f"{pod.ip}/24", "dev", inside)
        self._ns(pod.netns, "ip", "link", "set", inside, "up")
        self._ns(pod.netns, "ip", "link", "set", "lo", "up")
        etc = Path(f"/etc/netns/{pod.netns}")
        etc.mkdir(parents=True, exist_ok=True)
        (etc / "hosts").write_text(self._hosts_file(pod))

    def _hosts_file(self, pod: Pod) -> str:
        lines = ["127.0.0.1 localhost", f"{pod.ip} {pod.hostname}"]
        for other in self.pods:
            if other.fqdn:
                short = other.fqdn.split(".svc.")[0].rsplit(".", 1)[0]  # <pod>.<service>
                lines.append(f"{other.ip} {other.fqdn} {short}")
        return "\n".join(lines) + "\n"

    # ---- volumes
    def _materialize(self, pod: Pod) -> dict[str, Path]:
        return materialize_volumes(self.docs, pod, self.tmp / f"{pod.name}.{pod.attempt}", self.claim_dir)

    def checkpoint_dir(self, pod: Pod | None = None) -> Path:
        """What a worker pod (the first by default) sees at checkpoints.mountPath: the release's own directory on
        the claim, or the pod's own volume (an emptyDir: started pods only)."""
        pod = pod or self.pods_of("worker")[0]
        mount = next(m for m in pod.container["volumeMounts"] if m["name"] == "checkpoints")
        volume = next(v for v in pod.volumes if v["name"] == "checkpoints")
        if "persistentVolumeClaim" not in volume:
            return pod.mounts[mount["mountPath"]]
        return self.claim_dir(volume["persistentVolumeClaim"]["claimName"], mount.get("subPath", ""))

    # ---- processes
    def start(self, pod: Pod, argv: list[str] | None = None, log_name: str | None = None,
              new_pod: bool = False) -> subprocess.Popen:
        """Starts the pod's container command (or `argv`, like kubectl exec) as the pod's user. new_pod=True
        gives it fresh volumes, as a Job's retry pod gets (same host and address here)."""
        if new_pod:
            pod.attempt += 1
            pod.mounts = {}
        pod.mounts = pod.mounts or self._materialize(pod)
        for mount_path in pod.mounts:
            self.mount_points.ensure(mount_path)
        argv = argv or pod.container.get("command", []) + pod.container.get("args", [])
        env = {"PATH": f"{VENV_BIN}:/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin", "HOSTNAME": pod.hostname,
               **container_env(self.docs, pod)}
        binds = ""
        for dst, src in sorted(pod.mounts.items()):
            if ROOT.is_relative_to(dst):  # e.g. a checkout under /tmp, which the pod's /tmp emptyDir would hide
                inside = src / ROOT.relative_to(dst)
                inside.mkdir(parents=True, exist_ok=True)
                binds = f"mount --bind {shlex.quote(str(ROOT))} {shlex.quote(str(inside))}; " + binds
                binds += f"mount --rbind {shlex.quote(str(src))} {shlex.quote(dst)}; "
            else:
                binds += f"mount --bind {shlex.quote(str(src))} {shlex.quote(dst)}; "
        for mount in pod.container.get("volumeMounts", []):
            if mount.get("readOnly"):
                binds += f"mount -o remount,bind,ro {shlex.quote(mount['mountPath'])}; "
        workdir = pod.container.get("workingDir", "/")
        inner = (f"hostname {shlex.quote(pod.hostname)}; {binds}cd {shlex.quote(workdir)}; exec setpriv "
                 f"--reuid={pod.uid} --regid={pod.gid} --clear-groups --inh-caps=-all "
                 f"env -i {' '.join(shlex.quote(f'{k}={v}') for k, v in env.items())} "
                 + " ".join(shlex.quote(a) for a in argv))
        pod.log_path = self.tmp / f"{log_name or pod.name}.log"
        log = open(pod.log_path, "ab")
        process = subprocess.Popen(
            ["ip", "netns", "exec", pod.netns, "unshare", "--uts", "--mount", "--propagation", "private", "--pid",
             "--fork", "--mount-proc", "bash", "-c", inner], stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True)
        if argv == pod.container.get("command", []) + pod.container.get("args", []):
            pod.process = process
        return process

    def exec(self, pod: Pod, argv: list[str], timeout: float) -> subprocess.CompletedProcess:
        name = f"{pod.name}-exec-{uuid.uuid4().hex[:4]}"
        process = self.start(pod, argv, log_name=name)
        try:
            code = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            raise
        return subprocess.CompletedProcess(argv, code, (self.tmp / f"{name}.log").read_text(errors="replace"))

    def signal_main(self, process: subprocess.Popen, sig: int) -> None:
        """`sig` to the container's PID 1 (what the kubelet signals): the child of our `unshare --fork`."""
        signal_pid1(process, sig)

    def pids(self, pod: Pod) -> list[int]:
        out = subprocess.run(["ip", "netns", "pids", pod.netns], capture_output=True, text=True).stdout
        return [int(p) for p in out.split()]

    def kill(self, pod: Pod, sig: int = signal.SIGKILL) -> None:
        """Like a node dying: every process in the pod's network namespace gets `sig`."""
        for pid in self.pids(pod):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        if pod.process and sig == signal.SIGKILL:
            try:
                pod.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass

    def wait_for_port(self, pod: Pod, port: int, timeout: float = 20) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            probe = subprocess.run(["ip", "netns", "exec", pod.netns, "bash", "-c",
                                    f"exec 3<>/dev/tcp/127.0.0.1/{port}"], capture_output=True)
            if probe.returncode == 0:
                return
            if pod.process and pod.process.poll() is not None:
                raise RuntimeError(f"{pod.name} exited with {pod.process.returncode}:\n{pod.log()}")
            time.sleep(0.2)
        raise TimeoutError(f"{pod.name}: nothing listens on {port} after {timeout}s:\n{pod.log()}")

    def pods_of(self, component: str) -> list[Pod]:
        return [p for p in self.pods if p.component == component]

    def start_workers(self, count: int | None = None) -> list[Pod]:
        """Starts the first `count` workers (all by default) and waits until each one's sshd answers."""
        workers = self.pods_of("worker")[:count]
        for worker in workers:
            self.start(worker)
        for worker in workers:
            self.wait_for_port(worker, SSH_PORT)
        return workers

    def run_workers(self, timeout: float) -> list[int]:
        """launchMode nossh: every worker pod started at once, then waited for: their exit statuses."""
        workers = self.pods_of("worker")
        processes = [self.start(worker) for worker in workers]
        deadline = time.monotonic() + timeout
        return [wait(p, timeout=max(1.0, deadline - time.monotonic())) for p in processes]

    def run_launcher(self, timeout: float) -> tuple[int, str]:
        """Every worker up, then the launcher pod to its end: (exit status, its log)."""
        self.start_workers()
        launcher = self.pods_of("launcher")[0]
        code = wait(self.start(launcher), timeout=timeout)
        return code, launcher.log()

    def rank_state_dir(self, pod: Pod) -> Path:
        """The pod's DS_RANK_STATE_DIR, as this machine sees it."""
        state_dir = container_env(self.docs, pod)["DS_RANK_STATE_DIR"]
        mounted = max((dst for dst in pod.mounts if Path(state_dir).is_relative_to(dst)), key=len)
        return pod.mounts[mounted] / Path(state_dir).relative_to(mounted)

    def progress(self, pod: Pod) -> dict:
        """Rank 0's progress.json in the pod (train/rankstate.py's publish()), as the progress sidecar reads it."""
        return json.loads((self.rank_state_dir(pod) / "progress.json").read_text())

    def rank_states(self, pod: Pod) -> list[str]:
        """The first line of each heartbeat file the pod's ranks keep in DS_RANK_STATE_DIR ("training step=21
        ..."): where a rank is, as the pod's watchdog reads it."""
        states = []
        for path in self.rank_state_dir(pod).glob("[0-9]*"):
            if path.name.isdigit():
                try:
                    states.append(path.read_text().split("\n", 1)[0].strip())
                except OSError:  # replaced or cleared meanwhile
                    continue
        return states

    def rank_pids(self, pod: Pod, ranks_only: bool = False) -> list[int]:
        """The pod's DeepSpeed processes: its launchers (deepspeed.launcher.launch, or the loop's starter on a
        nossh retry) and the ranks they started (ranks_only: the ranks, the processes a test kills to make one
        fail)."""
        pids = []
        for pid in self.pids(pod):
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
            except OSError:
                continue
            if any(word.startswith("--local_rank=") for word in argv) or (is_launcher(argv) and not ranks_only):
                pids.append(pid)
        return pids


SSH_PORT = 2222  # the chart's default ssh.port, which the e2e values keep


def own_pid_namespace(argv: list[str]) -> list[str]:
    """argv as a pod's container runs it, in a PID namespace of its own: the pod programs that find this host's
    ranks in /proc (podruntime/ranks.py) then see their own, never another test's ranks on this machine.
    signal_pid1 signals it as the kubelet would."""
    rootless = ["--user", "--map-root-user"] if os.getuid() else []
    return ["unshare", *rootless, "--pid", "--fork", "--mount-proc", "--kill-child", *argv]


def signal_pid1(process: subprocess.Popen, sig: int) -> None:
    """`sig` to the PID 1 of the namespace `process` (an `unshare --fork`) made: its child."""
    for stat in Path("/proc").glob("[0-9]*/stat"):  # (the `children` file can miss one: not atomic)
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if ppid == process.pid:
            os.kill(int(stat.parent.name), sig)
            return
    raise RuntimeError(f"the pod of process {process.pid} has no PID 1 (it ended: {process.poll()})")


def wait(process: subprocess.Popen, timeout: float) -> int:
    """The process's exit status; killed (with its group) if it outlives `timeout`."""
    try:
        return process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        raise


def wait_for(predicate, timeout: float, what: str, log=lambda: "", interval: float = 0.2):
    """Polls `predicate` until it is true (returns when, as time.monotonic()) or fails naming `what`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return time.monotonic()
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}\n{log()[-4000:]}")


def step_losses(log: str) -> dict[int, float]:
    """{step: loss} from the train package's rank-0 progress lines."""
    return {int(s): float(v) for s, v in re.findall(r"\[rank 0\] INFO step (\d+)/\d+ \| loss ([\d.]+)", log)}
