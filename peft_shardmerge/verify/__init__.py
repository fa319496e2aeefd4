"""Checking a finished output: integrity against its record, recomputation, and logits against a reference."""
