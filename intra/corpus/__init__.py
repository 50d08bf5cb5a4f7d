"""The corpus, from files to batches, one file per stage (each imported by its own name;
nothing here, so the config reads a tokenizer's facts without numpy): prepare.py
(`isthmus data prepare`: local files, read by documents.py, to token shards), tokenizer.py
(bytes, a BPE trained here or a tokenizer.json), tokens.py (a corpus's tokens read: the
standard library, a file, a prepared folder's shards), batches.py (the held-out split,
the stateless sharded batches), cache.py (the job's corpus from its [data] section,
tokenized once and kept in data.cache_dir)."""
