"""`isthmus chaos`: the fault-injection suite, its scenarios and its hostile callers."""
