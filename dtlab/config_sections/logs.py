"""The ``logging`` section: what a run writes for people to read (run directory, metrics, progress, plots)."""

from __future__ import annotations

from pydantic import Field, field_validator, model_validator

from dtlab.config_sections.base import Section


class LoggingConfig(Section):
    #: this run's directory (``metrics.jsonl``, ``profile.json``, ``loss.png``, event files); ``{time}``
    #: becomes the start time (a fresh directory per run); a directory holding another run's metrics
    #: gets a ``-2`` suffix; ``latest`` beside it points to the newest; ``None``: nothing written
    run_dir: str | None = "runs/{time}"
    #: write a metrics record (and a console line) every N steps
    log_every: int = Field(default=20, ge=1)
    #: the run header, a progress bar and metric lines on rank 0's console
    progress: bool = True
    #: TensorBoard event files in the run directory (``torch.utils.tensorboard``; ``pip install tensorboard``)
    tensorboard: bool = False
    #: log every metrics record to Weights & Biases (``pip install wandb``; ``WANDB_MODE=offline`` works)
    wandb: bool = False
    #: the W&B project name (``logging.wandb=true``)
    wandb_project: str = "dtlab"
    #: ``metrics.csv`` beside ``metrics.jsonl``: one row per record, fixed columns
    csv: bool = False
    #: ``loss.png`` in the run directory at the end of a run (training and eval loss against step and
    #: against bytes sent; needs matplotlib)
    plot: bool = True

    @field_validator("run_dir")
    @classmethod
    def _not_empty(cls, v: str | None) -> str | None:
        if v == "":
            raise ValueError("an empty path; give a directory, or null for no metrics and no profile")
        rest = "" if v is None else v.replace("{time}", "")
        if "{" in rest or "}" in rest:
            raise ValueError("the only placeholder allowed is {time} (the run's start time): runs/{time}")
        return v

    @model_validator(mode="after")
    def _packages(self) -> LoggingConfig:
        import importlib.util

        for field, package in (("tensorboard", "tensorboard"), ("wandb", "wandb")):
            if getattr(self, field) and importlib.util.find_spec(package) is None:
                raise ValueError(
                    f"logging.{field}=true needs the {package} package, which is not installed: "
                    f"pip install {package} (or pip install 'dtlab[{package}]'), or set logging.{field}=false"
                )
        if (self.tensorboard or self.wandb or self.csv) and self.run_dir is None:
            raise ValueError(
                "logging.tensorboard, logging.wandb and logging.csv write into logging.run_dir, which is "
                "null; give logging.run_dir a directory"
            )
        return self
