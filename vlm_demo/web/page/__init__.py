"""The Gradio page: its layout, events, rendering, contract and conversation."""
