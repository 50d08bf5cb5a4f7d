"""One site: topology, model, data, FSDP2 data parallelism, the training step."""
