"""forkd for agent frameworks: thin adapters over the SDK, each behind its own extra (docs/integrations.md).

- ``forkd.integrations.langchain``: ``ForkdPythonTool`` and ``ForkdShellTool``, LangChain tools (LangGraph's
  ``ToolNode`` takes them as they are); ``pip install 'forkd[langchain]'``.
- ``forkd.integrations.autogen``: ``ForkdCodeExecutor``, an AutoGen ``CodeExecutor``; ``pip install 'forkd[autogen]'``.

This package imports neither framework; each module imports its own.
"""
