"""Lightning's rich progress bar, counted in micro-batches up to the run's last optimizer step."""

from __future__ import annotations

from lightning.pytorch.callbacks import RichProgressBar


class StepProgressBar(RichProgressBar):
    """Two fixes for step-limited runs with gradient accumulation: Lightning caps the bar's total
    at ``max_steps`` although it counts micro-batches (30 steps x 2 showed as "60/30"), and names
    the bar "Epoch 0/-2" when epochs are unlimited."""

    @property
    def total_train_batches(self) -> int | float:
        t = self.trainer
        remaining = (t.max_steps - t.global_step) * t.accumulate_grad_batches
        return min(t.num_training_batches, remaining) if t.max_steps > 0 else t.num_training_batches

    def _get_train_description(self, current_epoch: int) -> str:
        return f"train {self.trainer.max_steps} steps"
