"""The loaded-model source: a PeftModel walked module by module, its weights and changes, planned."""
