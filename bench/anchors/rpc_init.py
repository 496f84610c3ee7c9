"""Anchor for rpc_init lines: what PyTorch RPC costs to start and stop as the
world grows.

For each world size W, W fresh processes each call init_rpc (TensorPipe, 4
threads; it returns once all have joined), then send every other worker a
1-element tensor with rpc_async and wait for all the answers (all-to-all),
then call rpc.shutdown (which waits for every worker). Rank 0 reports its
three times.

Tandem has no bench of this name yet; bench/compare.py shows these lines
alone, and ./dev bench does not run this program.

Usage: python3 rpc_init.py [--worlds 2,8,16]
Prints, per world size:
  {"bench":"rpc_init","impl":"pytorch","world":W,"init_ms":..,"all_to_all_ms":..,"shutdown_ms":..}
"""
import argparse
import time

import torch
import torch.distributed.rpc as rpc

from anchorlib import launch, report, start_rpc


def pong(t):
    return t


def worker(rank, world):
    marks = [time.perf_counter()]
    start_rpc(rank, world)
    marks.append(time.perf_counter())
    pending = [rpc.rpc_async(f"worker{peer}", pong, args=(torch.zeros(1),))
               for peer in range(world) if peer != rank]
    torch.futures.wait_all(pending)
    marks.append(time.perf_counter())
    rpc.shutdown()
    marks.append(time.perf_counter())
    if rank == 0:
        init, all_to_all, shutdown = (round((b - a) * 1e3, 1) for a, b in zip(marks, marks[1:]))
        report("rpc_init", world=world, init_ms=init, all_to_all_ms=all_to_all,
               shutdown_ms=shutdown)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worlds", default="2,8,16", help="world sizes, comma-separated")
    a = ap.parse_args()
    for world in (int(w) for w in a.worlds.split(",")):
        launch(worker, world)
