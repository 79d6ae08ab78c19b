"""Gateway workers: the HTTP side that faces agents (adapters, rendering, parsing, engines, backplane).

Importing the package loads nothing: each submodule is imported where it is used, so the
trainer client and the broker never pull in starlette, uvloop or transformers through it.
Nothing outside `gateway_workers` imports this package.
"""
