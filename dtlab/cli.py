"""The ``dtlab`` command line: ``train``, ``bench``, ``advise``, ``consolidate``, ``plot`` and ``config``.

``dtlab train`` with no arguments trains the embedded default (a byte-level transformer language model
on the Python standard library's source, 4 in-memory ranks). Configuration errors and other dtlab
errors print one message and exit with status 2, without a traceback. SIGTERM or SIGINT during
``dtlab train`` stops every rank after the same step, writes a final checkpoint (``checkpoint.dir``)
and exits with 143 (SIGTERM) or 130 (SIGINT); a further signal while it stops (not the same one
delivered twice within 0.5 s) exits at once with the same status, every committed checkpoint intact
(``trainers/preemption.py``).
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["main"]


class _SetAction(argparse.Action):
    """``--set KEY=VALUE`` or ``--set KEY VALUE``: one setting, kept as ``KEY=VALUE``."""

    def __call__(
        self, parser: argparse.ArgumentParser, ns: argparse.Namespace, values: Any, _option: Any = None
    ) -> None:
        items = list(values)
        if len(items) == 1 and "=" in items[0]:
            item = items[0]
        elif len(items) == 2 and "=" not in items[0]:
            item = f"{items[0]}={items[1]}"
        else:
            parser.error(
                f"--set {' '.join(items)}: give one setting per --set, as KEY=VALUE or KEY VALUE "
                "(e.g. --set train.steps=40 --set strategy.model fsdp); every KEY: dtlab train --help"
            )
        getattr(ns, self.dest).append(item)


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-c", "--config", help="YAML or TOML file (sections as in docs/configuration.md)")
    p.add_argument(
        "--set",
        dest="overrides",
        action=_SetAction,
        nargs="+",
        default=[],
        metavar="KEY=VALUE",
        help="override one setting: --set train.steps=50 or --set train.steps 50 (repeatable; later wins; "
        "applied after -c). KEY is section.field as listed below; VALUE is read as YAML: 2 an int, "
        "1e-3 a float, true a bool, null none, [1, 2] a list",
    )


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dtlab", description="Distributed training strategies for PyTorch.")
    sub = p.add_subparsers(dest="command", required=True)
    from dtlab.config_doc import help_epilog

    t = sub.add_parser(
        "train",
        help="train (no arguments: the embedded default on 4 in-memory ranks)",
        description="Train. No arguments: the embedded default (a byte-level transformer LM on 4 in-memory "
        "ranks). Under torchrun, mpiexec or srun every process is a rank. `dtlab config` prints the "
        "resolved settings, `dtlab config --describe` each with its allowed values.",
        epilog=help_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_config_args(t)
    t.add_argument(
        "--quiet",
        action="store_true",
        help="no run header, progress bar or metric lines (the summary still prints)",
    )
    c = sub.add_parser(
        "config",
        help="print the resolved configuration as YAML (--describe: every setting, allowed values, meaning)",
    )
    _add_config_args(c)
    c.add_argument(
        "--describe",
        action="store_true",
        help="every setting with its value, default, allowed values and description, instead of YAML",
    )
    b = sub.add_parser("bench", help="run the strategy and compression benchmarks; write a table and plots")
    b.add_argument("--out", default="runs/bench", help="directory for the table, raw results and PNG plots")
    b.add_argument("--only", choices=["strategies", "compression", "mesh"], help="run one of the benchmarks")
    b.add_argument("--full", action="store_true", help="the benchmarks' own default sizes (slow)")
    b.add_argument("--timeout", type=float, default=900.0, help="seconds each benchmark may run")
    from dtlab.advise.command import add_advise_parser

    add_advise_parser(sub)
    pl = sub.add_parser("plot", help="overlay runs' loss curves (against step and bytes sent) in one PNG")
    pl.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories (e.g. runs/latest)")
    pl.add_argument("-o", "--output", default="loss.png", help="the PNG to write (default: loss.png)")
    pl.add_argument("--title", help="a title above both panels")
    k = sub.add_parser("consolidate", help="write a checkpoint's full model as one safetensors file")
    k.add_argument("checkpoint", help="a checkpoint root (uses 'latest') or one step directory")
    k.add_argument("-o", "--output", required=True, help="output .safetensors file")
    return p


def _train(args: argparse.Namespace) -> int:
    from dtlab.config import load_config
    from dtlab.trainers import run_training
    from dtlab.trainers.preemption import EXIT_STATUS, StopRequest, stop_on_signals
    from dtlab.trainers.report import print_tables, profile_table, summary_table

    config = load_config(args.config, args.overrides)
    if args.quiet:
        config = config.model_copy(update={"logging": config.logging.model_copy(update={"progress": False})})
    # SIGTERM/SIGINT: a clean stop at the next step; another one while stopping: exit at once
    with stop_on_signals(StopRequest(), exit_on_repeat=True) as stop:
        results = run_training(config, stop=stop)
        main = results[0]
        if main.rank == 0:  # under a launcher every process gets its own rank; rank 0 prints
            print_tables(
                summary_table(main.summary, title="dtlab train: summary"), profile_table(main.profile)
            )
        if main.preempted_by is None:
            return 0
        status = EXIT_STATUS.get(main.preempted_by, 1)
        if main.rank == 0:
            saved = (
                f"checkpoint {main.checkpoint}" if main.checkpoint else "no checkpoint (no checkpoint.dir)"
            )
            print(
                f"dtlab train: stopped by {main.preempted_by} after step {main.final_step} of "
                f"{config.train.steps}; {saved}; exit status {status}",
                file=sys.stderr,
                flush=True,
            )
        return status


def _config(args: argparse.Namespace) -> int:
    import yaml

    from dtlab.config import load_config

    config = load_config(args.config, args.overrides)
    if args.describe:
        from dtlab.config_doc import describe

        return _to_stdout(describe(config.to_dict()) + "\n")
    return _to_stdout(yaml.safe_dump(config.to_dict(), sort_keys=False))


def _to_stdout(text: str) -> int:
    """Write ``text``; a reader that stops early (``| head``) ends the output quietly, no traceback."""
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:
        _stdout_to_devnull()
    return 0


def _stdout_to_devnull() -> None:
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())  # the interpreter's last flush must not fail again


def _consolidate(args: argparse.Namespace) -> int:
    from dtlab.checkpoint import consolidate

    out = consolidate(args.checkpoint, args.output)
    print(f"wrote {out}")
    return 0


def _plot(args: argparse.Namespace) -> int:
    from dtlab.trainers.plots import plot_runs, read_curves

    runs = [read_curves(d) for d in args.run_dirs]
    out = plot_runs(runs, args.output, title=args.title)
    print(f"wrote {out} ({len(runs)} run{'s' if len(runs) > 1 else ''}: {', '.join(r.name for r in runs)})")
    return 0


def _bench(args: argparse.Namespace) -> int:
    from dtlab.benchmarks.bench import run_bench

    return run_bench(args.out, only=args.only, full=args.full, timeout=args.timeout)


def _advise(args: argparse.Namespace) -> int:
    from dtlab.advise.command import run_advise

    return run_advise(args)


def _warning_printer(command: str) -> Callable[..., None]:
    """``warnings.showwarning`` for the program: dtlab's own warnings as one line ``dtlab CMD: warning:
    ...`` (not the file, line and source line of the dtlab module that raised it); others as Python
    prints them."""
    default = warnings.showwarning
    package = Path(__file__).resolve().parent

    def show(message: Warning | str, category: type[Warning], filename: str, lineno: int, *rest: Any) -> None:
        if not Path(filename).resolve().is_relative_to(package):  # not dtlab_x/ beside it
            default(message, category, filename, lineno, *rest)
            return
        print(f"dtlab {command}: warning: {message}", file=sys.stderr, flush=True)

    return show


def _setting_hint(extras: list[str]) -> str:
    """What to write instead of arguments ``dtlab train``/``config`` do not take: ``--steps 10`` and
    ``train.steps=10`` are settings, given as ``--set train.steps=10``."""
    from dtlab.config import section_fields, settings_named

    first = extras[0]
    key, eq, value = first.lstrip("-").partition("=")
    if not eq and not first.startswith("-"):
        return "settings go through --set KEY=VALUE (every KEY: dtlab train --help)"
    if not eq and len(extras) > 1 and not extras[1].startswith("-"):
        value = extras[1]
    key = key.replace("-", "_")
    section, dot, name = key.partition(".")
    if not dot and section_fields(key):  # a section (--strategy fsdp)
        names = ", ".join(section_fields(key))
        return f"settings go through --set: --set {key}.FIELD={value or '...'} (FIELD one of {names})"
    if not (dot and name in section_fields(section)):  # a bare field name (--steps, --lr): its setting
        homes = settings_named(name if dot else key, cutoff=0.7)  # (--optimizer.lrr: optimizer.lr)
        if not homes:
            return "settings go through --set KEY=VALUE (every KEY: dtlab train --help)"
        key = next((h for h in homes if dot and h.startswith(f"{section}.")), homes[0])
    return f"settings go through --set: --set {key}={value or '...'}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    try:
        args, extras = parser.parse_known_args(argv)
    except BrokenPipeError:  # --help into a reader that stopped early (| head)
        _stdout_to_devnull()
        return 0
    if extras:
        if args.command not in ("train", "config"):
            parser.error(f"unrecognized arguments: {' '.join(extras)}")
        parser.exit(
            2,
            f"dtlab {args.command}: error: unrecognized arguments: {' '.join(extras)}; "
            f"{_setting_hint(extras)}\n",
        )
    if argv is not None:  # a call from Python: its warnings stay as the caller prints or records them
        return _run(args, argv)
    with warnings.catch_warnings():
        warnings.showwarning = _warning_printer(args.command)
        return _run(args, argv)


def _run(args: argparse.Namespace, argv: Sequence[str] | None) -> int:
    from dtlab.errors import DtlabError, RankFailedError

    handler = {
        "train": _train,
        "config": _config,
        "consolidate": _consolidate,
        "plot": _plot,
        "bench": _bench,
        "advise": _advise,
    }[args.command]
    try:
        return handler(args)
    except RankFailedError as exc:
        cause = exc.__cause__
        msg = f"{type(cause).__name__}: {cause}" if isinstance(cause, DtlabError) else str(exc)
        print(f"dtlab {args.command}: error on rank {exc.rank}: {msg}", file=sys.stderr)
        return 2 if isinstance(cause, DtlabError) else 1
    except DtlabError as exc:
        print(f"dtlab {args.command}: error: {exc}", file=sys.stderr)
        _end_mpi_job(2, argv)
        return 2
    except KeyboardInterrupt:
        print(f"dtlab {args.command}: interrupted", file=sys.stderr)
        return 130
    except BaseException:
        import traceback

        traceback.print_exc()
        _end_mpi_job(1, argv)
        raise
    finally:
        if argv is None and args.command == "train":  # the program, not a call from Python
            from dtlab.trainers.preemption import finish_process

            finish_process()  # a signal during the teardown exits at once; a teardown without a full gc


def _end_mpi_job(code: int, argv: Sequence[str] | None) -> None:
    """The program (not a call from Python) failing in one rank of an MPI job of several: the job ends
    with ``code`` (``MPI.COMM_WORLD.Abort``). Exiting alone would leave it hung for ever: MPI has no
    time-outs, so the peers wait in their next collective and this process in ``MPI_Finalize``."""
    mpi = sys.modules.get("mpi4py.MPI")  # only a process that started MPI
    if argv is not None or mpi is None or not mpi.Is_initialized() or mpi.Is_finalized():
        return
    if mpi.COMM_WORLD.Get_size() > 1:
        from dtlab.backends._mpi_abort import end_mpi_job

        end_mpi_job(mpi, code)


if __name__ == "__main__":
    sys.exit(main())
