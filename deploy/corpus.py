"""The job's corpus and its held-out split, as the [data] section describes them."""

from __future__ import annotations

from isthmus.deploy.config import ConfigError, JobConfig
from isthmus.intra.data import Corpus, Split, from_path, split_corpus, stdlib_corpus

__all__ = ["load_corpus"]


def load_corpus(config: JobConfig) -> tuple[Corpus, Split]:
    """The corpus every rank of the job reads, and which of its tokens train and which
    are held out (data.val_fraction): the same on every machine for the same config.

    Raises:
        ConfigError: the corpus cannot be read or is too short to split (the message
            says which setting to change).
    """
    d = config.data
    try:
        corpus = (
            stdlib_corpus(d.max_bytes)
            if d.source == "stdlib"
            else from_path(d.path, max_bytes=d.max_bytes)
        )
        return corpus, split_corpus(len(corpus), d.val_fraction, config.train.seq_len)
    except ValueError as exc:
        raise ConfigError(f"data: {exc}") from None
