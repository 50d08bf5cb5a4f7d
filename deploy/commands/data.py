"""`isthmus data prepare`: the command line of intra/corpus/prepare.py, which says how
local files become token shards."""

from __future__ import annotations

import argparse
from pathlib import Path

from isthmus.deploy.commands import add_group
from isthmus.intra.corpus.prepare import DEFAULT_SHARD_TOKENS, prepare

__all__ = ["register"]


def cmd_data_prepare(args: argparse.Namespace) -> int:
    out = Path(args.out)
    manifest = prepare(
        [Path(s) for s in args.inputs],
        Path(args.tokenizer),
        out,
        text_field=args.text_field,
        eos=args.eos,
        shard_tokens=args.shard_tokens,
        force=args.force,
        progress=not args.quiet,
    )
    print(
        f"wrote {out}: {manifest['tokens']:,} tokens of {manifest['documents']:,} documents "
        f"in {len(manifest['shards'])} shard(s), tokenizer sha256 {manifest['tokenizer']['sha256']}"
    )
    print(
        f"every site: --set data.source=prepared --set data.path={out} "
        f"--set data.tokenizer={out / 'tokenizer.json'}"
    )
    return 0


def register(sub: argparse._SubParsersAction, formatter: type[argparse.HelpFormatter]) -> None:
    """turn local text/jsonl/parquet files into token shards once

    Work on training data before a job (docs/data.md)."""
    actions = add_group(sub, formatter, "data", register, "data_action", "ACTION")
    prep = actions.add_parser(
        "prepare",
        help="tokenize local files into a folder of token shards and a manifest",
        description="Tokenize local files (.txt: one document a file; .jsonl: one a line, "
        "its --text-field; .parquet: one a row, through the datasets library, offline) with "
        "a tokenizer.json into uint16 token shards and a manifest.json (token counts, the "
        "tokenizer's sha256, each input's sha256 and size), written whole under a temporary "
        "name and renamed to --out. Train on it with data.source=prepared, data.path=OUT, "
        "data.tokenizer=OUT/tokenizer.json.",
        formatter_class=formatter,
    )
    add = prep.add_argument
    add("inputs", nargs="+", metavar="FILE", help=".txt, .jsonl or .parquet files")
    add("--tokenizer", required=True, metavar="FILE", help="a tokenizer.json")
    add("--out", required=True, metavar="DIR", help="the folder to write")
    add("--text-field", default="text", metavar="NAME", help="jsonl/parquet text field")
    add(
        "--eos",
        metavar="TOKEN",
        help="a token of the tokenizer appended after every document (default: none)",
    )
    add(
        "--shard-tokens",
        type=int,
        default=DEFAULT_SHARD_TOKENS,
        metavar="N",
        help=f"tokens a shard holds at most (default {DEFAULT_SHARD_TOKENS:,})",
    )
    add("--force", action="store_true", help="replace an existing --out")
    add("--quiet", action="store_true", help="no progress bar")
    prep.set_defaults(func=cmd_data_prepare)
