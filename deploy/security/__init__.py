"""Who a job trusts: the job token, mutual TLS beyond loopback, checkpoint signing."""
