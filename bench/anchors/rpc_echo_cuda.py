"""PyTorch's side of `rpc_bench --device cuda`, for GPU machines (PyTorch 2.x).

Two processes share cuda:0. The caller sends a CUDA tensor to worker1 with the
device map {0: 0} (worker1 answers by its inverse, as TensorPipe requires both
to list their devices) and gets it back on its GPU. Two callees are timed, as
in the CPU anchor: a Python function ("python") and torch.detach
("builtin"). Compare against the faster.

Usage: python3 rpc_echo_cuda.py [--sizes 1048576,67108864,1073741824] [--threads 4]
Prints: {"bench":"rpc_echo_cuda","impl":"pytorch","path":P,"bytes":N,"p50_us":..,"p99_us":..,"gbps":..}
gbps counts the bytes that crossed in both directions.
"""
import argparse
import json
import os
import socket
import time

import torch
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def percentile(samples, q):
    s = sorted(samples)
    return s[min(len(s) - 1, int(q * len(s)))]


def echo(x):
    return x


def iterations(nbytes):
    return 200 if nbytes <= (1 << 20) else (20 if nbytes <= (64 << 20) else 5)


def run(rank, port, sizes, threads):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    opts = rpc.TensorPipeRpcBackendOptions(num_worker_threads=threads, devices=[0])
    if rank == 0:
        opts.set_device_map("worker1", {0: 0})
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2, rpc_backend_options=opts)
    if rank == 0:
        for path, fn in (("python", echo), ("builtin", torch.detach)):
            for nbytes in sizes:
                t = torch.zeros(max(nbytes // 4, 1), device="cuda:0")
                back = rpc.rpc_sync("worker1", fn, args=(t,))
                assert back.is_cuda, "the echo came back off the GPU"
                for _ in range(3):
                    rpc.rpc_sync("worker1", fn, args=(t,))
                lat = []
                for _ in range(iterations(nbytes)):
                    s = time.perf_counter()
                    rpc.rpc_sync("worker1", fn, args=(t,))
                    torch.cuda.current_stream().synchronize()  # the answer is usable
                    lat.append(time.perf_counter() - s)
                mean = sum(lat) / len(lat)
                print(json.dumps(dict(
                    bench="rpc_echo_cuda", impl="pytorch", path=path, bytes=nbytes,
                    p50_us=round(percentile(lat, 0.5) * 1e6, 1),
                    p99_us=round(percentile(lat, 0.99) * 1e6, 1),
                    gbps=round(2 * nbytes / mean / 1e9, 3))), flush=True)
    rpc.shutdown()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1048576,67108864,1073741824")
    ap.add_argument("--threads", type=int, default=4)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("rpc_echo_cuda.py: no CUDA device here")
    mp.spawn(run, args=(free_port(), [int(s) for s in a.sizes.split(",")], a.threads), nprocs=2)
