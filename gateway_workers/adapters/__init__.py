"""Wire adapters: one module per agent-facing API dialect (body -> TurnRequest, turn -> reply)."""
