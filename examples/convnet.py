"""A small convnet, not a transformer, on images it generates, synced every step.

isthmus local --script examples/convnet.py --steps 4
"""

import torch
from torch import nn

from isthmus.deploy import api

ctx = api.init()
torch.manual_seed(ctx.config.job.seed)  # every rank of every site starts alike
model = nn.Sequential(
    nn.Conv2d(1, 8, 3, padding=1),
    nn.ReLU(),
    nn.MaxPool2d(2),
    nn.Conv2d(8, 16, 3, padding=1),
    nn.ReLU(),
    nn.AdaptiveAvgPool2d(1),
    nn.Flatten(),
    nn.Linear(16, 2),
).to(ctx.device)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
ctx.attach(model, optimizer)

shard, shards = ctx.data_shard()  # this rank's slice of every step's global batch
for step in ctx.steps():
    # Class 1 images hold a bright square, class 0 only noise; each rank its own.
    images = torch.Generator().manual_seed(step * shards + shard)
    x = torch.rand(16, 1, 16, 16, generator=images)
    y = torch.randint(0, 2, (16,), generator=images)
    x[y == 1, :, 4:10, 4:10] += 1.0
    loss = nn.functional.cross_entropy(model(x.to(ctx.device)), y.to(ctx.device))
    loss.backward()
    ctx.step(loss=loss, tokens=len(x))
ctx.finish()
