#!/usr/bin/env python3
"""Pictures for the README: the main demo's loss curve, and Tandem's bench
figures against PyTorch's from one ./dev bench run.

Usage: plot.py LOSSES_CSV BENCH_JSONL OUT_DIR
Writes OUT_DIR/loss.png (from gpt's --losses CSV) and OUT_DIR/bench.png
(time of each Tandem line divided by PyTorch's from the same run, over TCP
and over shared memory; below 1 is faster). A missing input skips its picture.
"""
import csv
import os
import sys

import matplotlib

matplotlib.use("Agg")  # no display needed
import matplotlib.pyplot as plt  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import compare  # noqa: E402  (the same reading and medians as the table)

# The time metric each bench is compared by (lower is better).
TIME_METRIC = {"rpc_echo": "p50_us", "remote_create": "p50_us", "rref_to_here": "p50_us",
               "dist_backward": "p50_us", "mp_mlp_step": "ms", "ddp_step": "ms"}


def plot_losses(path, out):
    steps, losses = [], []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            steps.append(int(row["step"]))
            losses.append(float(row["loss"]))
    if not steps:
        return False
    fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=110)
    ax.plot(steps, losses, marker="o", markersize=3)
    ax.set_xlabel("step")
    ax.set_ylabel("mean loss since the previous point")
    ax.set_title("gpt (./dev demo): 2 pipeline stages x 2 data-parallel replicas")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return True


def plot_bench(path, out):
    with open(path, encoding="utf-8") as f:
        records = list(compare.read_records([f]))
    groups = {}
    for rec in records:
        key, value = compare.size_of(rec)
        groups.setdefault((rec["bench"], key, value), {}).setdefault(rec["impl"], []).append(rec)
    labels, tcp, shm = [], [], []
    for (bench, key, value), by_impl in groups.items():
        metric = TIME_METRIC.get(bench)
        if not metric or "pytorch" not in by_impl:
            continue
        torch = compare.best(compare.median_per_path(by_impl["pytorch"]), metric)
        if not torch or not torch.get(metric):
            continue
        ratios = []
        for impl in ("tandem", "tandem_shm"):
            r = compare.best(compare.median_per_path(by_impl.get(impl, [])), metric)
            ratios.append(r[metric] / torch[metric] if r else None)
        if ratios == [None, None]:
            continue
        labels.append(f"{bench} {compare.fmt_size(key, value)}".replace(" -", ""))
        tcp.append(ratios[0])
        shm.append(ratios[1])
    if not labels:
        return False
    fig, ax = plt.subplots(figsize=(7.2, 0.42 * len(labels) + 1.4), dpi=110)
    ys = range(len(labels))
    h = 0.38
    ax.barh([y - h / 2 for y in ys], [v or 0 for v in tcp], height=h, label="Tandem over TCP")
    ax.barh([y + h / 2 for y in ys], [v or 0 for v in shm], height=h,
            label="Tandem over shared memory")
    ax.axvline(1.0, color="black", linewidth=1)
    ax.set_xscale("log")
    ax.set_yticks(list(ys))
    ax.set_yticklabels(labels)
    ax.invert_yaxis()
    ax.set_xlabel("time / PyTorch's time, same run (log scale; below 1 is faster)")
    ax.legend(loc="lower right", fontsize="small")
    ax.grid(axis="x", alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return True


def main(argv):
    if len(argv) != 3:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    losses, bench, out_dir = argv
    os.makedirs(out_dir, exist_ok=True)
    for name, fn, src in (("loss.png", plot_losses, losses), ("bench.png", plot_bench, bench)):
        if not os.path.exists(src):
            print(f"plot.py: {src} not found, no {name}", file=sys.stderr)
            continue
        target = os.path.join(out_dir, name)
        print(f"plot.py: wrote {target}" if fn(src, target) else f"plot.py: nothing to draw in {src}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
