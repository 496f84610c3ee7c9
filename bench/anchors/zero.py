"""Anchor for zero_bench's zero lines: DDP with Adam, and DDP with PyTorch's
ZeroRedundancyOptimizer (ZeRO stage 1; PyTorch 1.13 has no stage 2 outside
FSDP), in bytes a rank and time a step.

The model: twelve Linear(2048, 2048) with ReLUs between (50.4 M parameters),
made with seed 0 on every rank; Adam lr=1e-4, fp32; a batch of 16 rows a rank,
rank r's drawn from a generator seeded 100 + r; MSE loss against random
targets; one intra-op thread a process, Gloo. bytes_per_rank counts rank 0's
parameters, gradients and optimizer state (exp_avg, exp_avg_sq) after a step;
rss_mb is its peak resident memory; ms the median step (forward, backward,
step) over --steps after --warmup.

Usage: python3 zero.py [--worlds 2,4] [--modes ddp,zero1] [--steps 3] [--warmup 1]
Prints per mode and world size:
  {"bench":"zero","impl":"pytorch","mode":M,"world":N,"params":P,"bytes_per_rank":..,
   "largest_unit_bytes":0,"rss_mb":..,"ms":..,"ms_per_ddp":..}
"""
import argparse
import resource
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

from anchorlib import launch_for_figures, one_thread, report


def model():
    torch.manual_seed(0)
    layers = []
    for i in range(12):
        layers.append(nn.Linear(2048, 2048))
        if i < 11:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def nbytes(t):
    return 0 if t is None else t.numel() * t.element_size()


def worker(rank, world, mode, steps, warmup, out):
    one_thread()
    dist.init_process_group("gloo", rank=rank, world_size=world)
    m = model()
    net = DistributedDataParallel(m)
    if mode == "ddp":
        opt = torch.optim.Adam(m.parameters(), lr=1e-4)
    else:
        opt = ZeroRedundancyOptimizer(m.parameters(), optimizer_class=torch.optim.Adam, lr=1e-4)
    gen = torch.Generator().manual_seed(100 + rank)
    x, y = torch.randn(16, 2048, generator=gen), torch.randn(16, 2048, generator=gen)
    times, held = [], 0
    for i in range(warmup + steps):
        start = time.perf_counter()
        F.mse_loss(net(x), y).backward()
        opt.step()
        if i >= warmup:
            times.append(time.perf_counter() - start)
        if i == warmup + steps - 1:
            held = sum(nbytes(p) + nbytes(p.grad) for p in m.parameters())
            state = opt.optim.state if mode == "zero1" else opt.state
            for s in state.values():
                held += nbytes(s.get("exp_avg")) + nbytes(s.get("exp_avg_sq"))
        opt.zero_grad(set_to_none=True)
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
        params = sum(p.numel() for p in m.parameters())
        with open(out, "w") as f:
            f.write(f"{params} {held} {rss} {statistics.median(times) * 1e3}\n")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worlds", default="2,4", help="process counts")
    ap.add_argument("--modes", default="ddp,zero1", help="ddp, zero1")
    ap.add_argument("--steps", type=int, default=3, help="timed steps")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps before them")
    a = ap.parse_args()
    for world in (int(w) for w in a.worlds.split(",")):
        ddp_ms = 0
        for mode in a.modes.split(","):
            params, held, rss, step_ms = launch_for_figures(worker, world, mode, a.steps,
                                                            a.warmup)
            if mode == "ddp":
                ddp_ms = float(step_ms)
            extra = {"ms_per_ddp": round(float(step_ms) / ddp_ms, 3)} if ddp_ms else {}
            report("zero", mode=mode, world=world, params=int(params), bytes_per_rank=int(held),
                   largest_unit_bytes=0, rss_mb=round(float(rss), 1),
                   ms=round(float(step_ms), 1), **extra)
