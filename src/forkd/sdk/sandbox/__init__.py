"""The SDK's core, shared by ``sandbox_sync`` (``Sandbox``) and ``sandbox_async`` (``AsyncSandbox``).

Every method of the sandbox, its ``commands`` and its ``files`` is written here once, as a step
generator (``flavour.py``): it builds requests and reads answers but never waits itself, so it
imports no HTTP client. A flavour supplies the client and runs the steps, straight through or
awaiting each one.
"""
