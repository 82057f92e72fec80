"""Start the LLaVA-CoT web demo: ``python app.py [--model tiny] [--port 7860] [--share --auth U:P]``.

Also the ``app_file`` of the Hugging Face Space. It only parses options and launches; see
``vlm_demo/web/server.py`` (web server) and ``vlm_demo/web/page/layout.py`` (the page). Options are parsed before
Gradio and torch are imported, so ``--help`` and a mistyped flag answer at once; the first import after them is
Hugging Face's ``spaces`` package (on a ZeroGPU Space it must patch torch before anything can initialise CUDA;
elsewhere it does nothing).
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # no version-check calls home


def main(argv: list[str] | None = None) -> None:
    from vlm_demo.config import load_config

    config = load_config(argv, description="LLaVA-CoT (Llama-3.2V-11B-cot) web demo")
    from vlm_demo.models.choice import folder_problem  # torch-free

    problem = None if config.triton_url else folder_problem(config.model)  # before spaces, gradio and torch load
    if problem:
        raise SystemExit(f"Cannot start the model: {problem}")
    import spaces  # noqa: F401 - first of everything that may reach torch: ZeroGPU's CUDA emulation (docs/gpu.md)

    from vlm_demo import logs

    logs.setup()
    from vlm_demo.web.server import serve  # imports gradio and torch: seconds

    serve(config)


if __name__ == "__main__":
    main(sys.argv[1:])
