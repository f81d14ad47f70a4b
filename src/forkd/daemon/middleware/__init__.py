"""ASGI middleware around the API, outermost first: audit log, bearer token (TCP), body limit, request metrics."""
