"""Everything that makes N processes behave like one: sharding, SyncBatchNorm, gathering. Models do not know about it."""
