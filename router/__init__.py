"""``kvforge router``: a prefix-aware HTTP router in front of separate ``kvforge serve`` replicas
(docs/distributed.md, "A prefix-aware router").

``backends.py`` keeps each replica's state (healthy or not, its load, the prefix blocks it holds: from its
``GET /kv_events`` and the requests routed to it); ``app.py`` is the FastAPI proxy that scores the replicas for
each request with ``kvforge.engine.prefix_router`` (the data-parallel front end's code) and forwards it;
``cli.py`` is the command.
"""
