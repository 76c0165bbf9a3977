"""Hang detection for Hugging Face Trainer programs, at the cost of one line:
`Trainer(..., callbacks=[RankHeartbeat()])`. The rank beats after every optimizer step (train/rankstate.py, which
the chart's watchdog reads), reports `saving` while the Trainer writes a checkpoint and stays alive through
evaluation, so that neither is taken for a hang; the watchdog's stack dump works from the first report."""

from transformers import TrainerCallback

from train import rankstate


class RankHeartbeat(TrainerCallback):
    def on_train_begin(self, args, state, control, **kwargs):
        rankstate.report("starting")  # the start-up budget, until the first step

    def on_step_end(self, args, state, control, **kwargs):
        rankstate.beat(state.global_step)
        if control.should_save:  # the Trainer's own flow callback, which runs first, asked for a save next
            rankstate.report("saving", state.global_step)

    def on_save(self, args, state, control, **kwargs):
        rankstate.beat(state.global_step)

    def on_prediction_step(self, args, state, control, **kwargs):
        rankstate.report("training", state.global_step)  # evaluating: alive, though no step ends

    def on_train_end(self, args, state, control, **kwargs):
        rankstate.clear()
