"""What a release's names claim in its namespace: the objects its render creates, hooks included, against every other
project's render of the same environment. Two projects whose objects share a (kind, namespace, name) would fail or
take each other's objects on install (Helm's `before-hook-creation` deletes a hook's object of that name whoever
owns it): the second is refused before anything reaches the cluster. The chart alone names objects; nothing here
retypes how."""

import sys

from scripts.deployctl.common import DeployError, manifest_docs, source_of
from scripts.deployctl.helm import helm_template, release_name
from scripts.deployctl.layers import other_projects
from scripts.deployctl.render import Rendered, build, write

SHOWN = 3  # object names a refusal lists


def object_names(manifests: str, namespace: str) -> set[tuple[str, str, str]]:
    """(kind, namespace, name) of every object of a render; a namespaced object without one is in `namespace`."""
    names = set()
    for doc in manifest_docs(manifests):
        if isinstance(doc, dict) and isinstance(doc.get("metadata"), dict):
            meta = doc["metadata"]
            names.add((str(doc.get("kind")), str(meta.get("namespace") or namespace), str(meta.get("name"))))
    return names


def check_names_are_unique(r: Rendered, manifests: str) -> None:
    """Refuses `r` when an object it renders has the kind, namespace and name of one another project renders in
    the same environment. A project whose layers do not render cannot be installed either: it is left out (its
    own deploy runs this check against ours)."""
    namespace = r.settings["deploy"]["namespace"]
    ours = object_names(manifests, namespace)
    for other in other_projects(r.project):
        try:
            theirs = build(r.env, other, check_ds_config=False)
            theirs.out = r.out / "others" / other
            write(theirs)
            shared = ours & object_names(helm_template(theirs), theirs.settings["deploy"]["namespace"])
        except DeployError as err:  # a neighbour that does not render blocks no one: its own deploy says why
            print(f"note: project {other} does not render in {r.env} ({str(err)[:200]}): its object names were "
                  "not compared", file=sys.stderr)
            continue
        if not shared:
            continue
        listed = ", ".join(f"{kind} {ns}/{name}" for kind, ns, name in sorted(shared)[:SHOWN])
        more = f" and {len(shared) - SHOWN} more" if len(shared) > SHOWN else ""
        overrides = [source_of(r.origin, ("chart", key)) for key in ("fullnameOverride", "nameOverride")
                     if ("chart", key) in r.origin]
        where = overrides[0] if overrides else f"values/projects/{r.project}/"
        raise DeployError(
            f"{where}: project {r.project} (release {release_name(r)}) and project {other} (release "
            f"{release_name(theirs)}) would both create {listed}{more}: the second install would fail or take the "
            "first's objects; rename one project's directory (or change chart.fullnameOverride / chart.nameOverride)")
