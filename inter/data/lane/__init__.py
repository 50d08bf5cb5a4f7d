"""Lane: the gRPC service between the ranks at one mesh coordinate of every site
(docs/design.md, "Rooms").

:mod:`.server` serves it (chunks in, judged by transport's checks); :mod:`.gate` checks
whose name a call or chunk may carry; :mod:`.mailbox` keeps chunks until a round takes
them or no peer can ask again; :mod:`.handoff` is what a lane hands only to a site of its
rounds; :mod:`.requests` its other calls (a round given up, a joiner's state pull);
:mod:`.peer` is the sending side, one client a peer site. Each helper is handed what it
uses, never the server: the server imports them, none imports it.
"""
