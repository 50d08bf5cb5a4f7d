"""`isthmus tokenizer`: train the job's BPE once and write it as a tokenizer.json.

Train it with the job's config (--config), so it sees the job's training split: the
split depends on data.* and train.seq_len. With the file at every site no site trains.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from isthmus.deploy.config.job import ConfigError, load_config

__all__ = ["register"]


def cmd_tokenizer(args: argparse.Namespace) -> int:
    """train the job's BPE tokenizer once and write it as a tokenizer.json

    Train a byte-level BPE on the training split of the job's corpus (data.source,
    data.path, data.max_bytes; never on held-out text), exactly as a job with
    data.tokenizer=bpe does (and through the same cache, data.cache_dir), and write it as a
    tokenizers tokenizer.json. Give the file to every site with --set data.tokenizer=FILE.
    Prints its sha256 (data.tokenizer_sha256)."""
    from isthmus.intra.corpus.cache import trained_tokenizer, write_atomically
    from isthmus.intra.corpus.tokenizer import json_vocab_size, tokenizer_sha256

    flags = {"data.tokenizer": "bpe", "data.vocab_size": args.vocab_size}
    config = load_config(args.config, args.overrides, flags)
    out = Path(args.out)
    if out.exists() and not args.force:
        raise ConfigError(f"--out {out} exists; pass --force to replace it")
    json_text = trained_tokenizer(config.data, seq_len=config.train.seq_len)
    try:
        write_atomically(out, json_text.encode())
    except OSError as exc:
        raise ConfigError(f"--out {out}: {exc.strerror or exc}") from None
    d = config.data
    sha = tokenizer_sha256(json_text)
    corpus = d.path if d.source == "path" else "the standard library"
    print(
        f"wrote {out}: {json_vocab_size(json.loads(json_text))} tokens (data.vocab_size = "
        f"{d.vocab_size}), trained on the training split of {corpus}"
    )
    print(f"sha256 {sha}")
    print(f"every site (and a witness): --set data.tokenizer={out}")
    return 0


def register(sub: argparse._SubParsersAction, formatter: type[argparse.HelpFormatter]) -> None:
    from isthmus.deploy.commands import add_command
    from isthmus.deploy.commands.arguments import add_config_arguments

    parser = add_command(sub, formatter, "tokenizer", cmd_tokenizer)
    add_config_arguments(parser, common_flags=False)
    add = parser.add_argument
    add("--out", required=True, metavar="FILE", help="the tokenizer.json to write")
    add(
        "--vocab-size",
        type=int,
        metavar="N",
        help="tokens, the 256 bytes included, 257..65536 (default: data.vocab_size, 4096)",
    )
    add("--force", action="store_true", help="replace an existing --out")
