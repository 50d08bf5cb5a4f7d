"""The control plane: coordinators, failover, leader election, membership, witness."""
