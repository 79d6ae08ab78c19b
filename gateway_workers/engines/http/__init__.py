"""The engine backends' HTTP/1.1 client: keep-alive pools (`client`) over asyncio protocols (`connection`).

Must not import anything else from the gateway.
"""
