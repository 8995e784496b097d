"""dtlab's ZeRO-1/2/3 against DeepSpeed's ZeRO stages 1/2/3, in the same processes.

2 Gloo processes (dtlab's ``GlooBackend``; DeepSpeed runs on the same default process group,
``dist_init_required=False``, ``DS_ACCELERATOR=cpu``, a client torch optimizer so that no C++ op is
built). For each stage, on the same model, data and optimizer (fp32):

- parity: the loss per step and the final parameters of dtlab ZeRO-k and DeepSpeed stage k against
  one plain process on the same global batch (max relative error over the parameters);
- memory per rank: bytes of parameters, gradients and optimizer state (dtlab: its memory report;
  DeepSpeed: every tensor storage its engine and ZeRO optimizer hold, counted once each), read after
  backward and after the step;
- bytes sent per rank per step (dtlab: ``backend.stats``; DeepSpeed: its ``torch.distributed`` calls,
  counted with dtlab's formulas);
- step time: the two alternate in blocks (``_paired.alternate``), the ratio dtlab / DeepSpeed per
  round, its median and IQR, with the load average.

Results: docs/performance.md, "ZeRO against DeepSpeed". DeepSpeed must be importable (see
``DS_INSTALL`` in ``_vs_deepspeed_engine``)::

    python -m dtlab.benchmarks.vs_deepspeed                       # MLP 9.44M, AdamW, stages 1,2,3
    python -m dtlab.benchmarks.vs_deepspeed --model transformer --optimizer sgd --stages 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from dtlab.backends.base import CommunicationBackend

__all__ = ["main", "plain_run", "world"]

MICRO = {"mlp": 32, "transformer": 8}  # the batch per rank of _strategies_models' batch makers


def _optimizer_kind(name: str, lr: float) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    """The torch optimizer class and its arguments: AdamW (weight decay 0.01) or SGD (momentum 0.9)."""
    import torch

    if name == "sgd":
        return torch.optim.SGD, {"lr": lr, "momentum": 0.9}
    return torch.optim.AdamW, {"lr": lr, "weight_decay": 0.01}


def _optimizer(name: str, params: Any, lr: float) -> torch.optim.Optimizer:
    cls, kw = _optimizer_kind(name, lr)
    return cls(params, **kw)


def _dtlab_bytes(opt: Any, stage: int) -> dict[str, int]:
    rep = opt.memory_report()
    return {
        "parameters": int(rep["parameters"]),
        "gradients": int(rep["gradients"]),
        "optimizer_state": int(rep["optimizer_state"]),
        "master": 0,
        "other": 0,
        "peak_gathered": int(rep["peak_gathered_parameters"]) if stage == 3 else 0,
    }


def _ds_bytes(engine: Any) -> dict[str, Any]:
    from dtlab.benchmarks._vs_deepspeed_engine import ds_held_bytes

    return ds_held_bytes(engine)


#: the memory columns, in the order of the table
KINDS = ("parameters", "gradients", "optimizer_state", "master", "other", "peak_gathered")


def _total(b: dict[str, Any]) -> int:
    return sum(int(b[k]) for k in KINDS)


def world(backend: CommunicationBackend, args: dict[str, Any]) -> dict[str, Any]:
    """Every rank: per stage, parity, memory, bytes and interleaved step times of both."""
    import torch

    from dtlab.benchmarks._vs_deepspeed_engine import SentCounter

    torch.set_num_threads(1)
    counter = SentCounter()
    counter.install()
    out: dict[str, Any] = {"loadavg": [os.getloadavg()[0]]}
    try:
        for stage in args["stages"]:
            out[f"zero{stage}"] = _stage(backend, args, stage, counter)
            out["loadavg"].append(os.getloadavg()[0])
    finally:
        counter.uninstall()
    return out


def _stage(backend: CommunicationBackend, args: dict[str, Any], stage: int, counter: Any) -> dict[str, Any]:
    """One ZeRO stage: dtlab's and DeepSpeed's, side by side in this process."""
    import torch

    from dtlab.benchmarks._paired import alternate
    from dtlab.benchmarks._strategies_models import build, loss_fn
    from dtlab.benchmarks._vs_deepspeed_engine import ds_engine, ds_full_params, ds_watch_gathered
    from dtlab.models import get_model_strategy
    from dtlab.optimizers import default_optimizer_strategy

    name, rank, bucket = args["model"], backend.rank, args["bucket_numel"]
    module, _, batch = build(name)
    strategy = f"zero{stage}"
    model = get_model_strategy(strategy)(module, backend)
    opt_cls, opt_kw = _optimizer_kind(args["optimizer"], args["lr"])
    dt_opt = default_optimizer_strategy(strategy)(model, opt_cls, **opt_kw)
    ds_module, _, _ = build(name)
    ds_opt = _optimizer(args["optimizer"], ds_module.parameters(), args["lr"])
    engine = ds_engine(ds_module, ds_opt, stage, MICRO[name], bucket, args["ds_zero"])
    counts = {"dtlab": 0, "deepspeed": 0}

    def dt_step() -> float:
        x, y = batch(rank, counts["dtlab"])
        counts["dtlab"] += 1
        loss = loss_fn(name, model(x), y)
        loss.backward()
        dt_opt.step()
        dt_opt.zero_grad()
        return float(loss)

    def ds_step() -> float:
        x, y = batch(rank, counts["deepspeed"])
        counts["deepspeed"] += 1
        loss = loss_fn(name, engine(x), y)
        engine.backward(loss)
        engine.step()
        return float(loss)

    res: dict[str, Any] = {"memory": {}, "sent": {}}
    losses: dict[str, list[torch.Tensor]] = {"dtlab": [], "deepspeed": []}
    # parity steps; the last one also reads the memory (after backward and after the step) and
    # counts the bytes sent
    last = args["parity_steps"] - 1
    for s in range(args["parity_steps"]):
        x, y = batch(rank, s)
        sent0 = backend.stats.bytes_sent
        loss = loss_fn(name, model(x), y)
        loss.backward()
        if s == last:
            res["memory"]["dtlab"] = {"after backward": _dtlab_bytes(dt_opt, stage)}
        dt_opt.step()
        if s == last:
            res["memory"]["dtlab"]["after step"] = _dtlab_bytes(dt_opt, stage)
            res["sent"]["dtlab"] = backend.stats.bytes_sent - sent0
        dt_opt.zero_grad()
        losses["dtlab"].append(loss.detach().reshape(1))
        peak, handles = ds_watch_gathered(engine) if s == last and stage == 3 else ({"bytes": 0}, [])
        counter.sent, counter.calls, counter.armed = 0, {}, True
        ds_loss = loss_fn(name, engine(x), y)
        engine.backward(ds_loss)
        counter.armed = False
        if s == last:
            res["memory"]["deepspeed"] = {"after backward": _ds_bytes(engine)}
        counter.armed = True
        engine.step()
        counter.armed = False
        for h in handles:
            h.remove()
        if s == last:
            res["memory"]["deepspeed"]["after step"] = _ds_bytes(engine)
            for m in res["memory"]["deepspeed"].values():
                m["peak_gathered"] = peak["bytes"]
            res["sent"]["deepspeed"] = counter.sent
            res["sent"]["deepspeed_calls"] = dict(counter.calls)
        losses["deepspeed"].append(ds_loss.detach().reshape(1))
    res["loss"] = {}
    for k, ls in losses.items():
        t = torch.cat(ls)
        backend.all_reduce(t)  # the global batch's loss: the mean of the ranks' (equal micro-batches)
        res["loss"][k] = (t / backend.world_size).tolist()
    counts["dtlab"] = counts["deepspeed"] = args["parity_steps"]
    names = [n for n, _ in ds_module.named_parameters()]
    whole = {"dtlab": model.full_state_dict(), "deepspeed": ds_full_params(engine, stage)}
    if rank == 0:
        res["params"] = {k: {n: v[n] for n in names} for k, v in whole.items()}
    del whole
    variants = {"dtlab": dt_step, "deepspeed": ds_step}
    res["times"] = alternate(backend, variants, args["rounds"], args["steps"], args["warmup"])
    return res


def plain_run(args: dict[str, Any], world_size: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process on the global batch (the ranks' micro-batches concatenated): losses, parameters."""
    import torch

    from dtlab.benchmarks._strategies_models import build, loss_fn

    torch.set_num_threads(1)
    module, _, batch = build(args["model"])
    opt = _optimizer(args["optimizer"], module.parameters(), args["lr"])
    losses = []
    for s in range(args["parity_steps"]):
        xs, ys = zip(*(batch(r, s) for r in range(world_size)), strict=True)
        loss = loss_fn(args["model"], module(torch.cat(xs)), torch.cat(ys))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, {n: p.detach().clone() for n, p in module.named_parameters()}


def rel_err(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[float, str]:
    """The largest over tensors of max |a - b| / max |b|, and that tensor's name."""
    errs = {n: float((a[n] - b[n]).abs().max() / b[n].abs().max().clamp_min(1e-30)) for n in b}
    worst = max(errs, key=lambda n: errs[n])
    return errs[worst], worst


def norm_err(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """||a - b|| / ||b|| over all the parameters together."""
    num = sum(float((a[n] - b[n]).double().pow(2).sum()) for n in b)
    den = sum(float(b[n].double().pow(2).sum()) for n in b)
    return float((num / den) ** 0.5)


def _mib(b: float) -> str:
    return f"{b / 2**20:.2f}"


def _iqr(ts: list[float], scale: float = 1.0, fmt: str = ".0f") -> str:
    from dtlab.benchmarks._paired import quartiles

    lo, hi = quartiles(ts)
    return f"{scale * statistics.median(ts):{fmt}} ({scale * lo:{fmt}}-{scale * hi:{fmt}})"


def report(
    args: dict[str, Any], ranks: list[dict[str, Any]], plain: tuple[list[float], Any], nparams: int
) -> None:
    """The four tables (parity, memory, bytes, time) from every rank's results."""
    from dtlab.benchmarks._paired import round_ratios

    r0 = ranks[0]
    stages = [f"zero{k}" for k in args["stages"]]
    print(f"\nparity: {args['parity_steps']} steps, {args['optimizer']}, lr {args['lr']}, fp32, 2 ranks\n")
    print("| stage | implementation | loss vs one process (max rel. diff per step) "
          "| params vs one process: max rel. err (worst tensor) | norm rel. err "
          "| params vs the other: max rel. err (worst tensor) |")  # fmt: skip
    print("|---|---|---:|---:|---:|---:|")
    for st in stages:
        res = r0[st]
        for impl, other in (("dtlab", "deepspeed"), ("deepspeed", "dtlab")):
            dl = max(abs(a - b) / abs(b) for a, b in zip(res["loss"][impl], plain[0], strict=True))
            mine = res["params"][impl]
            e1, n1 = rel_err(mine, plain[1])
            e2, n2 = rel_err(mine, res["params"][other])
            print(
                f"| {st} | {impl} | {dl:.2e} | {e1:.2e} ({n1}) | {norm_err(mine, plain[1]):.2e} | "
                f"{e2:.2e} ({n2 if e2 else '-'}) |"
            )
    print("\nlosses (one process):", " ".join(f"{v:.6f}" for v in plain[0]))
    for st in stages:
        for impl in ("dtlab", "deepspeed"):
            print(f"losses ({st} {impl}):", " ".join(f"{v:.6f}" for v in r0[st]["loss"][impl]))

    print(f"\nmemory per rank (MiB; {nparams / 1e6:.2f}M fp32 parameters = {_mib(4 * nparams)} MiB)\n")
    print("| stage | implementation | read | parameters | gradients | optimizer state | fp32 master copy "
          "| other | peak gathered | total |")  # fmt: skip
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for st in stages:
        for impl in ("dtlab", "deepspeed"):
            for moment in r0[st]["memory"][impl]:
                rows = [" | ".join(_mib(r[st]["memory"][impl][moment][k]) for k in KINDS) for r in ranks]
                same = all(c == rows[0] for c in rows)
                for rank, r in enumerate(ranks[:1] if same else ranks):
                    m = r[st]["memory"][impl][moment]
                    read = moment if same else f"{moment}, rank {rank}"
                    print(f"| {st} | {impl} | {read} | {rows[rank]} | {_mib(_total(m))} |")
    for st in stages:
        for moment, d in r0[st]["memory"]["deepspeed"].items():
            attrs = ", ".join(f"{k} {_mib(v)}" for k, v in d["attributes"].items()) or "none"
            print(f"deepspeed {st}, {moment}, tensors by attribute of its ZeRO optimizer (MiB): {attrs}")

    print("\nbytes sent per rank in one step (MiB; dtlab's formulas for both)\n")
    print("| stage | dtlab | deepspeed | dtlab / grad bytes | deepspeed / grad bytes | deepspeed's calls |")
    print("|---|---:|---:|---:|---:|---|")
    for st in stages:
        s = r0[st]["sent"]
        calls = ", ".join(f"{k} {c}x {_mib(b)}" for k, (c, b) in s["deepspeed_calls"].items())
        print(
            f"| {st} | {_mib(s['dtlab'])} | {_mib(s['deepspeed'])} | {s['dtlab'] / (4 * nparams):.2f} | "
            f"{s['deepspeed'] / (4 * nparams):.2f} | {calls} |"
        )

    loads = [v for r in ranks for v in r["loadavg"]]
    print(
        f"\nstep time, slowest rank, {args['rounds']} alternating rounds of {args['steps']} steps "
        f"(load average {min(loads):.1f} to {max(loads):.1f})\n"
    )
    print(
        "| stage | dtlab, median (IQR) ms | deepspeed, median (IQR) ms "
        "| dtlab / deepspeed per round, median (IQR) |"
    )
    print("|---|---:|---:|---:|")
    for st in stages:
        t = r0[st]["times"]
        ratios = round_ratios(t["dtlab"], t["deepspeed"], args["steps"])
        print(f"| {st} | {_iqr(t['dtlab'], 1e3)} | {_iqr(t['deepspeed'], 1e3)} | {_iqr(ratios, fmt='.2f')} |")


def main() -> None:
    from dtlab.benchmarks._paired import add_timing_args

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=("mlp", "transformer"), default="mlp")
    ap.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--stages", default="1,2,3", help="comma-separated ZeRO stages")
    ap.add_argument("--parity-steps", type=int, default=3)
    bucket_help = "DeepSpeed's reduce/all-gather bucket in elements (default: dtlab's 25 MiB of fp32)"
    ap.add_argument("--bucket-numel", type=int, default=25 * 2**20 // 4, help=bucket_help)
    ds_help = (
        'more DeepSpeed zero_optimization settings (JSON), e.g. {"use_multi_rank_bucket_allreduce": false}'
    )
    ap.add_argument("--ds-zero", type=json.loads, default={}, help=ds_help)
    ap.add_argument("--timeout", type=float, default=1800, help="seconds for the whole 2-process world")
    add_timing_args(ap, steps=3, rounds=8)
    ns = ap.parse_args()
    stages = [int(k) for k in ns.stages.split(",") if k]
    if not stages or any(k not in (1, 2, 3) for k in stages):
        ap.error(f"--stages: choose from 1, 2, 3; got {ns.stages!r}")
    from dtlab.benchmarks._vs_deepspeed_engine import DS_INSTALL, ds_version

    version = ds_version()
    if version is None:
        sys.exit(f"vs_deepspeed: deepspeed is not importable here. Install it beside dtlab:\n  {DS_INSTALL}")
    import torch

    from dtlab.benchmarks._strategies_models import build
    from dtlab.testing import spawn_world

    args = {**vars(ns), "stages": stages}
    args.pop("json")
    print(
        f"deepspeed {version}, torch {torch.__version__}, load average {os.getloadavg()[0]:.1f}", flush=True
    )
    ranks = spawn_world(2, world, args, backend="gloo", timeout=ns.timeout, check_collectives=False)
    plain = plain_run(args, 2)
    nparams = sum(p.numel() for p in build(ns.model)[0].parameters())
    report(args, ranks, plain, nparams)
    if ns.json is not None:
        slim = [{k: v for k, v in r.items()} for r in ranks]
        for r in slim:
            for st in stages:
                r[f"zero{st}"] = {k: v for k, v in r[f"zero{st}"].items() if k != "params"}
        ns.json.write_text(json.dumps({"args": args, "deepspeed": version, "ranks": slim}, indent=1))


if __name__ == "__main__":
    main()
