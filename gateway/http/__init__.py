"""HTTP layer: the Litestar app, its handlers and error table, SSE responses, the uvicorn server."""
