"""E2B's API served by the daemon, so E2B's own SDKs drive forkd (docs/e2b.md)."""
