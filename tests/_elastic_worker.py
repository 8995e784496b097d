"""torchrun worker of tests/test_elastic_torchrun.py: what ``dtlab train --set ...`` runs
(``run_training`` under SIGTERM/SIGINT handlers), with each micro-batch's loss taking at least
``argv[1]`` seconds while this worker is alone in the world and ``argv[2]`` seconds otherwise, so the
two-agent scenario has time to kill an agent mid-run and to start it again before the survivor
finishes alone, even on a loaded machine."""

from __future__ import annotations

import dataclasses
import os
import sys
import time

import torch

from dtlab.config import load_config
from dtlab.trainers import StopRequest, build_task, finish_process, run_training, stop_on_signals


def main() -> None:
    alone, together = float(sys.argv[1]), float(sys.argv[2])
    delay = alone if int(os.environ.get("WORLD_SIZE", "1")) == 1 else together
    config = load_config(overrides=sys.argv[3:])
    base = build_task(config)

    def paced(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        time.sleep(delay)
        return base.loss_fn(logits, targets)

    try:
        with stop_on_signals(StopRequest()) as stop:  # as dtlab train: SIGTERM stops at a step boundary
            run_training(config, task=dataclasses.replace(base, loss_fn=paced), stop=stop)
    finally:
        finish_process()  # as dtlab train: no full gc in the teardown torchrun's restart waits for


if __name__ == "__main__":
    main()
