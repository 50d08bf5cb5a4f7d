"""Tensor parallelism inside a site: DTensor plans for attention, MLP and the ends.

Megatron's layout: q/k/v and the MLP's gate/up are split by output columns (each
``tp`` rank owns ``n_heads / tp`` whole heads, the ``n_kv_heads / tp`` key/value heads
its query heads read, and ``ffn_hidden / tp`` hidden units), the attention output and
MLP down projections by input rows, so each block costs one all-reduce forward and one
backward per sub-layer. With sequence parallelism those become a reduce-scatter and an
all-gather, and the norms and the residual stream hold ``seq / tp`` positions per rank.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from .model import FeedForward

if TYPE_CHECKING:
    from .model import Transformer


def apply_tp(model: Transformer, tp_mesh: DeviceMesh, *, sequence_parallel: bool = False) -> None:
    """Parallelize a ``Transformer`` (or one pipeline stage of it) over ``tp_mesh``, in place.

    Activations that cross module boundaries stay plain local tensors
    (``use_local_output``), so pipeline stages send ordinary tensors: replicated
    ``[batch, seq, dim]`` without sequence parallelism, the rank's
    ``[batch, seq / tp, dim]`` slice with it. The logits come back replicated, so
    every tp rank computes the same loss. A stage may lack ``tok_embeddings``, ``norm``
    and ``output``.
    """
    stream = Shard(1) if sequence_parallel else Replicate()
    root_plan: dict[str, ParallelStyle] = {}
    if model.tok_embeddings is not None:
        # Vocabulary rows are split; the partial lookups are summed (or
        # reduce-scattered along the sequence) into the residual stream.
        root_plan["tok_embeddings"] = RowwiseParallel(
            input_layouts=Replicate(), output_layouts=stream
        )
    if model.output is not None:
        if sequence_parallel:
            root_plan["norm"] = SequenceParallel()
        root_plan["output"] = ColwiseParallel(input_layouts=stream, output_layouts=Replicate())
    if root_plan:
        parallelize_module(model, tp_mesh, root_plan)
        # A tied head: the embedding and the head each got their own DTensor copy of
        # the one weight, both sharded by vocabulary rows (Shard(0)); keep one.
        model.tie_weights()
    for block in model.layers.values():
        plan: dict[str, ParallelStyle] = {
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=stream),
        }
        # Experts are not split: a mixture-of-experts layer runs whole on every tp
        # rank, on the same replicated tokens (sequence parallelism is refused with it).
        if isinstance(block.feed_forward, FeedForward):
            plan |= {
                "feed_forward.w1": ColwiseParallel(),
                "feed_forward.w3": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(output_layouts=stream),
            }
        if sequence_parallel:
            plan |= {
                "attention_norm": SequenceParallel(),
                # The rotary table (second input) is a plain buffer: leave it alone.
                "attention": PrepareModuleInput(
                    input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)
                ),
                "ffn_norm": SequenceParallel(),
                "feed_forward": PrepareModuleInput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
                ),
            }
        parallelize_module(block, tp_mesh, plan)
