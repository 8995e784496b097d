"""One configuration of the strategies benchmark (``dtlab.benchmarks.strategies``) in this process:
a dtlab strategy pair, torch DDP or torch FSDP2 on one model, its timed steps, the bytes it sends and
the model state it holds (read from the tensors), and the peak resident memory it added (Linux
``VmHWM``)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from dtlab.backends.base import CommunicationBackend
from dtlab.benchmarks._strategies_models import build, loss_fn
from dtlab.core import pairs
from dtlab.models import ModuleClassPolicy, get_model_strategy
from dtlab.optimizers import OptimizerStrategy, default_optimizer_strategy

__all__ = ["DTLAB", "DTLAB_EXTRA", "TORCH", "Run", "tensor_bytes"]

DTLAB = pairs.DATA_PARALLEL
#: variants run only when named in --strategies: ZeRO-1 with DDP's all-reduce instead of reduce-scatter
DTLAB_EXTRA = {"zero1_allreduce": ("zero1", {"gradient_sync": "all_reduce"})}
TORCH = ("torch_ddp", "torch_fsdp2")


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def _reset_peak() -> None:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS (Linux)
    except OSError:
        pass


def tensor_bytes(ts: Any) -> int:
    """The bytes of the tensors among ``ts`` (a DTensor's local part)."""
    total = 0
    for t in ts:
        if isinstance(t, torch.Tensor):
            local = t.to_local() if hasattr(t, "to_local") else t
            total += local.numel() * local.element_size()
    return total


class Run:
    """One strategy on one model in this process: built, warmed up, then timed in rounds."""

    def __init__(self, backend: CommunicationBackend, model: str, strategy: str) -> None:
        self.backend, self.model_name, self.strategy = backend, model, strategy
        self.rss_before = _status_kib("VmRSS")
        _reset_peak()
        module, unit_cls, self.batch = build(model)
        self.dist_opt: OptimizerStrategy | None = None  # a dtlab pair's optimizer strategy
        if strategy == "torch_ddp":
            from torch.nn.parallel import DistributedDataParallel

            self.model: nn.Module = DistributedDataParallel(module)
            self.opt: torch.optim.Optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        elif strategy == "torch_fsdp2":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (backend.world_size,))
            for sub in module.modules():
                if isinstance(sub, unit_cls):
                    fully_shard(sub, mesh=mesh)
            self.model = cast(nn.Module, fully_shard(module, mesh=mesh))
            self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        else:
            base, extra = DTLAB_EXTRA.get(strategy, (strategy, {}))
            kw: dict[str, Any] = dict(extra)
            if strategy == "fsdp":
                kw["wrap_policy"] = ModuleClassPolicy((unit_cls,))
            self.model = get_model_strategy(base)(module, backend, **kw)
            self.dist_opt = default_optimizer_strategy(base)(self.model, torch.optim.AdamW, lr=1e-4)
            self.opt = self.dist_opt
        self.times: list[float] = []
        self.bytes_per_step = 0.0
        self.step_no = 0
        self.peak_state = 0
        self.peak_gathered = 0  # FSDP2 only, measured by watch_gathered()

    def step(self, probe: bool = False) -> None:
        """One step; ``probe``: read the model state at the two moments every row is measured at
        (after backward, and after the optimizer step, both before ``zero_grad``) and keep the peak."""
        x, y = self.batch(self.backend.rank, self.step_no)
        self.step_no += 1
        loss = loss_fn(self.model_name, self.model(x), y)
        loss.backward()
        if probe:
            self.peak_state = max(self.peak_state, self.state_now())
        self.opt.step()
        if probe:
            self.peak_state = max(self.peak_state, self.state_now())
        self.opt.zero_grad()

    def timed(self, steps: int) -> None:
        self.backend.barrier()
        sent0 = self.backend.stats.bytes_sent
        t0 = time.perf_counter()
        for _ in range(steps):
            self.step()
        self.backend.barrier()
        self.times.append((time.perf_counter() - t0) / steps)
        sent = self.backend.stats.bytes_sent - sent0
        self.bytes_per_step = sent / steps  # barrier bytes are 0

    def state_now(self) -> int:
        """Parameters + gradients + optimizer state held now (+ the peak of gathered parameters for
        ZeRO-3, FSDP and FSDP2, which exist only inside forward and backward)."""
        if self.dist_opt is not None:
            rep = self.dist_opt.memory_report()
            state = rep["parameters"] + rep["gradients"] + rep["optimizer_state"]
            return int(state + (rep["peak_gathered_parameters"] if self.strategy in ("zero3", "fsdp") else 0))
        params = list(self.model.parameters())
        state = tensor_bytes(params) + tensor_bytes(p.grad for p in params)
        state += tensor_bytes(v for s in self.opt.state.values() for v in s.values())
        if self.strategy == "torch_ddp":  # gradient buckets (gradient_as_bucket_view=False)
            state += tensor_bytes(p for p in params if p.requires_grad)
        if self.strategy == "torch_fsdp2":  # the most unsharded parameters held at once (watch_gathered)
            state += self.peak_gathered
        return state

    def watch_gathered(self) -> None:
        """FSDP2: measure the peak of unsharded parameters during forward and backward: at every
        module's forward (pre and post) and backward (pre and post) hook, the bytes of the plain
        (not sharded) parameters the modules hold; all-gather buffers not yet swapped in (a prefetched
        unit) are not seen. Only for the memory probe: the hooks cost time."""
        from torch.distributed.tensor import DTensor

        def probe(*_: Any) -> None:
            seen: set[int] = set()
            total = 0
            for m in self.model.modules():
                for q in m.parameters(recurse=False):  # what each module holds right now
                    if isinstance(q, DTensor):
                        continue
                    st = q.untyped_storage()
                    if st.nbytes() and st.data_ptr() not in seen:
                        seen.add(st.data_ptr())
                        total += st.nbytes()
            self.peak_gathered = max(self.peak_gathered, total)

        for m in self.model.modules():
            m.register_forward_pre_hook(probe)
            m.register_forward_hook(probe)
            m.register_full_backward_pre_hook(probe)
            m.register_full_backward_hook(probe)

    def memory(self) -> dict[str, int]:
        """The peak model state over the probed steps and the peak RSS this configuration added."""
        return {"model_state": self.peak_state, "peak_rss_delta": self._rss_delta()}

    def _rss_delta(self) -> int:
        return max(0, _status_kib("VmHWM") - self.rss_before) * 1024
