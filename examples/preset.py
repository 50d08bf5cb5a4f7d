"""The built-in model (the job's preset, `--model`) trained through the same API, in
whatever `sync.mode` the job names.

    isthmus local --script examples/preset.py --steps 4 --set sync.mode=diloco
"""

import torch
import torch.nn.functional as F

from isthmus.deploy import api
from isthmus.intra.model import build_model
from isthmus.intra.parallel import parallelize

ctx = api.init()
cfg = ctx.config
model = build_model(cfg.resolved_model(), seed=cfg.job.seed).to(ctx.device)
parallelize(model, ctx.mesh, cfg.parallel_config(cuda=ctx.device.type == "cuda"))  # FSDP2
# As the built-in trainer builds it (foreach: one kernel per step for all parameters,
# which torch picks by itself only on GPUs).
optimizer = torch.optim.AdamW(
    model.parameters(), lr=cfg.train.lr, weight_decay=cfg.train.weight_decay, foreach=True
)
ctx.attach(model, optimizer)

batches = ctx.token_batches()
for step in ctx.steps():
    inputs, targets = batches.batch(step)
    logits = model(inputs.to(ctx.device))
    loss = F.cross_entropy(logits.flatten(0, 1), targets.to(ctx.device).flatten())
    loss.backward()
    outcome = ctx.step(loss=loss, tokens=inputs.numel())
    if outcome.rejoined:  # the job went on without this site: it now holds the job's state
        print(f"rejoined at step {outcome.next_step}")
ctx.finish()
