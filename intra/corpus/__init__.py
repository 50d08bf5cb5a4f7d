"""The corpus, from files to batches; one file per stage, each imported by its own name
(nothing here, so the config reads tokenizer facts without numpy):

- prepare.py: `isthmus data prepare`, local files to token shards and a manifest, reading
  its inputs through documents.py;
- tokenizer.py: bytes, a BPE trained here, or a tokenizer.json, and its sha256;
- tokens.py: a corpus's tokens read: the standard library, a user's file, a prepared
  folder's shards;
- batches.py: the held-out split and the stateless, sharded batches;
- cache.py: the job's corpus as its [data] section describes it, tokenized once and kept
  in data.cache_dir.
"""
