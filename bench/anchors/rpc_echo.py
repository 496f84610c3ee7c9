"""Anchor for rpc_bench's rpc_echo lines: PyTorch RPC (TensorPipe) round trips.

worker0 sends a float tensor of max(bytes/4, 1) elements to worker1 with
rpc_sync and gets it back. worker1 answers with one of two callees, each timed
at every size:
  path "python"   a Python function returning its argument (the call is
                  pickled and runs under worker1's GIL)
  path "builtin"  the builtin operator torch.detach (no Python on worker1:
                  PyTorch's fastest path)
bench/compare.py sets the better of the two beside Tandem's figure.

Each size is timed over 2000 round trips up to 64 KiB, 200 up to 1 MiB and 40
above (--iters overrides), after 10 untimed ones.

Usage: python3 rpc_echo.py [--sizes 0,1024,1048576,16777216] [--threads 4] [--iters N]
Prints, per path and size:
  {"bench":"rpc_echo","impl":"pytorch","path":P,"bytes":N,"p50_us":..,"p99_us":..,"gbps":..}
gbps: the bytes that crossed, both ways, over the mean round trip.
"""
import argparse

import torch
import torch.distributed.rpc as rpc

from anchorlib import launch, quantile, report, sample, start_rpc, us


def give_back(t):
    return t


CALLEES = (("python", give_back), ("builtin", torch.detach))


def round_trips(nbytes):
    if nbytes <= 64 << 10:
        return 2000
    return 200 if nbytes <= 1 << 20 else 40


def worker(rank, world, sizes, threads, iters):
    start_rpc(rank, world, threads)
    if rank == 0:
        for path, callee in CALLEES:
            for nbytes in sizes:
                payload = torch.zeros(max(nbytes // 4, 1))
                lat = sample(lambda: rpc.rpc_sync("worker1", callee, args=(payload,)),
                             iters or round_trips(nbytes), warmup=10)
                mean = sum(lat) / len(lat)
                report("rpc_echo", path=path, bytes=nbytes,
                       p50_us=us(quantile(lat, 0.5)), p99_us=us(quantile(lat, 0.99)),
                       gbps=round(2 * nbytes / mean / 1e9, 3))
    rpc.shutdown()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="0,1024,1048576,16777216", help="bytes, comma-separated")
    ap.add_argument("--threads", type=int, default=4, help="TensorPipe worker threads")
    ap.add_argument("--iters", type=int, default=0, help="round trips per size (0: by size)")
    a = ap.parse_args()
    launch(worker, 2, [int(s) for s in a.sizes.split(",")], a.threads, a.iters)
