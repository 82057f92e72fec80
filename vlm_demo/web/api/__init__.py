"""The programs' doors: the OpenAI-compatible /v1 (chat, responses) and MCP."""
