"""A release's storage belongs to the platform's identity of its project (podruntime/ownership.py): a checkpoint
volume is claimed by the first start, a reinstall of the same project goes on, another identity's data is refused in
one line unless the platform adopts it, and what the program left there is read as hostile input. The bucket's
prefix: tests/test_objectstore.py (the real gateway)."""

import json
import os
import subprocess

import pytest

from podruntime import ownership, protocol
from tests.support.chart import pod_program
from tests.support.ports import free_port


def claim(directory, owner: str, adopt: str = "") -> str | None:
    return ownership.claim_volume({"DS_CHECKPOINT_DIR": str(directory), ownership.OWNER_ENV: owner,
                                   ownership.ADOPT_ENV: adopt})


def record(directory):
    return json.loads((directory / protocol.JOB_DIR / ownership.RECORD).read_text())


def test_the_first_start_claims_the_volume_a_reinstall_goes_on_and_another_project_is_refused(tmp_path):
    assert claim(tmp_path, "") is None and not (tmp_path / protocol.JOB_DIR).exists()  # no identity: as before
    assert claim(tmp_path, "p-llama") is None and record(tmp_path) == {"owner": "p-llama"}
    assert claim(tmp_path, "p-llama") is None  # a reinstall, a new pod of the same project
    refused = claim(tmp_path, "p-newteam")
    assert refused == (f"{tmp_path}/_job holds the data of project identity p-llama, not of this project "
                       "(p-newteam): a project that took another's release name does not inherit its checkpoints; "
                       "the platform adopts them for this project with deploy.projectAdopts (the chart's "
                       "checkpoints.adoptOwner), or removes them"), refused
    assert claim(tmp_path, "p-newteam", adopt="p-other") is not None  # adopting another identity is no word on this
    assert claim(tmp_path, "p-newteam", adopt="p-llama") is None and record(tmp_path) == {"owner": "p-newteam"}
    assert claim(tmp_path, "p-llama") is not None  # the volume is the new project's now


@pytest.mark.parametrize("planted", ["not json", "[1]", '{"owner": "../x"}', '{"owner": 7}', "link", "fifo",
                                     "huge", "job dir link"])
def test_an_owner_record_the_program_could_have_planted_is_refused_and_never_followed(tmp_path, planted):
    """The ranks write the checkpoint volume: a record that names no identity, a link, a FIFO, a huge file, or a
    _job/ that links elsewhere is no owner's word. Refused in one line, without blocking, following or writing
    outside the volume."""
    volume, outside = tmp_path / "volume", tmp_path / "outside"
    outside.mkdir()
    (outside / ownership.RECORD).write_text(json.dumps({"owner": "p-llama"}))
    volume.mkdir()
    job = volume / protocol.JOB_DIR
    if planted == "job dir link":
        job.symlink_to(outside)
    else:
        job.mkdir()
        target = job / ownership.RECORD
        if planted == "link":
            target.symlink_to(outside / ownership.RECORD)
        elif planted == "fifo":
            os.mkfifo(target)
        elif planted == "huge":
            target.write_text(json.dumps({"owner": "p-llama", "pad": "x" * (1 << 20)}))
        else:
            target.write_text(planted)
    refused = claim(volume, "p-llama")
    assert refused is not None and "\n" not in refused, refused
    assert ("cannot be written" in refused) if planted == "job dir link" else ("an unreadable owner record" in refused)
    assert json.loads((outside / ownership.RECORD).read_text()) == {"owner": "p-llama"}
    assert sorted(p.name for p in outside.iterdir()) == [ownership.RECORD]


def test_a_pod_whose_volume_holds_another_projects_data_ends_before_any_meeting_in_one_line(tmp_path):
    """The attempt loop (both modes' pod programs) claims the pod's volume before its hosts meet: a nossh worker
    finding another identity's checkpoints exits with the configuration error's status, its last word says why,
    and nothing of the other project's ledger is read or said."""
    volume = tmp_path / "ckpt"
    (volume / protocol.JOB_DIR / "attempts").mkdir(parents=True)
    (volume / protocol.JOB_DIR / ownership.RECORD).write_text(json.dumps({"owner": "p-llama"}))
    config = tmp_path / "config"
    config.mkdir()
    (config / "hostfile").write_text("w-0.nowhere.invalid slots=1\nw-1.nowhere.invalid slots=1\n")
    env = {"PATH": os.environ["PATH"], "DS_CHECKPOINT_DIR": str(volume), ownership.OWNER_ENV: "p-newteam",
           "JOB_COMPLETION_INDEX": "0", "DS_CONFIG_DIR": str(config), "DS_CHANNEL_PORT": str(free_port()),
           "DS_ATTEMPTS_DIR": str(volume / protocol.JOB_DIR / "attempts"), "DS_WAIT_TIMEOUT_SECONDS": "600"}
    done = subprocess.run([*pod_program("nossh-worker"), "true"], env=env, capture_output=True, text=True, timeout=60)
    said = done.stdout + done.stderr
    assert done.returncode == protocol.EXIT_CONFIG_ERROR, said
    assert "holds the data of project identity p-llama, not of this project (p-newteam)" in said, said
    assert "waiting" not in said and not list((volume / protocol.JOB_DIR / "attempts").iterdir()), said
