"""Hang detection and progress for Hugging Face Trainer programs, at the cost of one line:
`Trainer(..., callbacks=[RankHeartbeat()])`. The rank beats after every optimizer step (train/rankstate.py, which
the chart's watchdog reads), reports `saving` while the Trainer writes a checkpoint and stays alive through
evaluation, so that neither is taken for a hang; the watchdog's stack dump works from the first report. Rank 0
also publishes what the Trainer logs (loss, learning rate, total steps, the last checkpoint), which the chart's
progress ConfigMap and metrics show."""

import time

from transformers import TrainerCallback

from train import rankstate


class RankHeartbeat(TrainerCallback):
    def __init__(self):
        self._logged: tuple[int, float] | None = None  # (step, time) of the previous log, for tokens/s and ETA

    def on_train_begin(self, args, state, control, **kwargs):
        rankstate.publish(steps=state.max_steps or None)
        rankstate.report("starting")  # the start-up budget, until the first step

    def on_step_end(self, args, state, control, **kwargs):
        rankstate.beat(state.global_step)
        if control.should_save:  # the Trainer's own flow callback, which runs first, asked for a save next
            rankstate.report("saving", state.global_step)

    def on_save(self, args, state, control, **kwargs):
        rankstate.publish(checkpoint_step=state.global_step)
        rankstate.beat(state.global_step)

    def on_log(self, args, state, control, logs=None, **kwargs):
        logs, now, eta_s = logs or {}, time.monotonic(), None
        if self._logged and state.global_step > self._logged[0] and state.max_steps:
            per_step = (now - self._logged[1]) / (state.global_step - self._logged[0])
            eta_s = round(per_step * (state.max_steps - state.global_step), 1)
        self._logged = (state.global_step, now)
        rankstate.publish(step=state.global_step, steps=state.max_steps or None, loss=logs.get("loss"),
                          lr=logs.get("learning_rate"), eta_s=eta_s)

    def on_prediction_step(self, args, state, control, **kwargs):
        rankstate.report("training", state.global_step)  # evaluating: alive, though no step ends

    def on_train_end(self, args, state, control, **kwargs):
        rankstate.publish(state="done", step=state.global_step, eta_s=0)
        rankstate.clear()
