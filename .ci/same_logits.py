"""Logits of the fast schedule under several settings, saved for comparison between two versions of Sluice (the
A/B's base tree and this one): `python3 .ci/same_logits.py STORE OUT.pt`, then `--compare A.pt B.pt`. Reads either
schedule format (the old one-stage `direct`, or the stages' `via: table` variants), so the check spans the split.
SAME_EXTRA (JSON) adds engine settings, e.g. '{"static_kv": 64, "whole_step": false}' against '{"static_kv": 64}': a
step replayed whole against the same step layer by layer."""

import json
import os
import sys

import torch
import yaml

SETTINGS = {  # name -> knobs, each placed on the stage that has it
    "staged": dict(token_ahead=3, refresh=2, prompt_group=2),
    "late": dict(shared="late", refresh=2),
    "stream": dict(hold=False, refresh=2, prompt_group=2),
    "ahead": dict(prompt_group=2, prompt_ahead=2, refresh=2),
    "inplace": dict(prompt_group=0, prompt_ahead=0, prompt_fill=False),
}
PLACE = {"token_ahead": "h2d", "prompt_group": "h2d", "prompt_ahead": "h2d", "prompt_fill": "h2d", "shared": "route",
         "refresh": "fetch", "hold": "fetch"}


def schedule(knobs: dict, split: bool) -> dict:
    if not split:
        return {"name": "same", "stages": {"direct": dict(knobs)}}
    stages = {n: {"via": "table"} for n in ("route", "predict", "fetch", "h2d", "compute")} | {"combine": {}}
    for k, v in knobs.items():
        stages[PLACE[k]][k] = v
    return {"name": "same", "stages": stages}


def run(store: str, out: str) -> None:
    import sluice
    import sluice.stages

    split = hasattr(sluice.stages, "VARIANTS")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    saved = {}
    for name, knobs in SETTINGS.items():
        path = f"/tmp/same-{name}.yaml"
        with open(path, "w") as f:
            yaml.safe_dump(schedule(knobs, split), f)
        extra = json.loads(os.environ.get("SAME_EXTRA", "{}"))
        with sluice.load(store, device=device, schedule=path, vram_slots=24, **extra) as engine:
            seq, ids, rows = engine.new_sequence(), [5, 9, 17, 3, 22, 8, 40, 2], []
            logits = engine.extend(seq, ids)[-1]
            for _ in range(12):
                rows.append(logits.float().cpu())
                logits = engine.extend(seq, [int(logits.argmax())])[-1]
            saved[name] = torch.stack(rows)
    torch.save(saved, out)
    print(f"saved {len(saved)} settings ({'stages' if split else 'one direct stage'}) to {out}")


def compare(a: str, b: str) -> int:
    x, y = torch.load(a), torch.load(b)
    bad = [k for k in x if not torch.equal(x[k], y[k])]
    for k in x:
        print(f"{k:8s} {'same' if k not in bad else 'DIFFERENT'}  max |diff| {(x[k] - y[k]).abs().max().item():.3g}")
    return 1 if bad else 0


if __name__ == "__main__":
    if sys.argv[1] == "--compare":
        sys.exit(compare(sys.argv[2], sys.argv[3]))
    run(sys.argv[1], sys.argv[2])
