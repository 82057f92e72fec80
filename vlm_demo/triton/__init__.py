"""What our Triton Inference Server serves: the wire contract, the request handlers, the PyTriton server and
the classic model repository (``repo/``). The client side is :mod:`vlm_demo.backends.triton`."""
