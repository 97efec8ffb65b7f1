"""Entry points: the CLI, the offline LLM class and the OpenAI-compatible server."""
