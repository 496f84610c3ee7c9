"""Anchor for ddp_bench's ddp_step line: one DistributedDataParallel training
step in PyTorch, over Gloo, two processes on this host.

The model: MLP 512-2048-2048-512-10 with ReLUs, made with seed 0 on every rank
(so all start from the same weights); a batch of 64 per rank, rank r's drawn
from a generator seeded 100 + r; cross-entropy loss, SGD lr=0.01; one intra-op
thread per process (torch's pool and OpenBLAS's: anchorlib.one_thread). After
the DDP run, rank 0 steps the same model without DDP in its own process
(local_ms). Both are the mean over 30 steps (--steps) after 5 untimed ones
(--warmup).

Usage: python3 ddp.py [--world 2] [--steps 30] [--warmup 5]
Prints: {"bench":"ddp_step","impl":"pytorch","world":W,"ms":..,"local_ms":..,"loss":..}
"""
import argparse
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from anchorlib import launch, ms, one_thread, report


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(512, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(),
                         nn.Linear(2048, 512), nn.ReLU(), nn.Linear(512, 10))


def data_of(rank):
    gen = torch.Generator().manual_seed(100 + rank)
    return torch.randn(64, 512, generator=gen), torch.randint(0, 10, (64,), generator=gen)


def train(model, x, y, steps, warmup):
    """Mean seconds per SGD step over `steps` after `warmup`, and the last loss."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for i in range(warmup + steps):
        if i == warmup:
            start = time.perf_counter()
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
    return (time.perf_counter() - start) / steps, loss.item()


def worker(rank, world, steps, warmup):
    one_thread()
    dist.init_process_group("gloo", rank=rank, world_size=world)
    x, y = data_of(rank)
    seconds, loss = train(DistributedDataParallel(mlp()), x, y, steps, warmup)
    dist.destroy_process_group()
    if rank == 0:
        local, _ = train(mlp(), x, y, steps, warmup)
        report("ddp_step", world=world, ms=ms(seconds), local_ms=ms(local), loss=round(loss, 4))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=2, help="processes")
    ap.add_argument("--steps", type=int, default=30, help="timed steps")
    ap.add_argument("--warmup", type=int, default=5, help="untimed steps before them")
    a = ap.parse_args()
    launch(worker, a.world, a.steps, a.warmup)
