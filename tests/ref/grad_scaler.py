"""PyTorch GradScaler's update rule (torch/amp/grad_scaler.py: _amp_update_scale_), written out:
the reference for --loss_scale dynamic (docs/design.md §15)."""


class GradScaler:
    def __init__(self, init_scale, growth_interval, growth=2.0, backoff=0.5):
        self.scale, self.tracker = float(init_scale), 0
        self.growth_interval, self.growth, self.backoff = growth_interval, growth, backoff

    def update(self, overflow):
        """After a step: an overflow (inf/NaN gradients) backs the scale off and restarts the
        count; growth_interval good steps in a row grow it."""
        if overflow:
            self.scale *= self.backoff
            self.tracker = 0
            return
        self.tracker += 1
        if self.tracker == self.growth_interval:
            self.scale *= self.growth
            self.tracker = 0
