"""A bounded soak of `sluice serve` (not part of the test suite): N chat requests, multi-turn conversations that
follow up on snapshots and fresh ones, streamed and not, some cancelled; the server's RSS sampled throughout.

    .venv/bin/python tests/soak.py --requests 300 [--model STORE] [--snapshot-ram 256MiB] [--max-growth-mib 150]

Prints requests, errors, RSS at start (after the first requests warmed it), at the end and its peak; exits 1 if
the RSS grew from the warm start by more than the snapshots' RAM (--snapshot-ram, which fills as conversations
accumulate) plus --max-growth-mib (the bound this checks), or if any request failed.
"""

from __future__ import annotations

import argparse
import random
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

WORDS = "river mountain light engine sluice token expert memory window garden signal harbour".split()


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def one(url: str, rng: random.Random, history: list) -> bool:
    """One request: a new conversation or a follow-up of an earlier one; True when it answered as it should."""
    if history and rng.random() < 0.5:
        msgs = rng.choice(history) + [{"role": "user", "content": " ".join(rng.choices(WORDS, k=rng.randint(3, 40)))}]
    else:
        msgs = [{"role": "user", "content": " ".join(rng.choices(WORDS, k=rng.randint(3, 400)))}]
    body = {"model": "soak", "messages": msgs, "max_tokens": rng.randint(4, 24), "temperature": rng.choice([0, 0.7])}
    if rng.random() < 0.3:
        with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}, timeout=300) as r:
            for i, _ in enumerate(r.iter_lines()):
                if rng.random() < 0.1 and i > 2:
                    return r.status_code == 200  # leaves mid-stream: the server cancels the job
        return r.status_code == 200
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=300)
    if r.status_code != 200:
        return False
    history.append(msgs + [{"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]}])
    del history[:-50]
    return True


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--model", help="store or checkpoint (default: the bundled model)")
    ap.add_argument("--snapshot-ram", default="256MiB")
    ap.add_argument("--max-growth-mib", type=float, default=150.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "sluice.cli", "serve", "--device", "cpu", "--port", str(port), "--model-id", "soak",
           "--snapshot-ram", args.snapshot_ram, "--log-format", "json", *(["--model", args.model] if args.model else [])]
    server = subprocess.Popen(cmd, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        rng, history, errors, done = random.Random(args.seed), [], 0, 0
        warm = max(20, args.requests // 10)
        start = peak = 0.0
        with ThreadPoolExecutor(args.concurrency) as pool:
            for batch in range(0, args.requests, args.concurrency):
                n = min(args.concurrency, args.requests - batch)
                seeds = [rng.random() for _ in range(n)]
                ok = list(pool.map(lambda x: one(url, random.Random(x), history), seeds))
                errors += ok.count(False)
                done += n
                rss = rss_mib(server.pid)
                if done >= warm and not start:
                    start = rss
                peak = max(peak, rss)
        end = rss_mib(server.pid)
        health = httpx.get(url + "/health").status_code
    finally:
        server.terminate()
        server.wait(timeout=60)
    from sluice.pipeline.config import parse_size

    bound = parse_size(args.snapshot_ram, "--snapshot-ram") / 2**20 + args.max_growth_mib
    print(f"requests {done}  errors {errors}  health {health}  RSS start {start:.0f} MiB (after {warm})  end {end:.0f} MiB  "
          f"peak {peak:.0f} MiB  growth {end - start:+.0f} MiB (bound {bound:.0f}: snapshots {args.snapshot_ram} + "
          f"{args.max_growth_mib:.0f} MiB)")
    return 0 if errors == 0 and health == 200 and end - start <= bound else 1


if __name__ == "__main__":
    sys.exit(main())
