"""A torch model for the data-parallel workers (ddp_torch.py, torch_backend.py): what DDP must
handle beyond plain parameters, in a few layers."""

from __future__ import annotations

import torch


class BranchNet(torch.nn.Module):
    """Linear, BatchNorm (buffers, which DDP broadcasts) and ReLU, then a head, plus a second
    head `extra` that forward adds only when asked (parameters unused on some steps)."""

    def __init__(self, n_in=20, n_out=5, hidden=32):
        super().__init__()
        self.a = torch.nn.Linear(n_in, hidden)
        self.bn = torch.nn.BatchNorm1d(hidden)
        self.b = torch.nn.Linear(hidden, n_out)
        self.extra = torch.nn.Linear(hidden, n_out)

    def forward(self, x, use_extra=False):
        h = torch.relu(self.bn(self.a(x)))
        return self.b(h) + (self.extra(h) if use_extra else 0)
