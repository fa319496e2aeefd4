"""What is claimed and refused: the allowlist, PEFT reading rules, model checks, adapter combinations."""
