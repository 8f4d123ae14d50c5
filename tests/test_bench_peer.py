"""`sluice bench peer` and `bench routing`: the parts that need no GPU (placement at a budget, the table's ratios,
routing statistics)."""

from __future__ import annotations

from sluice.benchmarks.llama import GGUFSizes, ncmoe_for
from sluice.benchmarks.peer import format_table
from sluice.cli import main

GiB = 2**30


def test_ncmoe_fits_the_budget():
    sizes = GGUFSizes({1: GiB, 3: GiB, 5: GiB, 7: GiB}, other=2 * GiB)  # MoE blocks 1, 3, 5, 7 (hybrid: every other)
    assert sizes.on_gpu(0) == 6 * GiB and sizes.on_gpu(4) == 4 * GiB and sizes.on_gpu(8) == 2 * GiB
    assert ncmoe_for(sizes, budget=5 * GiB, overhead=GiB // 2) == 4  # blocks 0-3 on the CPU: 4 GiB of weights, 4.5 in all
    assert ncmoe_for(sizes, budget=20 * GiB, overhead=GiB) == 0
    assert ncmoe_for(sizes, budget=GiB, overhead=GiB) == 8  # nothing fits: every expert on the CPU


def _sluice(schedule, routing, decode, pp, roofline):
    return {"schedule": schedule, "routing": routing, "vram_peak": 7 * GiB, "bench": {
        "decode": {"tok_s": decode, "ms_per_token_median": 1000 / decode, "roofline_ms_per_token": roofline},
        "prefill": {"512": {"tok_s": pp}}}}


def test_table_ratios_are_against_llama_at_the_budget():
    out = {"prompts": [512], "decode_tokens": 64, "vram_budget": 8 * GiB, "h2d_gbps": 55.0, "ram_read_gbps": 90.0,
           "expert_format": "NVFP4",
           "llama": [{"placement": "all on the GPU", "tok_s": {"pp512": 6000.0, "tg64": 300.0}, "vram_peak": 23 * GiB},
                     {"placement": "-ncmoe 44 (budget)", "tok_s": {"pp512": 1000.0, "tg64": 50.0}, "vram_peak": 7 * GiB}],
           "sluice": [_sluice("direct", "uniform:recall=0.7", 25.0, 2000.0, 30.0)],
           "resident_alone": {"bench": {"decode": {"ms_per_token_median": 10.0}}}}
    table = format_table(out, "shape")
    row = next(line for line in table.splitlines() if line.startswith("| Sluice NVFP4"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1:4] == ["direct", "uniform:recall=0.7", "25.0"]
    assert cells[5] == "0.50 / 2.00"  # decode 25 / 50, prefill 2000 / 1000
    assert cells[7] == "40.00" and cells[8] == "1.00"  # roofline: PCIe 30 ms + resident alone 10 ms; 40 ms measured
    assert "pinned H2D 55.0 GB/s, host RAM read 90.0 GB/s" in table


def test_bench_routing_prints_each_setting(capsys):
    assert main(["bench", "routing", "--layers", "4", "--experts", "32", "--top-k", "4", "--tokens", "300",
                 "--routing", "uniform,skewed:popularity=1.5,reuse=0.2"]) == 0
    text = capsys.readouterr().out
    rows = [line for line in text.splitlines() if line.startswith("| uniform") or line.startswith("| skewed")]
    assert len(rows) == 2 and "skewed:popularity=1.5,reuse=0.2,recall=0.7" in rows[1]


def test_a_run_cut_off_keeps_the_rows_it_measured(stores, tmp_path, monkeypatch):
    """The JSON is rewritten after every run, so a call that runs past its time limit keeps what it measured; the
    check fails when only the end writes it (the second run never returns here)."""
    import json
    from types import SimpleNamespace

    import pytest

    from sluice.benchmarks import peer

    done = []

    def fake_run(args, routing, schedule):
        if done:
            raise KeyboardInterrupt  # the time limit
        done.append(schedule)
        return _sluice(schedule, routing, 25.0, 2000.0, 30.0)

    monkeypatch.setattr(peer, "_sluice_run", fake_run)
    path = tmp_path / "peer.json"
    args = SimpleNamespace(vram_budget="8GiB", prompt_lengths="512", decode_tokens=4, model=str(stores["qwen3_moe"]),
                           gguf=None, routing="uniform", schedules="direct,overlap", resident_alone=False, json=str(path))
    with pytest.raises(KeyboardInterrupt):
        peer.run_peer(args)
    assert [s["schedule"] for s in json.loads(path.read_text())["sluice"]] == ["direct"]
