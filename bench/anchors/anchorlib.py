"""What the PyTorch anchors have in common.

An anchor is a PyTorch program that measures what one of Tandem's benches
measures (same model, sizes and iteration counts) and prints one JSON line per
figure with the keys that bench prints, so bench/compare.py can put the two
side by side. The anchors run on Debian's python3-torch (1.13), in worker
processes they start themselves on loopback.
"""
import json
import os
import socket
import tempfile
import time

import torch.multiprocessing as mp

RPC_THREADS = 4  # TensorPipe worker threads, as Tandem's benches use


def _free_port():
    """A TCP port nobody listens on right now (the kernel's pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _enter(rank, body, world, args):
    body(rank, world, *args)


def launch(body, world, *args):
    """Runs body(rank, world, *args) in `world` fresh processes, ranks 0..world-1.

    They rendezvous at MASTER_ADDR:MASTER_PORT (loopback, a free port), which
    init_rpc and init_process_group read from the environment the processes
    inherit. An exception in any of them ends the program with an error.
    """
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(_free_port())
    mp.spawn(_enter, args=(body, world, args), nprocs=world, join=True)


def launch_for_figures(body, world, *args):
    """launch(body, world, *args, out): body's rank 0 writes its figures, space-separated,
    to the file `out` (a temporary one); returns them as strings."""
    fd, out = tempfile.mkstemp(prefix="anchor.")
    os.close(fd)
    try:
        launch(body, world, *args, out)
        with open(out) as f:
            return f.read().split()
    finally:
        os.remove(out)


def one_thread():
    """One intra-op thread in this process, as Tandem's benches run
    (rpc::set_num_threads(1)): torch's pool, and OpenBLAS's own, which
    torch.set_num_threads leaves at a thread a core (the GEMMs of a
    "one-thread" process then ran on every core)."""
    import ctypes

    import torch
    torch.set_num_threads(1)
    try:
        # (the library torch already loaded: dlopen hands back the same one)
        ctypes.CDLL("libopenblas.so.0").openblas_set_num_threads(1)
    except (OSError, AttributeError):
        pass  # LibTorch's BLAS is not OpenBLAS here


def start_rpc(rank, world, threads=RPC_THREADS):
    """init_rpc as worker<rank> with the TensorPipe backend."""
    import torch.distributed.rpc as rpc
    opts = rpc.TensorPipeRpcBackendOptions(num_worker_threads=threads)
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world, rpc_backend_options=opts)


def sample(call, iters, warmup=0):
    """Seconds each of `iters` calls of call() took, after `warmup` untimed ones."""
    for _ in range(warmup):
        call()
    out = []
    for _ in range(iters):
        start = time.perf_counter()
        call()
        out.append(time.perf_counter() - start)
    return out


def quantile(seconds, q):
    """The q-quantile of the samples (the element at index floor(q * n)), in seconds.
    Tandem's benches take their p50 and p99 the same way."""
    ordered = sorted(seconds)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def us(seconds):
    return round(seconds * 1e6, 1)


def ms(seconds):
    return round(seconds * 1e3, 3)


def report(bench, **figures):
    """Prints one result line: {"bench": bench, "impl": "pytorch", **figures}."""
    print(json.dumps(dict(bench=bench, impl="pytorch", **figures), separators=(",", ":")),
          flush=True)
