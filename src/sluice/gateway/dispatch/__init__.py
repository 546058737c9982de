"""Which request runs next, and where: the fair scheduler (`fair.py`, cluster-wide counters in
`fair_shared.py`), the worker slots of the room rule (`slots.py`), the jobs (`jobs.py`) and the
dispatcher (`dispatcher.py`) that sends them over worker links (`links/`: a worker process over TCP,
an engine in this process, an upstream HTTP server). May import cluster/ and the protocol only.
"""
