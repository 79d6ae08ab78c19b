"""Rendering: canonical messages + tools -> prompt token ids with the model's own chat template.

`renderer.Renderer` is the entry point; `messages` shapes canonical messages for the template, `pieces`
cuts and caches the rendered text; `tokenizer` loads the tokenizer; `twins/` holds the fast paths
checked against the exact originals. Must not import the adapters, turns, engines or capture.
"""
