"""Anchor for rpc_bench's remote reference lines: PyTorch's rpc.remote and RRef.to_here.

remote_create: worker0 calls rpc.remote("worker1", ...) to make a 1-element
tensor there and waits until worker1 has made it and confirmed the RRef;
1000 times, after 10 untimed.
rref_to_here: worker0 fetches the value of an RRef to a worker1 tensor of
max(bytes/4, 1) floats; 1000 times up to 64 KiB and 40 above, after one
untimed fetch.

Usage: python3 rref.py [--sizes 0,1048576] [--iters N]
Prints:
  {"bench":"remote_create","impl":"pytorch","p50_us":..}
  {"bench":"rref_to_here","impl":"pytorch","bytes":N,"p50_us":..}   per size
"""
import argparse

import torch
import torch.distributed.rpc as rpc

from anchorlib import launch, quantile, report, sample, start_rpc, us


def floats_of(nbytes):
    return torch.zeros(max(nbytes // 4, 1))


def create_and_confirm():
    ref = rpc.remote("worker1", floats_of, args=(0,))
    ref._get_future().wait()  # the owner ran it and confirmed


def worker(rank, world, sizes, iters):
    start_rpc(rank, world)
    if rank == 0:
        lat = sample(create_and_confirm, iters or 1000, warmup=10)
        report("remote_create", p50_us=us(quantile(lat, 0.5)))
        for nbytes in sizes:
            ref = rpc.remote("worker1", floats_of, args=(nbytes,))
            lat = sample(ref.to_here, iters or (1000 if nbytes <= 64 << 10 else 40), warmup=1)
            report("rref_to_here", bytes=nbytes, p50_us=us(quantile(lat, 0.5)))
            del ref
    rpc.shutdown()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="0,1048576", help="to_here sizes in bytes, comma-separated")
    ap.add_argument("--iters", type=int, default=0, help="timed calls per figure (0: as above)")
    a = ap.parse_args()
    launch(worker, 2, [int(s) for s in a.sizes.split(",")], a.iters)
