"""Every node's `latest` for a plain DeepSpeed program on per-worker volumes, without a change to the program.

DeepSpeed's engine.save_checkpoint writes `<save_dir>/latest` (the tag a plain `engine.load_checkpoint(save_dir)`
resumes from) on global rank 0 alone, also with checkpoint.use_node_local_storage: on volumes of their own, every
other worker would find none and start from step 0 while rank 0 resumes. The chart sets MARK_ENV for the programs
that load that way (train.argsConvention deepspeed and none); the rank wrapper (ranklog.py) then runs the program
through `run`, which wraps DeepSpeedEngine.save_checkpoint once DeepSpeed's engine module is imported: after the
save returns (past DeepSpeed's own barrier, so every rank's files of the tag are written), each node's local rank 0
other than global rank 0 writes its volume's `latest` naming the tag, as the Trainer callback does for a Trainer
(train/hf_callback.py). The attempt loop then agrees on the newest tag every volume holds before the ranks start
(peercopy.plan), and the uploader and the peer copy count the tag complete by that mark (checkpoints.complete_tags).

The program runs as `python PROGRAM` or `python -m MODULE` would run it (runpy: `__main__`, sys.argv, sys.path[0]).
"""

import functools
import importlib.abc
import importlib.util
import os
import runpy
import sys

from podruntime import checkpoints
from podruntime.tenantfiles import Tree

MARK_ENV = "DS_CHECKPOINT_MARK_LATEST"  # "node": every node's local rank 0 marks its volume's latest
ENGINE = "deepspeed.runtime.engine"


def mark(save_dir, tag, env=os.environ) -> bool:
    """This node's `latest` names `tag` (a tag directory of `save_dir` in the tag grammar) on local rank 0 of a
    node other than global rank 0's (DeepSpeed's own writes that one)."""
    if env.get("LOCAL_RANK") != "0" or env.get("RANK", "0") == "0" or env.get(MARK_ENV) != "node":
        return False
    tag, tree = str(tag), Tree(os.fspath(save_dir))
    if not checkpoints.is_tag_name(tag) or not tree.is_dir(tag):
        return False
    return tree.write(checkpoints.LATEST, tag)


def wrap(engine_module) -> None:
    """DeepSpeedEngine.save_checkpoint, then this node's mark (unless the call asked for no `latest`)."""
    engine = engine_module.DeepSpeedEngine
    original = engine.save_checkpoint
    if getattr(original, "_marks_node_latest", False):
        return

    @functools.wraps(original)
    def save_checkpoint(self, save_dir, tag=None, *args, **kwargs):
        result = original(self, save_dir, tag, *args, **kwargs)
        save_latest = kwargs.get("save_latest", args[1] if len(args) > 1 else True)
        if save_latest:
            mark(save_dir, tag if tag is not None else f"global_step{self.global_steps}")
        return result

    save_checkpoint._marks_node_latest = True
    engine.save_checkpoint = save_checkpoint


class _EngineImport(importlib.abc.MetaPathFinder):
    """Wraps the engine right after DeepSpeed imports it, whenever the program imports DeepSpeed."""

    def find_spec(self, name, path, target=None):
        if name != ENGINE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            wrap(module)

        spec.loader.exec_module = exec_module
        return spec


HOOK_SCRIPT = "rank-hook.py"  # in the chart's scripts directory, beside rank-log.py


def command(program: list[str], env=os.environ) -> list[str]:
    """The rank's command: `python -u PROGRAM...` as DeepSpeed's launcher gave it, or, where the chart asks for every
    node's mark (MARK_ENV) on per-worker volumes, `python -u rank-hook.py PROGRAM...` (`run`)."""
    if env.get(MARK_ENV) != "node" or env.get(checkpoints.STORAGE_ENV) != checkpoints.PER_WORKER:
        return [sys.executable, "-u", *program]
    scripts = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return [sys.executable, "-u", os.path.join(scripts, HOOK_SCRIPT), *program]


def run(program: list[str]) -> None:
    """`python PROGRAM ARGS...` or `python -m MODULE ARGS...` with the save hook installed. The one module of the
    package that sets sys.path[0] and uses runpy: for the tenant's program, as python itself would. The program
    imports the image's podruntime, as it would without the hook: the chart's copy that runs this is forgotten."""
    for name in [m for m in sys.modules if m.split(".")[0] == "podruntime"]:
        del sys.modules[name]
    sys.meta_path.insert(0, _EngineImport())
    if program[0] == "-m":
        sys.argv = [program[1], *program[2:]]
        sys.path[0] = os.getcwd()  # as `python -m` puts it
        runpy.run_module(program[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(program)
        sys.path[0] = os.path.dirname(os.path.abspath(program[0]))  # as `python SCRIPT` puts it
        runpy.run_path(program[0], run_name="__main__")
