"""Executing schedules: stage compute, transfers, micro-batching."""
