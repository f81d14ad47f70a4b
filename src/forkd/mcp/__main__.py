"""``python -m forkd.mcp``: the same as the ``forkd-mcp`` command."""

from forkd.mcp.main import main

main(prog_name="forkd-mcp")
