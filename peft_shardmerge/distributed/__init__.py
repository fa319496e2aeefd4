"""Many processes: the world, the ranks of a disk merge, and models sharded by FSDP1, FSDP2 and ZeRO-3."""
