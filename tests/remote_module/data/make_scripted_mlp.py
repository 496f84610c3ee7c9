"""Makes scripted_mlp.pt, the TorchScript module of remote_module_test.cc.

Run with Debian's python3-torch (1.13) from this folder:
    /usr/bin/python3 make_scripted_mlp.py
The test builds the same model in C++ ("ScriptTwin": fc1, tanh, fc2), loads
this file's weights into it, and checks both train alike across workers.
"""
import torch
import torch.nn as nn


class ScriptedMlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


if __name__ == "__main__":
    torch.manual_seed(0)
    torch.jit.script(ScriptedMlp()).save("scripted_mlp.pt")
