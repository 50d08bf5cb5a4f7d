"""The data plane: lanes, rounds, the cross-site all-reduce, codecs, state transfer."""
