"""Tools that agents call: a sandboxed Python interpreter."""

from molt_lightning.agents.tools.sandbox import PythonSandbox, SandboxResult, python_tool_schema

__all__ = ["PythonSandbox", "SandboxResult", "python_tool_schema"]
