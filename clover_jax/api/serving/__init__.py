"""`clover-jax serve`: an OpenAI-compatible HTTP server over the serving engine (`decoding.engine`).

`app` (routes), `protocol` (request bodies), `service` (requests -> engine requests), `responses`
(tokens -> text, reasoning and tool calls), `text`, `reasoning`, `tool_calls` (the parsers),
`server` (starting it). docs/serving.md describes the whole.
"""
