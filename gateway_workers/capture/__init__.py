"""Capture: the worker's side of the backplane to the broker (OPEN, COMMIT, ABORT) and its commit bases.

Imports `broker.protocol` and nothing else from the broker; must not import the adapters or engines.
"""
