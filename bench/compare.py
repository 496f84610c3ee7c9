#!/usr/bin/env python3
"""Side-by-side table of Tandem's benchmark results and PyTorch's.

Reads JSON lines (as printed by build/bin/rpc_bench and bench/anchors/*.py)
from the files given, or stdin; lines that are not JSON objects are ignored.
Lines are grouped by `bench` and their size key (`bytes`, `hops` or `world`,
possibly absent; a pipeline line by its schedule, stages and chunks). For each
metric of the tandem lines it prints Tandem's value over TCP (column tandem;
also a line that names no transport), over shared memory (tandem_shm: lines
with "transport":"shm"), PyTorch's and raw_tcp's, and the ratios to PyTorch
and raw TCP.
Where PyTorch reports several paths (rpc_echo: python, builtin) the better one
is used: lowest time, highest gbps; its path is shown.

Usage: compare.py [--markdown] [FILE ...]
"""
import json
import sys

SIZE_KEYS = ("config", "bytes", "hops", "world")
METRICS = ("p50_us", "p99_us", "gbps", "ms", "local_ms", "overhead_ms", "ms_per_local",
           "record_us_per_rpc", "overlap", "samples_per_s", "single_worker_samples_per_s",
           "efficiency", "bubble",
           "init_ms", "all_to_all_ms", "shutdown_ms", "on_ns", "off_ns")
HIGHER_IS_BETTER = {"gbps", "overlap", "samples_per_s", "single_worker_samples_per_s",
                    "efficiency"}
HEADER = ("bench", "size", "metric", "tandem", "tandem_shm", "pytorch", "path", "raw_tcp",
          "tandem/pytorch", "shm/pytorch", "tandem/raw_tcp")
LEFT = {"bench", "size", "metric", "path"}  # text columns; the rest align right


def read_records(streams):
    for stream in streams:
        for line in stream:
            line = line.strip()
            if not line.startswith("{"):
                continue
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict) and "bench" in rec and "impl" in rec:
                if rec["impl"] == "tandem" and rec.get("transport") == "shm":
                    rec = dict(rec, impl="tandem_shm")
                yield with_derived(rec)


def with_derived(rec):
    """A step timed beside its local twin (ms, local_ms) also shows the
    distributed overhead, as a difference and as a ratio."""
    if rec.get("bench") == "pipeline" and "schedule" in rec:
        # One row group per schedule and shape.
        rec = dict(rec, config=f"{rec['schedule']} K={rec.get('stages')} M={rec.get('chunks')}")
    ms, local = rec.get("ms"), rec.get("local_ms")
    if isinstance(ms, (int, float)) and isinstance(local, (int, float)) and local > 0:
        rec = dict(rec, overhead_ms=round(ms - local, 3), ms_per_local=round(ms / local, 3))
    return rec


def size_of(rec):
    for key in SIZE_KEYS:
        if key in rec:
            return key, rec[key]
    return None, None


def fmt_size(key, value):
    if key is None:
        return "-"
    if key == "config":
        return str(value)
    if key == "bytes":
        n = int(value)
        for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
            if n >= scale and n % scale == 0:
                return f"{n // scale} {unit}"
        return f"{n} B"
    return f"{key}={value}"


def fmt_num(v):
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3f}".rstrip("0").rstrip(".")
    return str(v)


def ratio(a, b):
    if a is None or b is None or not isinstance(a, (int, float)) or not b:
        return "-"
    return f"{a / b:.2f}"


def best(recs, metric):
    """The record with the best value of metric, or None."""
    have = [r for r in recs if isinstance(r.get(metric), (int, float))]
    if not have:
        return None
    pick = max if metric in HIGHER_IS_BETTER else min
    return pick(have, key=lambda r: r[metric])


def median_per_path(recs):
    """Repeated runs of one implementation and path collapse to their median."""
    by_path = {}
    for r in recs:
        by_path.setdefault(r.get("path"), []).append(r)
    out = []
    for path, runs in by_path.items():
        merged = dict(runs[0])
        for m in METRICS:
            vals = sorted(r[m] for r in runs if isinstance(r.get(m), (int, float)))
            if vals:
                merged[m] = vals[len(vals) // 2]
        out.append(merged)
    return out


def build_rows(records):
    groups = {}  # (bench, size key, size value) -> {impl: [records]}; insertion-ordered
    for rec in records:
        key, value = size_of(rec)
        g = groups.setdefault((rec["bench"], key, value), {})
        g.setdefault(rec["impl"], []).append(rec)

    rows = []
    for (bench, key, value), by_impl in groups.items():
        tandem = by_impl.get("tandem", []) + by_impl.get("tandem_shm", [])
        # Rows follow the tandem lines' metrics; with none, show what others have.
        source = tandem or [r for recs in by_impl.values() for r in recs]
        metrics = [m for m in METRICS if any(m in r for r in source)]
        first = True
        for m in metrics:
            t, s, p, raw = (best(median_per_path(by_impl.get(i, [])), m)
                            for i in ("tandem", "tandem_shm", "pytorch", "raw_tcp"))
            tv, sv, pv, rv = (r[m] if r else None for r in (t, s, p, raw))
            # Name the PyTorch path only when it alone gave the best value.
            ties = [r for r in median_per_path(by_impl.get("pytorch", [])) if p and r.get(m) == pv]
            path = p.get("path", "-") if p and len(ties) == 1 else "-"
            rows.append((bench if first else "", fmt_size(key, value) if first else "", m,
                         fmt_num(tv), fmt_num(sv), fmt_num(pv), path,
                         fmt_num(rv), ratio(tv, pv), ratio(sv, pv), ratio(tv, rv)))
            first = False
    return rows


def print_text(rows):
    widths = [max(len(r[i]) for r in [HEADER] + rows) for i in range(len(HEADER))]

    def line(r):
        cells = (c.ljust(w) if h in LEFT else c.rjust(w) for c, w, h in zip(r, widths, HEADER))
        return "  ".join(cells).rstrip()

    print(line(HEADER))
    print("  ".join("-" * w for w in widths))
    for r in rows:
        print(line(r))


def print_markdown(rows):
    print("| " + " | ".join(HEADER) + " |")
    print("|" + "|".join("---" if h in LEFT else "---:" for h in HEADER) + "|")
    for r in rows:
        print("| " + " | ".join(r) + " |")


def main(argv):
    markdown = "--markdown" in argv
    files = [a for a in argv if a != "--markdown"]
    if any(a in ("-h", "--help") for a in files):
        print(__doc__.strip())
        return 0
    streams = []
    try:
        for f in files:
            streams.append(sys.stdin if f == "-" else open(f, encoding="utf-8", errors="replace"))
        rows = build_rows(read_records(streams or [sys.stdin]))
    except OSError as e:
        print(f"compare.py: {e}", file=sys.stderr)
        return 2
    finally:
        for s in streams:
            if s is not sys.stdin:
                s.close()
    if not rows:
        print("compare.py: no benchmark lines found", file=sys.stderr)
        return 1
    (print_markdown if markdown else print_text)(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
