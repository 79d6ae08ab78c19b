"""The HTTP edge of a worker: who the agent is, whether it is still connected, and the agent finish route.

Plain ASGI and asyncio; must not import the adapters' dialects, rendering, engines or capture.
"""
