"""The command line: the README's first command on the default model, repack/verify, errors."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from sluice.cli import main


def fresh_env(home) -> dict:
    """A new user's environment: an empty SLUICE_HOME and HOME; PYTHONPATH kept, so `-m sluice.cli` runs this tree."""
    return {"SLUICE_HOME": str(home), "PATH": "/usr/bin:/bin", "HOME": str(home), "PYTHONPATH": os.environ.get("PYTHONPATH", "")}


def test_generate_default_model_from_a_fresh_home(tmp_path):
    env = fresh_env(tmp_path)
    r = subprocess.run(
        [sys.executable, "-m", "sluice.cli", "generate", "--prompt", "Hello", "--max-new-tokens", "6", "--device", "cpu"],
        capture_output=True, text=True, env=env, timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert "6 new tokens" in r.stderr and r.stdout.strip()  # the trained default model, repacked once
    assert list((tmp_path / "stores").glob("default-*/manifest.json"))


def test_generated_text_holds_no_program_messages(tmp_path):
    """stdout holds the text and nothing else; in a terminal (stdout and stderr on one stream) the text comes whole
    after the program's messages, and transformers' advice to install CUDA kernel packages is not shown on a CPU."""
    env = fresh_env(tmp_path)
    cmd = [sys.executable, "-m", "sluice.cli", "generate", "--prompt", "The quick brown fox", "--max-new-tokens", "12", "--device", "cpu"]
    alone = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert alone.returncode == 0, alone.stderr
    one = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, timeout=300).stdout
    text = alone.stdout
    assert text.strip() and "[transformers]" not in text and "falling back" not in alone.stderr
    assert text in one and "falling back" not in one  # greedy: the same text, uninterrupted
    assert one.endswith(text + one.split(text)[-1]) and one.split(text)[-1].startswith("[")  # after it, the run's summary only


def test_random_fallback_model(tmp_path, monkeypatch):
    from sluice.models.builtin import random_model_path

    monkeypatch.setenv("SLUICE_HOME", str(tmp_path))
    path = random_model_path()
    assert (path / "config.json").exists() and random_model_path() == path


def test_repack_and_verify_commands(checkpoints, tmp_path, capsys):
    store = tmp_path / "store"
    assert main(["repack", str(checkpoints["qwen3_moe"]), str(store)]) == 0
    assert main(["verify", str(store)]) == 0
    assert "OK" in capsys.readouterr().out
    assert main(["repack", str(checkpoints["nemotron_h"]), str(store)]) == 1
    assert "--force" in capsys.readouterr().err


def test_errors_are_one_line(tmp_path, capsys):
    assert main(["generate", "--model", str(tmp_path / "nope"), "--prompt", "x", "--device", "cpu"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("sluice: error:") and "Traceback" not in err


def test_bench_model_profiles_decode_and_a_prompt(stores, capsys):
    """`bench model --profile`: where a decode step's time goes, then a prompt's of the longest length asked for."""
    assert main(["bench", "model", "--model", str(stores["nemotron_h"]), "--device", "cpu", "--prompt-lengths", "4,8",
                 "--decode-tokens", "2", "--profile"]) == 0
    text = capsys.readouterr().out
    assert "profile of a 8-token prompt on the VRAM tier as opened (as the table's first column), per prompt token:" in text
    assert text.count("cProfile wall") == 2
    assert "(extend)" in text.split("profile of a 8-token prompt")[1]  # the prompts, not the decode steps


def test_bench_model_compares_schedules_in_one_table(stores, tmp_path, capsys):
    """`bench model --compare` runs each schedule on the same model and prints one table with the bandwidths
    measured in the same run; --json keeps every schedule's figures, a schedule run twice under a second name."""
    import json

    out = tmp_path / "cmp.json"
    assert main(["bench", "model", "--model", str(stores["nemotron_h"]), "--device", "cpu", "--compare", "serial,overlap,hybrid,serial",
                 "--prompt-lengths", "8", "--decode-tokens", "3", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    rows = [line.split()[0] for line in text.splitlines()[2:6]]  # under the routing line and the head
    assert rows == ["serial", "overlap", "hybrid", "serial#2"] and "measured in this run: host RAM read" in text
    figures = json.loads(out.read_text())
    assert set(figures) == {"serial", "overlap", "hybrid", "serial#2"} and all(f["decode"]["tokens"] == 3 for f in figures.values())
    assert figures["hybrid"]["decode"]["cpu_blocks_per_token"] > 0 and figures["serial"]["decode"]["cpu_blocks_per_token"] == 0


def test_bench_cpu_one_table_per_thread_count(capsys):
    """`bench cpu --threads 1 2` measures the CPU expert kernels at each thread count, each table with the
    memory read rate measured at that count."""
    import torch

    before = torch.get_num_threads()
    try:
        assert main(["bench", "cpu", "--threads", "1", "2", "--shape", "qwen3-30b", "--format", "nvfp4"]) == 0
    finally:
        torch.set_num_threads(before)
    text = capsys.readouterr().out
    assert text.count("ceilings: RAM read") == 2 and "threads 1\n" in text and "threads 2\n" in text
    rows = [line for line in text.splitlines() if line.startswith("cpu expert (swiglu)")]
    assert len(rows) == 2 and all(float(r.split()[5]) > 0 for r in rows)


def test_bench_cpu_calls_fit_a_call_and_a_block():
    """`bench cpu --calls`' figures: a call's microseconds by count three ways, and the line through them; the table
    names each way and the fitted parts (a made-up curve of 100 us a call and 50 a block reads back as such)."""
    import torch

    from sluice.benchmarks.cpu_kernels import bench_calls, format_calls
    from sluice.kernels.cpu_native import native_kernels

    if native_kernels() is None:
        pytest.skip("no C compiler here: no native calls to time")
    ways, h2d = bench_calls("qwen3-30b", "nvfp4", counts=(1, 2), calls=3, gap_us=10, bank_bytes=0)
    assert set(h2d) == ({"alone", 1, 2} if torch.cuda.is_available() else set())
    assert [w for w, _ in ways][:3] == ["back to back", "after 10 us", "in cache"] and ways[-1][0].startswith("beside")
    assert ways[-1][0].endswith(" busy") and int(ways[-1][0].split()[1]) >= 1
    assert all(set(us) == {1, 2} and min(us.values()) > 0 for _, us in ways)
    text = format_calls([("made up", {1: 150.0, 2: 200.0, 4: 300.0})], block_mb=5.0)
    assert "100.0 +  50.0" in text and "100.0" in text.splitlines()[1].split()[-1]
    text = format_calls([("made up", {1: 150.0, 2: 200.0})], 5.0, {"alone": 54.0, 1: 40.0, 2: 30.0})
    assert text.splitlines()[-1].split()[3:5] == ["40.0", "30.0"] and "(alone 54.0)" in text
    with pytest.raises(SystemExit, match="unknown shape 'nope'"):
        main(["bench", "cpu", "--calls", "--shape", "nope"])
    if not native_kernels().sluice_q8_available():  # int8 asked for where it cannot run: said, not timed as fp32
        with pytest.raises(SystemExit, match="need AVX-512 VNNI"):
            bench_calls("qwen3-30b", "nvfp4", counts=(1,), calls=1, int8=True, bank_bytes=0)


def test_bench_cpu_pairs_fit_a_blocks_first_row_and_each_next():
    """`bench cpu --pairs`' figures: microseconds a block by its rows, and the line through them read as a block's first
    row and each next (a made-up 150 us for one row and 50 for each next reads back as such)."""
    import torch

    from sluice.benchmarks.cpu_kernels import bench_pairs, format_pairs
    from sluice.kernels.cpu_native import native_kernels

    if native_kernels() is None:
        pytest.skip("no C compiler here: no native calls to time")
    alone, beside = bench_pairs("qwen3-30b", "nvfp4", rows=(1, 2), blocks=2, calls=2, bank_bytes=0)
    assert set(alone) == {1, 2} and min(alone.values()) > 0 and set(beside) == (set(alone) if torch.cuda.is_available() else set())
    text = format_pairs({1: 150.0, 2: 200.0, 4: 300.0}, {}, block_mb=6.0)
    assert "150.0 +      50.0" in text and text.splitlines()[1].split()[-1] == "40.0" and len(text.splitlines()) == 2
    with pytest.raises(SystemExit, match="bench cpu --pairs: unknown shape 'nope'"):
        main(["bench", "cpu", "--pairs", "--shape", "nope"])


def test_bench_kernels_sweep_names_its_kernels(capsys):
    """A kernel name `bench kernels --sweep --only` does not know is refused by name, before any GPU is looked for."""
    with pytest.raises(SystemExit) as e:
        main(["bench", "kernels", "--sweep", "--only", "prefil-up"])
    assert e.value.code == 2 and "invalid choice: 'prefil-up'" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["generate", "chat", "serve"])
def test_help_shows_the_defaults(command, capsys):
    """Each command's --help names its defaults; generate and chat take --max-tokens (the OpenAI name) as
    --max-new-tokens."""
    from sluice.cli import _parser

    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert "--device DEVICE auto | cpu | cuda | cuda:N (default: auto" in text and "(default: auto: direct where" in text
    if command == "serve":
        assert "(default: 127.0.0.1" in text and "(default: 8000)" in text and "LRU (default: 2GiB)" in text
        return
    for default in ("name (default: 64)", "0 is greedy (default: 0.0)", "1 keeps all (default: 1.0)", "seed of the sampler (default: a new one"):
        assert default in text, default
    args = _parser().parse_args([command, "--max-tokens", "5"] + (["--prompt", "x"] if command == "generate" else []))
    assert args.max_new_tokens == 5


def test_cold_bench_refuses_a_schedule_that_holds_every_block(stores, capsys):
    """`bench model --cold` times reads from disk: a schedule holding every block in RAM (direct; auto where they
    fit) would read none, so it is refused by name."""
    assert main(["bench", "model", "--model", str(stores["nemotron_h"]), "--device", "cpu", "--cold", "--prompt-lengths", "4",
                 "--decode-tokens", "2"]) == 1
    assert "--cold: schedule 'direct' holds every expert block in RAM" in capsys.readouterr().err
