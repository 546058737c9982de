"""Kafka: the class topics and their clients (`kafka.py`), the backend seam the routes talk to
(`backend.py`), accepting requests durably and running batch lines (`acceptance.py`), the backend
without Kafka for tests (`local.py`), and the live view of queues and workers (`snapshot.py`).
May import dispatch/, cluster/, streams.holder and streams.log.
"""
