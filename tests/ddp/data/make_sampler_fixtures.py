"""Writes sampler_fixtures.txt: the indices PyTorch's DistributedSampler gives.

Run with Debian's python3-torch (/usr/bin/python3 make_sampler_fixtures.py).
Each line: size replicas rank shuffle seed drop_last epoch : indices...
"""
import torch
from torch.utils.data import DistributedSampler

CASES = [
    # size, replicas, shuffle, seed, drop_last, epochs
    (10, 2, True, 0, False, [0, 1, 7]),
    (11, 3, True, 0, False, [0, 1]),
    (11, 3, True, 42, True, [0, 3]),
    (11, 3, False, 0, False, [0]),
    (11, 3, False, 0, True, [0]),
    (5, 4, True, 1, False, [0, 2]),
    (2, 5, True, 0, False, [0]),      # padding longer than the dataset
    (1000, 4, True, 1234, False, [0, 9]),
    (1003, 8, True, 7, True, [5]),
    (64, 1, True, 0, False, [3]),
]


class Sized:
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n


with open("sampler_fixtures.txt", "w") as f:
    for size, replicas, shuffle, seed, drop_last, epochs in CASES:
        for rank in range(replicas):
            for epoch in epochs:
                s = DistributedSampler(Sized(size), num_replicas=replicas, rank=rank,
                                       shuffle=shuffle, seed=seed, drop_last=drop_last)
                s.set_epoch(epoch)
                idx = list(s)
                assert len(idx) == len(s)
                f.write(f"{size} {replicas} {rank} {int(shuffle)} {seed} {int(drop_last)} {epoch} : "
                        + " ".join(map(str, idx)) + "\n")
