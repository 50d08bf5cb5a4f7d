"""The outer optimizer's sync groups (intra/outer.py): a model's repeated blocks, each a
group, then the parameters outside them, and the Streaming DiLoCo fragment each group
belongs to. Built-in models keep their blocks in ``layers``; a user's model anywhere
(Hugging Face's ``model.layers``, ``transformer.h``, ``gpt_neox.layers``, an
``nn.Sequential`` of blocks), found by :func:`repeated_blocks`."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from .digest import local_shard
from .tied import EMBEDDING, HEAD_COPY
from .train import Trainer

__all__ = ["OuterGroup", "fragment_of", "outer_groups", "repeated_blocks", "tied_slice"]


class OuterGroup(list[tuple[str, torch.Tensor]]):
    """One sync group of :func:`outer_groups`: ``(name, local shard)`` pairs, and the
    index of the repeated block it is (None: the parameters outside the blocks)."""

    block: int | None = None


def repeated_blocks(module: nn.Module) -> tuple[str, list[tuple[str, nn.Module]]]:
    """Where ``module`` keeps its repeated blocks, and its children with parameters in
    order: the built-in model's ``layers``, else the ModuleList, ModuleDict or Sequential
    at any depth ("" for the root) with two or more children holding parameters,
    preferring children of one class, then the most parameters. ("", []) if none."""
    layers = getattr(module, "layers", None)
    if isinstance(layers, nn.ModuleDict):
        return "layers", list(layers.items())
    best: tuple[tuple[bool, int], str, list[tuple[str, nn.Module]]] | None = None
    for name, container in module.named_modules():
        if not isinstance(container, (nn.ModuleList, nn.ModuleDict, nn.Sequential)):
            continue
        children = [
            (key, child)
            for key, child in container.named_children()
            if any(True for _ in child.parameters())
        ]
        if len(children) < 2:
            continue
        alike = len({type(child) for _, child in children}) == 1
        size = sum(p.numel() for _, child in children for p in child.parameters())
        if best is None or (alike, size) > best[0]:
            best = ((alike, size), name, children)
    return ("", []) if best is None else (best[1], best[2])


def outer_groups(trainer: Trainer) -> list[OuterGroup]:
    """This rank's local parameter shards in sync groups: model part by model part, each
    repeated block (:func:`repeated_blocks`) in order, then the part's parameters outside
    them (embedding, final norm, head). Groups without elements here are left out; the
    rank at one coordinate of every site holds the same shards, so the same groups."""
    groups: list[OuterGroup] = []
    for part in trainer.model_parts:
        where, blocks = repeated_blocks(part)
        inside: set[str] = set()
        for position, (key, block) in enumerate(blocks):
            prefix = f"{where}.{key}." if where else f"{key}."
            group = OuterGroup(
                (prefix + fqn, local_shard(p)) for fqn, p in block.named_parameters()
            )
            # The built-in model's keys are its global layer numbers (pipeline stages
            # hold slices of them); a user's blocks count from 0.
            group.block = int(key) if where == "layers" and key.isdigit() else position
            inside.update(name for name, _ in group)
            groups.append(group)
        groups.append(
            OuterGroup(
                (fqn, local_shard(p)) for fqn, p in part.named_parameters() if fqn not in inside
            )
        )
    return [g for g in groups if sum(t.numel() for _, t in g) > 0]


def tied_slice(
    trainer: Trainer, groups: Sequence[Sequence[tuple[str, torch.Tensor]]]
) -> tuple[int, int, int] | None:
    """Where this rank's copy of a weight tied across pipeline stages sits in its flat
    outer group: ``(group index, offset, elements)``; None without one."""
    tied = getattr(trainer, "tied", None)
    if tied is None:
        return None
    name = HEAD_COPY if tied.is_head else EMBEDDING
    for i, group in enumerate(groups):
        offset = 0
        for fqn, t in group:
            if fqn == name:
                return i, offset, t.numel()
            offset += t.numel()
    return None  # an empty local shard (dp wider than the vocabulary): nothing to average


def fragment_of(group: Sequence[tuple[str, torch.Tensor]], fragments: int) -> int:
    """The fragment a group of :func:`outer_groups` belongs to: block i's is i mod P;
    the parameters outside the blocks go with the last fragment (synced at the H
    boundaries, like DiLoCo's one round)."""
    block = getattr(group, "block", None)
    if block is None and group[0][0].startswith("layers."):
        block = int(group[0][0].split(".", 2)[1])  # a plain list of the built-in names
    return fragments - 1 if block is None else block % fragments
