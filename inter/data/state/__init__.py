"""State: training state between sites as named tensors in pieces (docs/design.md,
"Rooms", invariant 3).

:mod:`.transfer` is the pieces' format and the pulling side; :mod:`.offers` what a live
rank offers a joining site's ranks, once each, dropped at a deadline.
"""
