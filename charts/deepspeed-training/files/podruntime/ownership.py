"""Who owns a release's storage: the platform's identity of the project (the glue's deploy.projectIds, the chart's
checkpoints.owner, OWNER_ENV in the pods), recorded beside the data it owns and compared before anything reads it.

A release's storage is found by its name (`<namespace>/<release>` on a shared claim and in the bucket, the
StatefulSet's claims per worker), and a name can be taken again: a new project that takes a deleted project's name
in the same namespace would find that project's checkpoints, ledger and goodput and resume from them. A reinstall
of the same project must, and the two are told apart only by an identity the platform issues:

- RECORD (`owner.json`: {"owner": identity}) lies in `<checkpoints>/_job/` of every volume the pods keep (written by
  the first start that finds none) and at the release's prefix in the bucket (the restore container's).
- A start that finds another identity there refuses in one line (exit protocol.EXIT_CONFIG_ERROR in the pods,
  never retried), unless the platform adopts that identity's data for this project (deploy.projectAdopts: the
  chart's checkpoints.adoptOwner, ADOPT_ENV): the record then names this project, and the next start is its own.
- No identity (a chart used without one): nothing is recorded or compared (the name alone, as before).
- A record that cannot be read (not JSON, a link, not a regular file: the ranks can write the volume) is refused
  like another identity's: whose data it is cannot be known.
"""

import json
import os
import re

from podruntime import protocol
from podruntime.tenantfiles import Tree

OWNER_ENV, ADOPT_ENV = "DS_CHECKPOINT_OWNER", "DS_CHECKPOINT_ADOPT"
RECORD = "owner.json"
RECORD_BYTES = 4096  # a larger record is none of ours
IDENTITY = re.compile(r"[a-z0-9][a-z0-9-]{0,62}")  # the chart's schema and the glue take the same
UNREADABLE = object()


def recorded_owner(text: str | bytes | None):
    """The identity a record names, None where there is no record, UNREADABLE where it names none."""
    if text is None:
        return None
    try:
        value = json.loads(text)
    except (ValueError, UnicodeDecodeError):
        return UNREADABLE
    owner = value.get("owner") if isinstance(value, dict) else None
    return owner if isinstance(owner, str) and IDENTITY.fullmatch(owner) else UNREADABLE


def decide(found, ours: str, adopt: str, where: str) -> tuple[bool, str | None]:
    """(write ours as the record, the refusal's line or None) for a record `found` (recorded_owner) at `where`."""
    if not ours or found == ours:
        return False, None
    if found is None:
        return True, None
    if found is not UNREADABLE and adopt and found == adopt:
        return True, None
    named = "an unreadable owner record" if found is UNREADABLE else f"project identity {found}"
    return False, (f"{where} holds the data of {named}, not of this project ({ours}): a project that took "
                   "another's release name does not inherit its checkpoints; the platform adopts them for this "
                   "project with deploy.projectAdopts (the chart's checkpoints.adoptOwner), or removes them")


def claim_volume(env=os.environ) -> str | None:
    """This pod's checkpoint volume (DS_CHECKPOINT_DIR) claimed for the project, or the refusal's line. Nothing to
    do without an identity or a volume."""
    ours, directory = env.get(OWNER_ENV, ""), env.get("DS_CHECKPOINT_DIR", "")
    if not ours or not directory or not os.path.isdir(directory):
        return None
    tree = Tree(directory)
    relpath = f"{protocol.JOB_DIR}/{RECORD}"
    if tree.stat(relpath) is None:
        found = None
    else:  # a link, a FIFO, a huge file: read_text refuses it (None), and whose data it is cannot be known
        text = tree.read_text(relpath, RECORD_BYTES)
        found = UNREADABLE if text is None else recorded_owner(text)
    write, refusal = decide(found, ours, env.get(ADOPT_ENV, ""), tree.path(protocol.JOB_DIR))
    if write and not tree.write(relpath, json.dumps({"owner": ours})):
        return f"{tree.path(relpath)} cannot be written ({tree.error}): the volume's owner cannot be recorded"
    return refusal
