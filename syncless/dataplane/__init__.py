"""Observability for key-value tensor transfer clients."""
