"""The chain of thought's format: its four stages read from streamed text, and the judge prompt that picks between two candidates."""
