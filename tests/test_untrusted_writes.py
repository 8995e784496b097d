"""Files dtlab writes are never written through a symbolic link planted at their name: streams
(``metrics.jsonl``, ``metrics.csv``) refuse the link and name it, whole files (``profile.json``,
``loss.png``, ``consolidate -o``) replace it; the file it pointed to is untouched either way."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dtlab.checkpoint.files import durable_write
from dtlab.checkpoint.safe_files import open_text, replace_file
from dtlab.errors import CheckpointError, UnsafePathError
from dtlab.trainers.metrics import MetricsCollector
from tests._capped import run_cli
from tests.test_untrusted_checkpoint import make_checkpoint

TINY = [
    "--set", "backend.world_size=2", "--set", "train.steps=2", "--set", "train.eval_every=0",
    "--set", "model.d_model=16", "--set", "model.n_layers=1", "--set", "model.n_heads=2",
    "--set", "model.seq_len=16", "--set", "data.max_bytes=20000", "--set", "data.global_batch_size=4",
    "--quiet",
]  # fmt: skip


def _victim(tmp_path: Path, name: str = "victim.txt") -> Path:
    victim = tmp_path / "outside" / name
    victim.parent.mkdir(exist_ok=True)
    victim.write_text("precious\n")
    return victim


def test_streams_refuse_a_link_or_a_fifo_and_name_it(tmp_path: Path) -> None:
    victim = _victim(tmp_path)
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").symlink_to(victim)
    for append in (False, True):
        with pytest.raises(UnsafePathError, match=r"metrics\.jsonl is a symbolic link; .*logging\.run_dir"):
            MetricsCollector(run / "metrics.jsonl", append=append)
    os.mkfifo(run / "fifo")
    with pytest.raises(UnsafePathError, match=r"fifo (is not a regular file|cannot be opened for writing)"):
        open_text(run / "fifo", append=False)  # returns at once: never waits for a reader
    with pytest.raises(CheckpointError, match="is a symbolic link"):
        durable_write(run / "metrics.jsonl", b"x")
    assert victim.read_text() == "precious\n"
    with open_text(run / "fresh.jsonl", append=False) as f:
        f.write("ok\n")
    assert (run / "fresh.jsonl").read_text() == "ok\n"


def test_whole_files_replace_a_link_instead_of_writing_through_it(tmp_path: Path) -> None:
    victim = _victim(tmp_path)
    link = tmp_path / "profile.json"
    link.symlink_to(victim)
    replace_file(link, b"{}")
    assert not link.is_symlink() and link.read_bytes() == b"{}" and victim.read_text() == "precious\n"
    with pytest.raises(UnsafePathError, match="is a directory"):
        replace_file(tmp_path / "outside", b"{}")


def test_run_files_consolidate_output_and_a_crafted_trainer_state(tmp_path: Path) -> None:
    """Links planted at the run's files and at ``consolidate -o``; then a crafted trainer state
    (``'int' object has no attribute 'param_groups'`` and ``trainer.step=1e12`` trained 0 steps and
    exited 0 before): the step directory is corrupt, named, and a resume falls back past it."""
    make_checkpoint(tmp_path / "ck0")
    victim = _victim(tmp_path)
    (tmp_path / "out.link").symlink_to(victim)
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "a_dir").mkdir()
    dangling = tmp_path / "run_m"
    dangling.mkdir()
    (dangling / "metrics.jsonl").symlink_to(tmp_path / "outside" / "created.txt")
    planted = tmp_path / "run_p"
    planted.mkdir()
    (planted / "profile.json").symlink_to(victim)
    (planted / "loss.png").symlink_to(victim)
    cases = [
        ["consolidate", "ck0", "-o", "out.link"],
        ["consolidate", "ck0", "-o", "a_dir"],
        ["consolidate", "ck0", "-o", "a_file/model.safetensors"],
        ["train", *TINY, "--set", "logging.run_dir=run_m"],
        [
            "train",
            *TINY,
            "--set",
            "logging.run_dir=run_p",
            "--set",
            "checkpoint.dir=ck",
            "--set",
            "checkpoint.every=1",
        ],
    ]
    r = run_cli(cases, cwd=tmp_path, timeout=400)
    assert r[0]["rc"] == 0 and not (tmp_path / "out.link").is_symlink(), r[0]
    assert (tmp_path / "out.link").read_bytes()[:8] != b"precious"
    assert r[1]["rc"] == 2 and "-o a_dir is a directory; give a file name" in r[1]["stderr"], r[1]
    assert r[2]["rc"] == 2 and "a_file is a file, not a directory" in r[2]["stderr"], r[2]
    assert r[3]["rc"] == 2 and "metrics.jsonl is a symbolic link" in r[3]["stderr"], r[3]
    assert r[4]["rc"] == 0, r[4]
    assert not (planted / "profile.json").is_symlink() and not (planted / "loss.png").is_symlink()
    for run in r:
        assert "Traceback" not in run["stderr"], run
    assert victim.read_text() == "precious\n" and not (tmp_path / "outside" / "created.txt").exists()
    _crafted_trainer_state(tmp_path)


def _crafted_trainer_state(tmp_path: Path) -> None:
    import json

    ck = ["--set", "checkpoint.dir=ck", "--set", "logging.run_dir=null"]
    step2 = tmp_path / "ck" / "step_00000002" / "meta.json"
    meta = json.loads(step2.read_text())
    meta["trainer"]["scheduler"]["optimizer"] = 1
    step2.write_text(json.dumps(meta))
    import shutil

    shutil.copytree(tmp_path / "ck", tmp_path / "ck2")
    step1 = tmp_path / "ck2" / "step_00000001" / "meta.json"
    meta1 = json.loads(step1.read_text())
    meta1["trainer"]["step"] = 1e12
    step1.write_text(json.dumps(meta1))  # in ck2 both steps are crafted: nothing verifies
    far = tmp_path / "ck3" / f"step_{10**12:08d}"  # a consistent checkpoint of step 10**12
    shutil.copytree(tmp_path / "ck" / "step_00000001", far)
    meta3 = json.loads((far / "meta.json").read_text())
    meta3["step"] = meta3["trainer"]["step"] = 10**12
    (far / "meta.json").write_text(json.dumps(meta3))
    resume = ["--set", "checkpoint.resume=true", "--set", "train.steps=3"]
    runs = run_cli(
        [
            ["train", *TINY, *ck, *resume, "--set", "checkpoint.strict_resume=true"],
            ["train", *TINY, *ck, "--set", "checkpoint.resume=ck/step_00000002"],
            ["train", *TINY, "--set", "checkpoint.dir=ck2", "--set", "logging.run_dir=null", *resume],
            ["train", *TINY, *ck, *resume],
            ["train", *TINY, "--set", "checkpoint.dir=ck3", "--set", "logging.run_dir=null", *resume],
        ],
        cwd=tmp_path,
        timeout=300,
    )
    crafted = "trainer.scheduler holds 'optimizer', a key the live state does not have"
    for run in runs[:3]:
        assert run["rc"] == 2 and "Traceback" not in run["stderr"] and crafted in run["stderr"], run
    assert "no checkpoint in ck2 can be resumed" in runs[2]["stderr"], runs[2]
    assert "trainer.step=1000000000000.0, expected an integer" in runs[2]["stderr"], runs[2]
    assert runs[3]["rc"] == 0 and "fell back to step_00000001" in runs[3]["stderr"], runs[3]
    assert runs[4]["rc"] == 2 and "is of step 1000000000000, past train.steps=3" in runs[4]["stderr"], runs[4]


def test_an_output_that_cannot_be_written_is_one_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``dtlab plot -o``, ``consolidate -o`` and ``bench --out`` where nothing can be written: one line
    naming the path, exit 2, not an OSError traceback about a temporary file."""
    from dtlab.cli import main

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 2.5}\n{"step": 2, "loss": 2.0}\n')
    (tmp_path / "a_file").write_text("x")
    assert main(["plot", str(run), "-o", str(tmp_path / "a_file" / "cmp.png")]) == 2
    assert main(["bench", "--out", str(tmp_path / "a_file" / "bench")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith(f"dtlab plot: error: {tmp_path / 'a_file' / 'cmp.png'} cannot be written: "), err
    assert err[1].startswith(
        f"dtlab bench: error: --out {tmp_path / 'a_file' / 'bench'} cannot be created"
    ), err
    if Path("/proc/self").exists():  # Linux: a directory where no file can be created
        make_checkpoint(tmp_path / "ck0")
        assert main(["consolidate", str(tmp_path / "ck0"), "-o", "/proc/dtlab-model.safetensors"]) == 2
        msg = capsys.readouterr().err
        assert msg.startswith(
            "dtlab consolidate: error: -o /proc/dtlab-model.safetensors cannot be written"
        ), msg
