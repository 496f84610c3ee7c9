#!/usr/bin/env python3
"""Side-by-side table of Tandem's benchmark results and PyTorch's.

Reads JSON lines (as printed by build/bin/*_bench and the PyTorch programs in
bench/anchors/) from the files given, or stdin ("-"); lines that are not JSON
objects with a "bench" and an "impl" are ignored, and so are values that are
not finite numbers.
Lines are grouped by `bench` and their size key (`bytes`, `hops`, `world` or
`idle_us`, possibly absent; a pipeline line by its schedule, stages and chunks, a pp_dp
line by its layout, a zero line by its mode and world, an ft line by its mode). For each
metric of the tandem lines it prints Tandem's value over TCP (column tandem;
also a line that names no transport), over shared memory (tandem_shm: lines
with "transport":"shm"), PyTorch's and the machine's floor (raw: a raw_tcp or
raw_pipe line), and the ratios to PyTorch and to the floor.
Where PyTorch reports several paths (rpc_echo: python, builtin) the better one
is used: lowest time, highest gbps; its path is shown.

--markdown prints that table as Markdown. --summary prints the short Markdown
table of docs/benchmarks.md and the README instead: one row per headline
figure (SUMMARY_ROWS; rows without data are left out), Tandem over TCP and
over shared memory beside PyTorch's best path, and their ratios.

Usage: compare.py [--markdown | --summary] [FILE ...]
Exit status: 0 when a table was printed, 1 when no benchmark line was found,
2 for a file that cannot be read or an unknown option.
"""
import json
import math
import sys

SIZE_KEYS = ("config", "bytes", "hops", "world", "idle_us")
METRICS = ("p50_us", "p99_us", "gbps", "ms", "local_ms", "overhead_ms", "ms_per_local",
           "record_us_per_rpc", "overlap", "samples_per_s", "single_worker_samples_per_s",
           "chunked_single_worker_samples_per_s", "efficiency", "efficiency_vs_chunked", "bubble", "speedup", "allreduce_ms", "allreduce_hidden",
           "init_ms", "all_to_all_ms", "shutdown_ms", "on_ns", "off_ns", "bytes_per_rank",
           "bytes_per_param", "rss_mb", "ms_per_ddp", "restart_s", "steps_lost",
           "checkpoint_every", "final_loss", "uninterrupted_loss", "async_stall_ms",
           "sync_stall_ms", "copy_ms", "param_bytes_per_rank", "activation_bytes_per_rank",
           "sent_bytes_per_rank", "expected_sent_bytes", "sent_per_expected", "ms_per_tp1",
           "step_ms", "survivor_pause_ms", "heal_ms", "heal_bytes", "state_bytes",
           "heal_per_state", "rejoin_s", "reference_loss", "caller_core_pct", "callee_core_pct")
HIGHER_IS_BETTER = {"gbps", "overlap", "samples_per_s", "single_worker_samples_per_s",
                    "chunked_single_worker_samples_per_s", "efficiency", "efficiency_vs_chunked", "speedup", "allreduce_hidden"}
HEADER = ("bench", "size", "metric", "tandem", "tandem_shm", "pytorch", "path", "raw",
          "tandem/pytorch", "shm/pytorch", "tandem/raw")
LEFT = {"bench", "size", "metric", "path"}  # text columns; the rest align right

# --summary: the headline figures, in this order. Each row is
# (bench, size key, size value, size label, metric, metric label, decimals);
# a size key of None matches lines that carry none of SIZE_KEYS.
SUMMARY_ROWS = (
    ("rpc_echo", "bytes", 0, "0 B", "p50_us", "p50 µs", 1),
    ("rpc_echo", "bytes", 1 << 20, "1 MiB", "p50_us", "p50 µs", 1),
    ("rpc_echo", "bytes", 16 << 20, "16 MiB", "gbps", "GB/s", 2),
    ("rref_to_here", "bytes", 1 << 20, "1 MiB", "p50_us", "p50 µs", 1),
    ("remote_create", None, None, "-", "p50_us", "p50 µs", 1),
    ("dist_backward", "hops", 16, "16 hops", "p50_us", "p50 µs", 1),
    ("mp_mlp_step", None, None, "-", "ms", "ms", 2),
    ("mp_mlp_step", None, None, "-", "overhead_ms", "overhead ms", 2),
    ("mp_mlp_step", None, None, "-", "ms_per_local", "ms / local_ms", 2),
    ("ddp_step", "world", 2, "2 ranks", "ms", "ms", 2),
    ("rpc_echo_cuda", "bytes", 1 << 20, "1 MiB", "gbps", "GB/s", 2),
    ("rpc_echo_cuda", "bytes", 64 << 20, "64 MiB", "gbps", "GB/s", 2),
    ("rpc_echo_cuda", "bytes", 1 << 30, "1 GiB", "gbps", "GB/s", 2),
)
SUMMARY_HEADER = ("bench", "size", "metric", "Tandem TCP", "Tandem shm", "PyTorch",
                  "TCP/PyTorch", "shm/PyTorch", "shm/TCP")


def is_num(v):
    """A finite int or float (JSON true/false and NaN are no figures)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


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
            if (isinstance(rec, dict) and isinstance(rec.get("bench"), str)
                    and isinstance(rec.get("impl"), str)):
                if rec["impl"] == "tandem" and rec.get("transport") == "shm":
                    rec = dict(rec, impl="tandem_shm")
                if rec["impl"].startswith("raw_"):  # a floor: raw_tcp, raw_pipe
                    rec = dict(rec, impl="raw")
                yield with_derived(rec)


def with_derived(rec):
    """A step timed beside its local twin (ms, local_ms) also shows the
    distributed overhead, as a difference and as a ratio."""
    if rec.get("bench") == "pipeline" and "schedule" in rec:
        # One row group per schedule and shape.
        rec = dict(rec, config=f"{rec['schedule']} K={rec.get('stages')} M={rec.get('chunks')}")
    if rec.get("bench") == "pp_dp" and "pp" in rec:
        rec = dict(rec, config=f"{rec['pp']} x {rec.get('dp')} M={rec.get('chunks')}")
    if rec.get("bench") == "zero" and "mode" in rec:
        rec = dict(rec, config=f"{rec['mode']} N={rec.get('world')}")
        if is_num(rec.get("bytes_per_rank")) and is_num(rec.get("params")) and rec["params"]:
            rec["bytes_per_param"] = round(rec["bytes_per_rank"] / rec["params"], 2)
    if rec.get("bench") == "ft" and "mode" in rec:
        rec = dict(rec, config=f"{rec['mode']} N={rec.get('replicas')}")
        if is_num(rec.get("heal_bytes")) and is_num(rec.get("state_bytes")) and rec["state_bytes"]:
            rec["heal_per_state"] = round(rec["heal_bytes"] / rec["state_bytes"], 4)
    if rec.get("bench") == "tp" and "tp" in rec:
        sp = " sp" if rec.get("sp") else ""
        again = " recompute" if rec.get("recompute") else ""
        rec = dict(rec, config=f"tp={rec['tp']}{sp}{again}")
        sent, want = rec.get("sent_bytes_per_rank"), rec.get("expected_sent_bytes")
        if is_num(sent) and is_num(want) and want:
            rec["sent_per_expected"] = round(sent / want, 3)
    ms, local = rec.get("ms"), rec.get("local_ms")
    if is_num(ms) and is_num(local) and local > 0:
        rec = dict(rec, overhead_ms=round(ms - local, 3), ms_per_local=round(ms / local, 3))
    return rec


def size_of(rec):
    for key in SIZE_KEYS:
        if key in rec:
            value = rec[key]
            # Group keys must be hashable: anything but a plain scalar by its text.
            if not isinstance(value, (str, int, float)) or isinstance(value, bool):
                value = json.dumps(value)
            return key, value
    return None, None


def fmt_size(key, value):
    if key is None:
        return "-"
    if key == "config":
        return str(value)
    if key == "bytes" and is_num(value) and value == int(value):
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
    if not is_num(a) or not is_num(b) or not b:
        return "-"
    return f"{a / b:.2f}"


def best(recs, metric):
    """The record with the best value of metric, or None."""
    have = [r for r in recs if is_num(r.get(metric))]
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
            vals = sorted(r[m] for r in runs if is_num(r.get(m)))
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
                            for i in ("tandem", "tandem_shm", "pytorch", "raw"))
            tv, sv, pv, rv = (r[m] if r else None for r in (t, s, p, raw))
            # Name the PyTorch path only when it alone gave the best value.
            ties = [r for r in median_per_path(by_impl.get("pytorch", [])) if p and r.get(m) == pv]
            path = p.get("path", "-") if p and len(ties) == 1 else "-"
            rows.append((bench if first else "", fmt_size(key, value) if first else "", m,
                         fmt_num(tv), fmt_num(sv), fmt_num(pv), path,
                         fmt_num(rv), ratio(tv, pv), ratio(sv, pv), ratio(tv, rv)))
            first = False
    return rows


def same_size(rec, key, value):
    """Whether rec is the line of that size (bytes 1048576 and 1048576.0 alike)."""
    k, v = size_of(rec)
    if k != key:
        return False
    if key is None:
        return True
    return v == value if is_num(v) and is_num(value) else str(v) == str(value)


def fmt_fixed(v, decimals):
    return "-" if not is_num(v) else f"{v:.{decimals}f}"


def summary_rows(records):
    """The rows of --summary: SUMMARY_ROWS that have a Tandem figure."""
    records = list(records)
    rows = []
    for bench, key, value, size_label, metric, label, decimals in SUMMARY_ROWS:
        lines = [r for r in records if r["bench"] == bench and same_size(r, key, value)]
        picked = []
        for impl in ("tandem", "tandem_shm", "pytorch"):
            r = best(median_per_path([x for x in lines if x["impl"] == impl]), metric)
            picked.append(r[metric] if r else None)
        tcp, shm, torch = picked
        if tcp is None and shm is None:
            continue
        rows.append((bench, size_label, label,
                     fmt_fixed(tcp, decimals), fmt_fixed(shm, decimals), fmt_fixed(torch, decimals),
                     ratio(tcp, torch), ratio(shm, torch), ratio(shm, tcp)))
    # What one trace event costs (rpc_bench), on and off, in one cell.
    trace = [r for r in records if r["bench"] == "trace_event" and r["impl"] == "tandem"]
    on = best(median_per_path(trace), "on_ns")
    off = best(median_per_path(trace), "off_ns")
    if on or off:
        cell = fmt_fixed(on["on_ns"] if on else None, 0) + " / " + \
            fmt_fixed(off["off_ns"] if off else None, 0)
        rows.append(("trace_event", "-", "ns, tracing on / off", cell) + ("",) * 5)
    return rows


def print_summary(rows):
    print("| " + " | ".join(SUMMARY_HEADER) + " |")
    print("|" + "|".join("---" if i < 3 else "---:" for i in range(len(SUMMARY_HEADER))) + "|")
    for r in rows:
        print("|" + "|".join(f" {c} " if c else " " for c in r) + "|")


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
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__.strip())
        return 0
    options = [a for a in argv if a.startswith("--")]
    files = [a for a in argv if not a.startswith("--")]
    unknown = [a for a in options if a not in ("--markdown", "--summary")]
    if unknown or len(options) > 1:
        why = f"unknown option {unknown[0]}" if unknown else "give --markdown or --summary, not both"
        print(f"compare.py: {why}\nusage: compare.py [--markdown | --summary] [FILE ...]",
              file=sys.stderr)
        return 2
    markdown = "--markdown" in options
    summary = "--summary" in options
    streams = []
    try:
        for f in files:
            streams.append(sys.stdin if f == "-" else open(f, encoding="utf-8", errors="replace"))
        records = read_records(streams or [sys.stdin])
        rows = summary_rows(records) if summary else build_rows(records)
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
    if summary:
        print_summary(rows)
    else:
        (print_markdown if markdown else print_text)(rows)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except BrokenPipeError:  # the reader went away (| head): nothing more to say
        sys.stderr.close()
        sys.exit(0)
