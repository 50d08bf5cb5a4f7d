"""Transport: a round's chunks on the wire between two lanes (docs/design.md, "Rooms").

:mod:`.wire` is a chunk's wire form; :mod:`.chunk_size` cuts transfers for a link and
bounds the connections; :mod:`.chunk_checks` is what a receiver accepts. Chunks travel
on the bulk port (:mod:`.bulk` receives, :mod:`.bulk_peer` sends, :mod:`.bulk_stream` is
one connection's bytes, plain or in TLS, a plain payload read in C by :mod:`.wirecore`)
or as one-chunk gRPC calls (:mod:`.push`); :mod:`.peer_round` is one round's chunks to
one peer over either, :mod:`.flow_clock` when a frame is overdue on both; :mod:`.link_watch`
reads each peer site's bulk connections once a step (rate, RTT, window, retransmits).
"""
