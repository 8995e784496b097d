"""The ``optimizer`` section: the torch optimizer each rank runs, its learning-rate schedule and clipping."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from dtlab.config_sections.base import Section


class OptimizerConfig(Section):
    #: the torch optimizer each rank runs on its parameters (or shards): AdamW, Adam or SGD
    name: Literal["adamw", "adam", "sgd"] = "adamw"
    #: peak learning rate (after warm-up)
    lr: float = Field(default=4e-3, gt=0)
    #: decoupled weight decay (AdamW) or L2 penalty (Adam, SGD)
    weight_decay: float = Field(default=0.01, ge=0)
    #: SGD momentum (``optimizer.name=sgd``)
    momentum: float = Field(default=0.9, ge=0, lt=1)
    #: Adam/AdamW coefficients of the running averages of the gradient and its square (torch's default
    #: is ``[0.9, 0.999]``)
    betas: tuple[float, float] = (0.9, 0.99)
    #: learning-rate schedule after warm-up: cosine to ``min_lr_ratio * lr``, step decay, or constant;
    #: ``torch``: the ``torch.optim.lr_scheduler`` class ``torch_scheduler`` (no added warm-up)
    schedule: Literal["cosine", "step", "constant", "torch"] = "cosine"
    #: linear learning-rate warm-up from 0 over this many steps
    warmup_steps: int = Field(default=10, ge=0)
    #: ``schedule=cosine``: the final learning rate as a fraction of ``lr``
    min_lr_ratio: float = Field(default=0.1, ge=0, le=1)
    #: ``schedule=step``: steps between decays
    step_size: int = Field(default=100, ge=1)
    #: ``schedule=step``: factor of each decay
    gamma: float = Field(default=0.5, gt=0, le=1)
    #: clip gradients by their global norm over all ranks' shards; ``None`` disables clipping
    clip_grad_norm: float | None = Field(default=1.0, gt=0)
    #: ``schedule=torch``: a ``torch.optim.lr_scheduler`` class by name, e.g. ``OneCycleLR``
    torch_scheduler: str | None = None
    #: ``schedule=torch``: its keyword arguments (``total_steps``/``T_max``/``total_iters``: train.steps)
    torch_scheduler_args: dict[str, float | int | bool | str | list[float] | list[int]] = Field(
        default_factory=dict
    )

    @model_validator(mode="after")
    def _torch_schedule(self) -> OptimizerConfig:
        if self.schedule != "torch" and self.torch_scheduler is not None:
            raise ValueError(
                f"optimizer.torch_scheduler={self.torch_scheduler!r} needs optimizer.schedule=torch "
                f"(it is {self.schedule!r})"
            )
        if self.schedule != "torch" and self.torch_scheduler_args:
            raise ValueError(
                f"optimizer.torch_scheduler_args={dict(self.torch_scheduler_args)!r} would be ignored: "
                f"they apply to optimizer.schedule=torch only (it is {self.schedule!r}); set "
                "optimizer.schedule=torch and optimizer.torch_scheduler, or drop them"
            )
        if self.schedule == "torch":
            if self.torch_scheduler is None:
                raise ValueError(
                    "optimizer.schedule='torch' needs optimizer.torch_scheduler, e.g. OneCycleLR"
                )
            if "warmup_steps" in self.model_fields_set and self.warmup_steps:
                raise ValueError(
                    f"optimizer.warmup_steps={self.warmup_steps} does not apply to "
                    "optimizer.schedule='torch'; use the scheduler's own warm-up (e.g. OneCycleLR's "
                    "pct_start) and leave optimizer.warmup_steps unset"
                )
        return self

    @field_validator("betas", mode="before")
    @classmethod
    def _two_betas(cls, v: object) -> object:
        if not isinstance(v, (list, tuple)) or len(v) != 2:
            raise ValueError("give two numbers [beta1, beta2], each in [0, 1), e.g. [0.9, 0.99]")
        return v

    @field_validator("betas")
    @classmethod
    def _betas(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in v):
            raise ValueError("each beta must lie in [0, 1), e.g. [0.9, 0.99]")
        return v
