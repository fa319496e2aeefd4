"""What users call: merge_checkpoint, merge_and_save, merge_and_unload, the Unsloth-style drop-ins, the Hub, the
command line."""
