"""Processes: `sluice serve` and `sluice gateway` (`serve.py`), `serve --replicas N` (`replicas.py`),
the local worker processes a gateway supervises (`children.py`), and their CLI (`cli.py`).
May import anything in the gateway; nothing imports it but the CLI."""
