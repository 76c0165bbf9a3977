"""`python -m scripts.deployctl COMMAND --env ENV [--project NAME]` (the Makefile's targets)."""

import argparse
import re
import subprocess
import sys

from scripts.deployctl import common
from scripts.deployctl.cluster import kube_context, status
from scripts.deployctl.common import DeployError
from scripts.deployctl.dsconf import quiet_deepspeed
from scripts.deployctl.helm import demo, deploy, helm, helm_args, helm_template, release_name, run
from scripts.deployctl.names import check_names_are_unique
from scripts.deployctl.pins import check_pins
from scripts.deployctl.plan import plan
from scripts.deployctl.render import build, write
from scripts.deployctl.why import logs, pods_check, why

READ_ONLY = ("status", "why", "logs")  # look at the cluster: the release's names, not DeepSpeed's checks
NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


def name_arg(value: str) -> str:
    """ENV and PROJECT name files under values/: plain lower-case names only (they may come from CI)."""
    if not NAME.fullmatch(value):
        raise argparse.ArgumentTypeError(f"{value!r}: expected a name of lower-case letters, digits and '-'")
    return value


def count_arg(value: str) -> int:
    """RANK and ATTEMPT: a whole number (they may come from a CI pipeline)."""
    if not re.fullmatch(r"[0-9]{1,7}", value):
        raise argparse.ArgumentTypeError(f"{value!r}: expected a whole number")
    return int(value)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="deployctl", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["render", "plan", "template", "deploy", "diff", "undeploy", "demo",
                                            "status", "why", "logs"])
    parser.add_argument("--env", required=True, type=name_arg, help="values/<env>.yaml")
    parser.add_argument("--project", default=None, type=name_arg, help="values/projects/<project>/")
    parser.add_argument("--kube-context", default=None, help="must be one of deploy.kubeContexts when that is set")
    parser.add_argument("--dry-run", action="store_true", help="print the helm command and the objects; apply nothing")
    parser.add_argument("--wait", action="store_true", help="helm --wait")
    parser.add_argument("--rank", type=count_arg, default=None, help="logs: the global rank whose lines to print")
    parser.add_argument("--attempt", type=count_arg, default=None, help="logs: only this attempt's lines")
    parser.add_argument("--watch", action="store_true", help="status: the summary at every change, until the run ends")
    parser.add_argument("--follow", action="store_true", help="logs: the rank's lines as they come, until its pod ends")
    args = parser.parse_args(argv)
    read_only = args.command in READ_ONLY
    if not read_only:
        quiet_deepspeed()
    try:
        r = build(args.env, args.project, check_ds_config=not read_only)
        write(r)
        if args.command == "render":
            print(f"rendered {r.out.relative_to(common.ROOT)}/values.yaml, ds_config.json, train_config.json")
            return 0
        manifests = helm_template(r)  # the chart's own checks, before any plan, demo or cluster command
        if args.project:
            if not read_only:  # a look at a running release is never refused for a neighbour's names
                check_names_are_unique(r, manifests)
            check_pins(r, manifests, check_ds_config=not read_only)
        if args.command == "demo":
            return demo(r, manifests)
        if args.command == "template":
            sys.stdout.write(manifests)
            return 0
        cluster_cmd = args.command in ("deploy", "diff", "undeploy", "status", "why", "logs")
        context = kube_context(r, args.kube_context, need_cluster=cluster_cmd and not args.dry_run)
        if args.command == "status":
            return status(r, context, args.dry_run, manifests, follow=args.watch)
        if args.command == "why":
            return why(r, context, args.dry_run, manifests)
        if args.command == "logs":
            if args.rank is None:
                raise DeployError("make logs needs RANK: `make logs ENV=... PROJECT=... RANK=0 [ATTEMPT=2]`")
            return logs(r, context, args.dry_run, manifests, args.rank, args.attempt, follow=args.follow)
        print(plan(r, context, manifests), flush=True)
        if args.command == "plan":
            return 0
        if args.command == "deploy":
            code = deploy(r, context, args.dry_run, args.wait, manifests)
            if code == 0 and r.effective["progress"]["enabled"]:
                pods_check(r, context, args.dry_run, manifests)
            return code
        if args.command == "diff":
            plugins = subprocess.run([helm(), "plugin", "list"], capture_output=True, text=True).stdout
            if "diff" not in plugins.split():
                raise DeployError("make diff needs the helm-diff plugin (helm plugin install databus23/helm-diff)")
            return run([helm(), "diff", "upgrade", release_name(r), str(common.CHART), "-f", str(r.out / "values.yaml"),
                        *helm_args(r, context)], args.dry_run)
        return run([helm(), "uninstall", release_name(r), *helm_args(r, context)], args.dry_run)
    except DeployError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except Exception as err:  # a bug of ours, but still one line and a refusal, never a half-applied deploy
        print(f"error: deployctl {args.command} --env {args.env}: internal error {type(err).__name__}: {err} "
              "(please report it)", file=sys.stderr)
        return 1
