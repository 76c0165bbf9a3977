"""The glue between values/ and the chart: layer, derive, render, validate, then hand to Helm.

    python -m scripts.deployctl {render,plan,template,deploy,diff,undeploy,demo,status} --env ENV [--project NAME]

render writes build/<project>/<env>/{values.yaml,ds_config.json,train_config.json}; every other command renders
first, so nothing reaches a cluster unvalidated. Errors name the file, the key and what was expected. One module per
job: common (paths, the error, blame), layers (base < env < project, the platform's keys), dsconf (the ds_config),
render (one render of ENV x PROJECT), plan, pins (what the platform pinned, by any path), names (the objects a
release claims, against every other project's), helm (template, deploy, demo), cluster (kube context, status), cli.
"""

from scripts.deployctl.cli import main
from scripts.deployctl.cluster import printable, progress_text
from scripts.deployctl.common import DeployError
from scripts.deployctl.dsconf import quiet_deepspeed
from scripts.deployctl.layers import PLATFORM_ONLY, load_layers, lookup, merge, platform_view
from scripts.deployctl.render import Rendered, build, write

__all__ = ["PLATFORM_ONLY", "DeployError", "Rendered", "build", "load_layers", "lookup", "main",
           "merge", "platform_view", "printable", "progress_text", "quiet_deepspeed", "write"]
