"""Anthropic's Messages API (``/v1/messages``) as a translation layer over the chat completion path."""
