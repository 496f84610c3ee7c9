"""Anchor for tp_bench: PyTorch 2's tensor parallelism (parallelize_module with
ColwiseParallel / RowwiseParallel, and SequenceParallel for the LayerNorms)
on the same transformer block, on the CPU over Gloo.

The block: width 1024, 16 heads, MLP 4x wide, causal attention over 64
positions of 4 sequences, fp32, drawn with seed 0 on every rank; the loss
the sum of the output's squares; one intra-op thread a process. q, k and v
are three linears here (a fused [q; k; v] cut into contiguous rows would
mix them); the arithmetic is tp_bench's. With sequence parallelism the
LayerNorms run on each rank's piece of the sequence (SequenceParallel), the
attention's and the MLP's inputs are gathered (PrepareModuleInput) and
their outputs reduce-scattered (RowwiseParallel(output_layouts=Shard(1))),
torchtitan's plan. Recomputation is torch.utils.checkpoint (non-reentrant).

Measured as tp_bench measures: ms the median step (forward and backward)
over --steps after --warmup; param_bytes_per_rank the local shards' bytes;
activation_bytes_per_rank what the forward left allocated (glibc's
mallinfo2 after forward, less before; the median over the steps).

PyTorch 1.13 (Debian's) has no parallelize_module: there the anchor prints
one line saying so and exits 0. The GPU machine's PyTorch 2 runs it
(tools/gpu_session.sh cpu-bench).

Usage: python3 tp.py [--tps 1,2,4] [--steps 8] [--warmup 1]
Prints per (tp, sp, recompute):
  {"bench":"tp","impl":"pytorch","tp":N,"sp":bool,"recompute":bool,"ms":..,
   "param_bytes_per_rank":..,"activation_bytes_per_rank":..,"ms_per_tp1":..}
"""
import argparse
import ctypes
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn

from anchorlib import launch_for_figures, one_thread, report

WIDTH, HEADS, SEQ, BATCH = 1024, 16, 64, 4


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                 "uordblks", "fordblks", "keepcost")]


def in_use():
    """malloc's bytes in use (tp_bench's in_use())."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    m = libc.mallinfo2()
    return m.uordblks + m.hblkhd


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(WIDTH, WIDTH) for _ in range(3))
        self.proj = nn.Linear(WIDTH, WIDTH)

    def forward(self, h):
        B, T, _ = h.shape
        hd = WIDTH // HEADS
        # (this rank's heads: ColwiseParallel leaves each linear's local columns)
        q, k, v = (f(h).view(B, T, -1, hd).transpose(1, 2) for f in (self.q, self.k, self.v))
        att = (q @ k.transpose(-2, -1)) / hd ** 0.5
        future = torch.ones(T, T, dtype=torch.bool).triu(1)
        att = att.masked_fill(future, float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(B, T, -1)
        return self.proj(y)


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(WIDTH, 4 * WIDTH)
        self.out = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, h):
        return self.out(torch.nn.functional.gelu(self.fc(h)))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(WIDTH), Attention()
        self.ln2, self.mlp = nn.LayerNorm(WIDTH), Mlp()

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def parallelize(block, tp, sp):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                                   RowwiseParallel, SequenceParallel,
                                                   parallelize_module)
    try:
        from torch.distributed.tensor import Replicate, Shard
    except ImportError:  # (before 2.4)
        from torch.distributed._tensor import Replicate, Shard
    mesh = init_device_mesh("cpu", (tp,))
    if not sp:
        plan = {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(),
                "attn.v": ColwiseParallel(), "attn.proj": RowwiseParallel(),
                "mlp.fc": ColwiseParallel(), "mlp.out": RowwiseParallel()}
    else:
        gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
        plan = {"ln1": SequenceParallel(), "attn": gather,
                "attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(),
                "attn.v": ColwiseParallel(), "attn.proj": RowwiseParallel(output_layouts=Shard(1)),
                "ln2": SequenceParallel(), "mlp": gather,
                "mlp.fc": ColwiseParallel(), "mlp.out": RowwiseParallel(output_layouts=Shard(1))}
    return parallelize_module(block, mesh, plan)


def local_bytes(t):
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def worker(rank, world, sp, again, steps, warmup, out):
    one_thread()
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    block = Block()
    if world > 1:
        block = parallelize(block, world, sp)
    params = sum(local_bytes(p) for p in block.parameters())
    x0 = torch.randn(BATCH, SEQ // world if sp else SEQ, WIDTH)
    times, held = [], []
    for i in range(warmup + steps):
        block.zero_grad(set_to_none=True)
        x = x0.clone().requires_grad_()
        dist.barrier()
        start = time.perf_counter()
        before = in_use()
        if again:
            from torch.utils.checkpoint import checkpoint
            y = checkpoint(block, x, use_reentrant=False)
        else:
            y = block(x)
        paused = time.perf_counter()
        dist.barrier()  # (the group quiet, untimed, as tp_bench)
        after = in_use()
        pause = time.perf_counter() - paused
        y = y.to_local() if hasattr(y, "to_local") else y
        (y * y).sum().backward()
        if i >= warmup:
            times.append(time.perf_counter() - start - pause)
            held.append(after - before)
    dist.destroy_process_group()
    if rank == 0:
        with open(out, "w") as f:
            f.write(f"{params} {statistics.median(held)} {statistics.median(times) * 1e3}\n")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tps", default="1,2,4", help="tensor-parallel group sizes")
    ap.add_argument("--steps", type=int, default=8, help="timed steps")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps before them")
    a = ap.parse_args()
    if int(torch.__version__.split(".")[0]) < 2:
        report("tp", skipped=f"PyTorch {torch.__version__} has no parallelize_module "
                             "(PyTorch 2's tensor parallelism): the GPU machine's PyTorch runs this")
        sys.exit(0)
    tp1 = {}
    for tp in (int(t) for t in a.tps.split(",")):
        for sp in (False, True):
            if sp and tp == 1:
                continue
            for again in (False, True):
                params, held, step_ms = launch_for_figures(worker, tp, sp, again, a.steps,
                                                           a.warmup)
                if tp == 1:
                    tp1[again] = float(step_ms)
                extra = {"ms_per_tp1": round(float(step_ms) / tp1[again], 3)} if again in tp1 else {}
                report("tp", tp=tp, sp=sp, recompute=again, ms=round(float(step_ms), 1),
                       param_bytes_per_rank=int(params),
                       activation_bytes_per_rank=int(float(held)), **extra)
