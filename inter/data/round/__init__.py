"""Round: one cross-site all-reduce (docs/design.md, "Rooms").

:mod:`.allreduce` runs a bucket's all-reduce over the lanes as a :mod:`.pipeline` of
small :mod:`.tasks` on the lane's pool threads; :mod:`.context` is what a round runs
under and reports (its membership view, statistics, abort flag and errors);
:mod:`.device` what its threads keep per device; :mod:`.pull` its calls back to peers
(a chunk asked again, a round given up).
"""
