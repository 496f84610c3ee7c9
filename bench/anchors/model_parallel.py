"""Anchor for mp_bench's mp_mlp_step line: one model-parallel training step in
PyTorch (RemoteModule, distributed autograd, DistributedOptimizer).

The model: Linear(256,1024) and ReLU on the trainer (worker0), Linear(1024,1024)
as a RemoteModule on worker1, ReLU on the trainer, Linear(1024,10) as a second
RemoteModule on worker1. Cross-entropy loss, SGD lr=0.01, one batch of 64
random inputs and labels, seed 0. A step is the forward inside a
dist_autograd context, dist_autograd.backward and DistributedOptimizer.step.
The same MLP stepped in one process with torch.optim.SGD gives local_ms.
Both are the mean over 50 steps (--steps) after 10 untimed ones (--warmup).

Usage: python3 model_parallel.py [--steps 50] [--warmup 10]
Prints: {"bench":"mp_mlp_step","impl":"pytorch","ms":..,"local_ms":..,"loss":..}
"""
import argparse
import time

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.nn import RemoteModule
from torch.distributed.optim import DistributedOptimizer

from anchorlib import launch, ms, report, start_rpc


def mean_step_seconds(step, steps, warmup):
    """Mean seconds of step() over `steps` calls after `warmup`; also the last result."""
    for _ in range(warmup):
        step()
    start = time.perf_counter()
    for _ in range(steps):
        out = step()
    return (time.perf_counter() - start) / steps, out


def batch():
    return torch.randn(64, 256), torch.randint(0, 10, (64,))


def local_seconds(steps, warmup):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                          nn.Linear(1024, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = batch()

    def step():
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()

    return mean_step_seconds(step, steps, warmup)[0]


def worker(rank, world, steps, warmup):
    start_rpc(rank, world)
    if rank == 0:
        torch.manual_seed(0)
        first = nn.Linear(256, 1024)
        hidden = RemoteModule("worker1/cpu", nn.Linear, args=(1024, 1024))
        head = RemoteModule("worker1/cpu", nn.Linear, args=(1024, 10))
        params = ([rpc.RRef(p) for p in first.parameters()] + hidden.remote_parameters()
                  + head.remote_parameters())
        opt = DistributedOptimizer(torch.optim.SGD, params, lr=0.01)
        x, y = batch()

        def step():
            with dist_autograd.context() as ctx:
                logits = head(torch.relu(hidden(torch.relu(first(x)))))
                loss = F.cross_entropy(logits, y)
                dist_autograd.backward(ctx, [loss])
                opt.step(ctx)
            return loss.item()

        seconds, loss = mean_step_seconds(step, steps, warmup)
        report("mp_mlp_step", ms=ms(seconds), local_ms=ms(local_seconds(steps, warmup)),
               loss=round(loss, 4))
    rpc.shutdown()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=50, help="timed steps")
    ap.add_argument("--warmup", type=int, default=10, help="untimed steps before them")
    a = ap.parse_args()
    launch(worker, 2, a.steps, a.warmup)
