"""``forkd-mcp``: forkd's sandboxes as Model Context Protocol tools, over the daemon's REST API."""
