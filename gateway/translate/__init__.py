"""Translation between client APIs and the chat completions the gateway serves (pure functions)."""
