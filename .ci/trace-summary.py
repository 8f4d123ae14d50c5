"""On the GPU machine (.ci/gpu-day PART=day): a `--trace` run's stage lines (FILE.jsonl) summed up: the CPU's calls
(`compute:cpu` host spans) by their count of blocks and by layer, and each stage's GPU time per token, so a slow run's
time shows where it went.   python3 .ci/trace-summary.py TRACE.json.jsonl"""
import collections
import json
import statistics
import sys

rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
steps = len({r["step"] for r in rows}) or 1
cpu = [r for r in rows if r.get("event") == "stage" and r.get("stage") == "compute:cpu"]
by_count, by_layer = collections.defaultdict(list), collections.defaultdict(list)
for r in cpu:
    by_count[r.get("blocks", "?")].append(r["host_us"])
    by_layer[r["layer"]].append(r["host_us"])
print(f"{steps} steps; the CPU's calls: {len(cpu)}, {sum(r['host_us'] for r in cpu) / steps / 1000:.2f} ms a step on the host")
for n, us in sorted(by_count.items(), key=lambda kv: str(kv[0])):
    print(f"  {n} blocks: {len(us):5} calls, median {statistics.median(us):7.1f} us, slowest tenth from {sorted(us)[9 * len(us) // 10]:7.1f} us")
slow = sorted(by_layer.items(), key=lambda kv: -statistics.median(kv[1]))[:5]
print("  layers with the slowest median call: " + ", ".join(f"{layer} ({statistics.median(us):.0f} us)" for layer, us in slow))
gpu, host = collections.defaultdict(float), collections.defaultdict(float)
for r in rows:
    if r.get("event") == "gpu":
        gpu[r["stage"]] += r["gpu_us"]
    elif r.get("event") == "stage":
        host[r["stage"]] += r["host_us"]
print("ms a step, by stage:  " + "  ".join(f"{k} host {host.get(k, 0) / steps / 1000:.2f} gpu {gpu.get(k, 0) / steps / 1000:.2f}"
                                           for k in sorted(set(gpu) | set(host))))
