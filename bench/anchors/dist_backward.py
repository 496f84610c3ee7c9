"""Anchor for autograd_bench's dist_backward lines: PyTorch's distributed autograd
over a chain of RPC hops.

worker0 holds x, 64 ones that require grad. The forward sends y = x to worker1
`hops` times in a row, y = rpc_sync("worker1", torch.add, (y, 1)), and the loss
is y.sum(). Per iteration it times
  - dist_autograd.backward alone (the gradient of x is checked: all ones);
  - the forward inside a dist_autograd context and the same forward on a
    detached x outside one: their difference per hop is what recording the
    RPCs for backward costs.
Figures are p50s over 200 iterations (--iters) after 5 untimed ones.

Usage: python3 dist_backward.py [--hops 1,4,16] [--iters 200]
Prints, per hop count:
  {"bench":"dist_backward","impl":"pytorch","hops":H,"p50_us":..,"record_us_per_rpc":..}
"""
import argparse
import time

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc

from anchorlib import launch, quantile, report, start_rpc, us

WARMUP = 5


def chain(y, hops):
    for _ in range(hops):
        y = rpc.rpc_sync("worker1", torch.add, args=(y, 1))
    return y


def seconds(fn):
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def one_iteration(x, hops, plain_first):
    """(forward without a context, forward in a context, backward), in seconds."""
    if plain_first:
        plain, _ = seconds(lambda: chain(x.detach(), hops))
    with dist_autograd.context() as ctx:
        recorded, loss = seconds(lambda: chain(x, hops).sum())
        backward, _ = seconds(lambda: dist_autograd.backward(ctx, [loss]))
        grad = dist_autograd.get_gradients(ctx)[x]
        if not torch.equal(grad, torch.ones_like(x)):
            raise RuntimeError(f"wrong gradient after {hops} hops: {grad}")
    if not plain_first:
        plain, _ = seconds(lambda: chain(x.detach(), hops))
    return plain, recorded, backward


def worker(rank, world, hop_counts, iters):
    start_rpc(rank, world)
    if rank == 0:
        x = torch.ones(64, requires_grad=True)
        for hops in hop_counts:
            runs = [one_iteration(x, hops, i % 2 == 0) for i in range(WARMUP + iters)][WARMUP:]
            plain, recorded, backward = ([r[i] for r in runs] for i in range(3))
            per_rpc = (quantile(recorded, 0.5) - quantile(plain, 0.5)) / hops
            report("dist_backward", hops=hops, p50_us=us(quantile(backward, 0.5)),
                   record_us_per_rpc=us(per_rpc))
    rpc.shutdown()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hops", default="1,4,16", help="chain lengths, comma-separated")
    ap.add_argument("--iters", type=int, default=200, help="timed iterations per chain length")
    a = ap.parse_args()
    launch(worker, 2, [int(h) for h in a.hops.split(",")], a.iters)
