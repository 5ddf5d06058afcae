"""The reference engine: a tiny real LLM engine in plain torch for CPUs (``model``, the
``engine`` that serves it, its OpenAI-compatible HTTP server ``openai_api``)."""
