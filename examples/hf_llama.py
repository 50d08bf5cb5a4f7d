"""A Hugging Face `LlamaForCausalLM` from a local config.json (no download), sharded
with FSDP2 inside each site and synced across sites in the job's sync mode.

    isthmus local --script examples/hf_llama.py --steps 4 -- examples/tiny_llama/config.json
"""

import sys

import torch
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from transformers import LlamaConfig, LlamaForCausalLM

from isthmus.deploy import api

ctx = api.init()
torch.manual_seed(ctx.config.job.seed)  # every rank of every site starts alike
config = LlamaConfig.from_json_file(sys.argv[1])  # vocab_size 256: the job's byte tokens
model = LlamaForCausalLM(config).to(ctx.device)
for layer in model.model.layers:  # one FSDP group per decoder layer, then the rest
    fully_shard(layer, mesh=ctx.mesh["dp"])
fully_shard(model, mesh=ctx.mesh["dp"])
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
ctx.attach(model, optimizer)

batches = ctx.token_batches()  # the job's corpus, this rank's shard of each step
for step in ctx.steps():
    inputs, targets = batches.batch(step)
    logits = model(input_ids=inputs.to(ctx.device)).logits
    loss = F.cross_entropy(logits.flatten(0, 1), targets.to(ctx.device).flatten())
    loss.backward()
    ctx.step(loss=loss, tokens=inputs.numel(), grad_clip=1.0)
ctx.finish()
