"""LLaVA-CoT (Llama-3.2V-11B-cot) demo server: a Gradio page in front of our own batching engine."""

import os

PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(PACKAGE_DIR)  # app.py, assets/ and docs/ live here
ASSETS_DIR = os.path.join(REPO_ROOT, "assets")
