"""The HTTP edge every route shares: OpenAI-style errors, strict JSON bodies, the OpenAPI document,
OPTIONS handling and the OpenAI request/response schemas (msgspec structs, converted to the
protocol's types in generation/). Imports nothing else of the gateway.
"""
