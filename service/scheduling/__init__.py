"""Continuous batching on the coordinator: requests, the scheduler, row and KV-slot allocators."""
