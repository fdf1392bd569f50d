"""kvtier cache service: owns one accelerator's paged KV block pool and serves it over gRPC."""
