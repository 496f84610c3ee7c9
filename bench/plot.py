#!/usr/bin/env python3
"""Pictures for the README: the main demo's loss curve, and Tandem's bench
figures against PyTorch's from one ./dev bench run.

Usage: plot.py LOSSES_CSV BENCH_JSONL OUT_DIR [FT_TIMELINE_CSV]
Writes OUT_DIR/loss.png (from gpt's --losses CSV), OUT_DIR/bench.png
(time of each Tandem line divided by PyTorch's from the same run, over TCP
and over shared memory; below 1 is faster) and OUT_DIR/ft.png (ft_bench's
--timeline: the job's committed steps a second through a replica's
failure, per-step fault tolerance beside restart-the-world). A missing
input skips its picture.
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


def plot_ft(path, out):
    runs = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            runs.setdefault(row["mode"], []).append(float(row["t_s"]))
    if not runs:
        return False
    fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=110)
    labels = {"per_step": "per-step fault tolerance (ft::Manager)",
              "restart": "restart the world from a checkpoint"}
    window = 0.25  # seconds: steps committed in the window before each point
    for mode, times in runs.items():
        times.sort()
        xs, ys = [], []
        t, end = times[0], times[-1]
        while t <= end:
            n = sum(1 for v in times if t - window < v <= t)
            xs.append(t)
            ys.append(n / window)
            t += 0.05
        ax.plot(xs, ys, label=labels.get(mode, mode))
    ax.axvline(0.0, color="black", linewidth=1, linestyle="--")
    ax.text(0.02, 0.97, "replica 3 killed", transform=ax.get_xaxis_transform(), va="top",
            fontsize="small")
    ax.set_xlabel("seconds from the kill")
    ax.set_ylabel("committed steps / s")
    ax.set_title("ft_bench: 4 replicas, one SIGKILLed")
    ax.legend(loc="lower right", fontsize="small")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return True


def main(argv):
    if len(argv) not in (3, 4):
        print(__doc__.strip(), file=sys.stderr)
        return 2
    losses, bench, out_dir = argv[:3]
    timeline = argv[3] if len(argv) == 4 else None
    os.makedirs(out_dir, exist_ok=True)
    pictures = [("loss.png", plot_losses, losses), ("bench.png", plot_bench, bench)]
    if timeline:
        pictures.append(("ft.png", plot_ft, timeline))
    for name, fn, src in pictures:
        if not os.path.exists(src):
            print(f"plot.py: {src} not found, no {name}", file=sys.stderr)
            continue
        target = os.path.join(out_dir, name)
        print(f"plot.py: wrote {target}" if fn(src, target) else f"plot.py: nothing to draw in {src}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
