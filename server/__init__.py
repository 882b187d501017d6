"""The OpenAI-compatible HTTP server (``kvforge serve``)."""
