"""The gateway's metrics, aggregated here: the workers' snapshots (`gateway`), what each series means
(`catalog`), and the Prometheus text any worker's `/metrics` answers with (`exposition`)."""
