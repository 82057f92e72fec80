"""LLaVA-CoT (Llama-3.2V-11B-cot) demo server: a Gradio page in front of our own batching engine."""

import logging
import os
import sys

PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(PACKAGE_DIR)  # app.py, assets/ and docs/ live here
ASSETS_DIR = os.path.join(REPO_ROOT, "assets")


class _TorchaoImportNoise(logging.Filter):
    """transformers imports torchao (``--quantize``'s library) with every model class. On a CPU-only torch
    its CUDA kernels (``_C*.so``) cannot load and it logs one warning per file, and with any torch it registers
    enums in a way torch logs as deprecated: noise at every start, not news. A CUDA torch that cannot load
    them still says so."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if "is an Enum subclass and is now natively supported" in message:
            return False
        torch = sys.modules.get("torch")
        cpu_only = torch is not None and getattr(getattr(torch, "version", None), "cuda", "") is None
        return not (cpu_only and message.startswith("Failed to load") and ".so" in message)


logging.getLogger("torchao").addFilter(_TorchaoImportNoise())
logging.getLogger("torch.utils._pytree").addFilter(_TorchaoImportNoise())
