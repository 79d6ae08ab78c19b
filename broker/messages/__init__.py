"""The wire message dataclasses behind `broker.protocol`, grouped by the socket that carries them.

`common` (the `Message` base, and what both sockets carry), `worker` (the worker socket: turns) and
`trainer` (the control socket: sessions, finishes, episodes). `broker.protocol` re-exports every class
and defines the unions per direction; everyone imports them from there, never from here.
Stdlib and `broker.codec.wire` (the field markers) only: no zmq, nothing else of `broker`.
"""
