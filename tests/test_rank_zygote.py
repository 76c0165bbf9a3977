"""The tests' rank zygote (tests/support/rank_zygote.py) keeps Popen's contract: a rank is in its process group when its
start returns, so the next rank can join that group and a test can signal it."""

import contextlib
import os
import signal

import pytest

from tests.support.train_run import Ranks, Zygote, cpu_ds_config, launch_argv_env, write_ds_config


def test_forked_ranks_are_in_the_first_ranks_group_when_their_start_returns(tmp_path):
    # A world of 3 with 2 ranks started: both wait in the rendezvous until the test kills the group.
    args = ["--ds-config", str(write_ds_config(tmp_path, cpu_ds_config())), "--steps", "1"]
    ranks_env = launch_argv_env(args, ranks=3)[:2]
    zygote = Zygote.get()
    if zygote is None or not zygote.serves(ranks_env[0][1]):
        pytest.skip("no rank zygote in this session: every rank is a fresh process (Popen sets the group)")
    ranks = Ranks(args, ranks_env)
    try:
        groups = [os.getpgid(rank.pid) for rank in ranks.processes]
        assert all(rank.poll() is None for rank in ranks.processes), "a rank ended before the world was complete"
    finally:
        for rank in ranks.processes:  # each by its pid: the group is what is under test
            with contextlib.suppress(ProcessLookupError):
                os.kill(rank.pid, signal.SIGKILL)
        out, _ = ranks.communicate(timeout=60)
    assert groups == [ranks.pid, ranks.pid], out
    assert ranks.returncode == -signal.SIGKILL, out
