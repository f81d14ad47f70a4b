"""forkd: fork warm microVMs copy-on-write — a fresh, isolated Linux VM per task in milliseconds."""

__version__ = "0.1.0"
