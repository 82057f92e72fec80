"""The engine loop: the door, step() -> Step, the two batching modes, the engine process, the running batch."""
