"""The web process: the FastAPI server, the Gradio page, its handlers and rendering, metrics."""
