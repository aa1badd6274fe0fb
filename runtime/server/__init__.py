"""The HTTP servers: the app, the native, OpenAI, Anthropic and Responses APIs, metrics."""
