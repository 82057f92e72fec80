"""What the web process may import of the engine: the pipe's messages and the clients' handles (torch-free)."""
