"""Hugging Face Spaces: detection, and what ZeroGPU's ``spaces`` package expects of the server's start.

``spaces`` runs its start-up from a patched ``gr.Blocks.launch`` (it packs the weights the web process loaded
onto "cuda" and reports the app to ZeroGPU's scheduler). Our server mounts Gradio on its own FastAPI app
(``gr.mount_gradio_app``) and never calls ``launch``, so it runs that start-up itself (:func:`start_zerogpu`),
once, before it serves; and it names its uvicorn server where ``spaces`` looks for Gradio's (:func:`expose_server`).
"""

from __future__ import annotations

import os

import gradio as gr
import uvicorn


def on_spaces() -> bool:
    """True inside a Hugging Face Space (where share links are not supported)."""
    return bool(os.environ.get("SPACE_ID"))


def start_zerogpu() -> None:
    """Run the start-up ``spaces`` hooked into ``gr.Blocks.launch`` (pack the registered weights, tell the scheduler
    the app is up), then put ``launch`` back as ``spaces``' own wrapper does after running it: it runs once.

    Call it once the weights are loaded and the GPU function is decorated (``spaces`` reports nothing to the
    scheduler without one), before the first GPU call forks a worker. ``spaces`` is pinned in requirements.txt:
    this reaches its ``spaces.zero.startup``, which is what the hook calls (read from spaces 0.51.3)."""
    import spaces.zero

    hooked = gr.Blocks.launch
    spaces.zero.startup()  # defined only on ZeroGPU
    gr.Blocks.launch = hooked.__wrapped__  # type: ignore[attr-defined, method-assign]  # functools.wraps kept it


def expose_server(demo: gr.Blocks, server: uvicorn.Server) -> None:
    """Where ``spaces`` looks for the server's port: a GPU worker, forked from this process, closes the sockets of
    that port it inherited (a connection the server closes must close for the browser too, not live on in the
    worker). Gradio's ``launch`` sets ``demo.server``; a mounted app has none, so ours is named there."""
    demo.server = server  # type: ignore[assignment]
