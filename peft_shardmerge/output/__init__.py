"""The output folder: shard sinks, the streaming writer, staging and commit, recovery, lock, record, side files."""
