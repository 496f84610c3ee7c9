"""PyTorch's side of `restart_bench`: what a failure costs a 4-worker job
under torchrun --max_restarts.

PyTorch 1.13 has no RPC pipeline to run the demo's transformer with, so the
job here is DDP over Gloo on 4 processes: a 4-layer MLP (512 wide), Adam,
batch 64 a rank, 60 steps, a checkpoint every 10 (rank 0 writes
torch.save of the model and the optimizer to a temporary file, renamed into
place: PyTorch 1.13 saves in the step only). Three runs, as in
restart_bench: uninterrupted (its final loss; "sync_stall_ms", the median
time a save held its step, and "copy_ms", the state_dict copies in it);
under torchrun --max_restarts 3 with worker 3 killed by SIGKILL right after
step 35 is printed ("restart_s" from the kill to the first step printed after
the restart, "steps_lost" the steps done again). Torchrun's own settings are
its defaults (its monitor looks at the workers every 5 s).

Prints: {"bench":"restart","impl":"pytorch","workers":4,"restart_s":..,
"steps_lost":..,"checkpoint_every":10,"final_loss":..,"uninterrupted_loss":..,
"sync_stall_ms":..,"copy_ms":..}
Usage: python3 restart.py [--steps 60] [--every 10] [--kill-after 35]
"""
import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time


def worker(args):
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    layers = []
    for _ in range(4):
        layers += [torch.nn.Linear(512, 512), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(512, 10))
    net = DDP(model)
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    path = os.path.join(args.dir, "ckpt.pt")
    start = 0
    if os.path.exists(path):
        ck = torch.load(path)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["optim"])
        start = ck["step"]
        if rank == 0:
            print(f"restart: from step {start}", flush=True)
    stalls, copies = [], []
    loss = torch.zeros(())
    for step in range(start, args.steps):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(64, 512, generator=g)
        y = torch.randint(0, 10, (64,), generator=g)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        mean /= world
        if rank == 0:
            print(f"step {step + 1}/{args.steps} loss {mean.item():.6f}", flush=True)
        if (step + 1) % args.every == 0 or step + 1 == args.steps:
            if rank == 0:
                t0 = time.perf_counter()
                state = {"model": {k: v.clone() for k, v in model.state_dict().items()},
                         "optim": opt.state_dict(), "step": step + 1}
                copies.append((time.perf_counter() - t0) * 1e3)
                tmp = path + ".tmp"
                with open(tmp, "wb") as f:
                    torch.save(state, f)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, path)
                stalls.append((time.perf_counter() - t0) * 1e3)
            dist.barrier()
    if rank == 0:
        print(f"final step {args.steps} loss {mean.item():.6f}", flush=True)
        if stalls:
            print(f"save held its step {statistics.median(stalls):.2f} ms "
                  f"copy {statistics.median(copies):.2f} ms", flush=True)
    dist.destroy_process_group()


def find_worker(tag, rank):
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        if (f"RESTART_ANCHOR_TAG={tag}".encode() in env and f"RANK={rank}".encode() in env
                and b"TORCHELASTIC_RESTART_COUNT=0" in env and b"RESTART_ANCHOR_WORKER=1" in env):
            return int(d)
    return None


def run_job(args, directory, kill_after):
    tag = f"{os.getpid()}-{kill_after}"
    env = dict(os.environ, RESTART_ANCHOR_TAG=tag, RESTART_ANCHOR_WORKER="1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = ["torchrun", "--nproc_per_node", "4", "--max_restarts", "3" if kill_after else "0",
           "--redirects", "2", "--tee", "2", "--master_port", str(port), sys.argv[0], "--worker",
           "--dir", directory, "--steps", str(args.steps), "--every", str(args.every)]
    out = {"final": None, "stall": None, "copy": None, "restart_s": None, "from": None,
           "last_before": 0}
    killed = None
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                         text=True)
    for line in p.stdout:
        now = time.monotonic()
        if "step " in line and " loss " in line and "final" not in line:
            try:
                step = int(line.split("step ")[1].split("/")[0])
            except ValueError:
                step = None
            if step is not None and killed is None:
                out["last_before"] = step
            if step == kill_after and killed is None:
                pid = find_worker(tag, 3)
                if pid:
                    os.kill(pid, signal.SIGKILL)
                    killed = now
            elif killed is not None and out["from"] is not None and out["restart_s"] is None:
                out["restart_s"] = now - killed
        if "restart: from step " in line:
            out["from"] = int(line.split("restart: from step ")[1].split()[0])
        if "final step " in line:
            out["final"] = float(line.split(" loss ")[1].split()[0])
        if "save held its step " in line:
            out["stall"] = float(line.split("save held its step ")[1].split()[0])
            out["copy"] = float(line.split(" copy ")[1].split()[0])
    out["status"] = p.wait()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--kill-after", type=int, default=35)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--dir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    tmp = tempfile.mkdtemp(prefix="restart-anchor-")
    try:
        os.makedirs(os.path.join(tmp, "a"))
        os.makedirs(os.path.join(tmp, "k"))
        plain = run_job(args, os.path.join(tmp, "a"), 0)
        killed = run_job(args, os.path.join(tmp, "k"), args.kill_after)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if (plain["status"] != 0 or killed["status"] != 0 or plain["final"] is None
            or killed["final"] is None or killed["restart_s"] is None):
        print(f"restart.py: a run failed or said too little: {plain} {killed}", file=sys.stderr)
        sys.exit(1)
    print(json.dumps({
        "bench": "restart", "impl": "pytorch", "workers": 4,
        "restart_s": round(killed["restart_s"], 3),
        "steps_lost": killed["last_before"] - killed["from"],
        "checkpoint_every": args.every, "final_loss": killed["final"],
        "uninterrupted_loss": plain["final"], "sync_stall_ms": plain["stall"],
        "copy_ms": plain["copy"]}), flush=True)


if __name__ == "__main__":
    main()
