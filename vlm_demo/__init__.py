"""LLaVA-CoT (Llama-3.2V-11B-cot) demo server: batching engine, Gradio UI, Triton bridge."""
