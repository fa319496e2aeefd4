"""The merge itself: the typed plan, the per-tensor row merge and its maths, the executors, budget and report."""
