"""The kinds of worker link (`base.py` is the interface): `tcp.py` (worker processes on the worker
port), `inprocess.py` (an engine host in this process), `upstream.py` (an OpenAI-compatible HTTP
server, through the lean client of `upstream_http.py`)."""
