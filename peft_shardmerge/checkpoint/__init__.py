"""The disk source: a base checkpoint and adapter folders read, planned and turned into per-tensor changes."""
