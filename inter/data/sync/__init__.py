"""Sync: a rank's cross-site gradient sync, the seam intra's step calls (docs/design.md,
"Rooms").

:mod:`.rank` opens it with one call (``open_rank_sync``); :mod:`.gradient` is the
``LaneGradientSync`` the trainer drives, over :mod:`.buffers` and with :mod:`.stats` as
its report; :mod:`.membership` is the rank's side of the job's membership (votes,
generations); :mod:`.shard_map` pairs the ranks of sites of different sizes.
"""
