"""From an OpenAI request body to an accepted request, and its end.

`tokenization.py` renders chat templates and counts tokens; `service.py` validates a body into a
`GenerateRequest`, admits it against the quotas, submits it to the backend and settles it at its end.
May import edge/, auth/, quotas/ and queueing.backend (the backend seam), never streams/ or dispatch/.
"""
