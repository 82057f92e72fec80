"""The Triton backend, by contract and transport: ``backend`` (the :class:`~vlm_demo.backends.base.Backend`),
``infer`` and ``generate`` (the two wire contracts, client side), ``transport`` (HTTP and gRPC, asynchronous),
``stream`` (one answer in flight) and ``remote`` (the server: readiness, metadata, what its failures mean)."""
